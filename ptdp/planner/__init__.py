"""The closed-form planner: cost model, search, partitioner, `ptdp plan`.

Nothing in this package imports torch (tests/planner/test_purity.py checks), so `ptdp plan`
stays fast. It reads hardware profiles from `ptdp.hardware`; `ptdp profile`
(ptdp/profiler/) measures them and depends on this package, never the other way round.
Entry points: `formulas` (Eq. 4.2-4.4 and BERT's counterparts, also for the trainer's
metrics), `cost_model.predict`, `search.search`, `partitioner.partition`, the CLI in `cli`.
"""

from ptdp.planner.formulas import model_flops_per_iteration, parameter_count, training_days

__all__ = ["model_flops_per_iteration", "parameter_count", "training_days"]
