"""The closed-form planner: cost model, hardware catalogue, search, profiler, partitioner.

Nothing in this package imports torch.distributed, and only `profiler` imports torch (lazily),
so `ptdp plan` stays fast. Entry points: `formulas` (Eq. 4.2-4.4, for the trainer's metrics),
`cost_model.predict`, `search.search`, `partitioner.partition`, and the CLI in `cli`.
"""

from ptdp.planner.formulas import model_flops_per_iteration, parameter_count, training_days

__all__ = ["model_flops_per_iteration", "parameter_count", "training_days"]
