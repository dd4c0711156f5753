"""The experts' loads and selection biases between iterations (models/moe.py, docs/moe.md).

Each router counts the (token, choice) pairs it sent to each expert during an iteration's
training forwards (not recomputations, not validation). After the optimizer step
`ExpertLoads.settle` sums those counts over every rank that routed other tokens of the global
batch (the data and context ranks, and the tensor ranks with sequence parallelism; expert
ranks are folded out of data x context) and over the pipeline (each stage holds other layers),
so every rank knows the global batch's load of every expert of every MoE layer. With
auxiliary-loss-free balancing (`model.moe_expert_bias_rate` > 0) each layer's selection bias
then moves by the rate against the sign of its expert's excess load (DeepSeek-V3):
b_i += rate * sign(mean load - load_i); a skipped fp16 step moves nothing.

The biases are state a checkpoint keeps (`ExpertBiasState`, metadata "moe": every MoE layer's
bias by global layer index, gathered over the pipeline), so any layout resumes them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ptdp.metrics.log import LOAD_FIELD
from ptdp.models.moe import Router, routers_by_layer


class ExpertLoads:
    """This rank's routers by global layer, and the loads of the latest settled iteration."""

    def __init__(self, state):
        self.state, model = state, state.cfg.model
        # the decoder's MoE layers, then the multi-token-prediction depths' (models/mtp.py)
        self.layers = [layer for layer in range(model.num_layers + model.mtp_layers)
                       if model.is_moe_layer(layer)]
        self.routers: dict[int, Router] = {}
        for chunk in state.chunks.values():
            self.routers.update(routers_by_layer(chunk))
        self.latest: torch.Tensor | None = None   # [MoE layers, E] float64, on the host
        self.total = torch.zeros(len(self.layers), model.num_experts, dtype=torch.float64)

    def _gathered(self, rows: dict[int, torch.Tensor], token_groups: bool) -> torch.Tensor:
        """[MoE layers, E]: each layer's row from the rank holding it (summed over the ranks
        that split its tokens if `token_groups`), on every rank."""
        grid = self.state.grid
        table = torch.zeros(len(self.layers), self.state.cfg.model.num_experts,
                            dtype=torch.float64, device=self.state.device)
        for layer, row in rows.items():
            table[self.layers.index(layer)] = row.to(table.device, table.dtype)
        axes = [("pipeline",)]
        if token_groups:
            axes += [("data", "context")] + ([("tensor",)] if self.state.tp.sequence_parallel
                                              else [])
        for names in axes:
            if grid.size(*names) > 1:
                dist.all_reduce(table, group=grid.group(*names))
        return table

    def settle(self, stepped: bool) -> None:
        """The iteration's loads, global; the biases moved if the optimizer `stepped`."""
        loads = self._gathered({layer: r.loads for layer, r in self.routers.items()}, True)
        for router in self.routers.values():
            router.loads = torch.zeros_like(router.loads)
        rate = self.state.cfg.model.moe_expert_bias_rate
        if stepped and rate > 0:
            for layer, router in self.routers.items():
                load = loads[self.layers.index(layer)]
                step = rate * torch.sign(load.mean() - load)
                router.expert_bias = router.expert_bias.to(load.device) + step.float()
        self.latest = loads.cpu()
        self.total += self.latest

    def metrics(self) -> dict:
        """The settled iteration's load summary: max over mean tokens per expert, the worst
        MoE layer's (1 = perfectly balanced)."""
        if self.latest is None:
            return {}
        ratio = self.latest.max(1).values / self.latest.mean(1).clamp(min=1e-12)
        return {LOAD_FIELD: float(ratio.max())}

    def biases(self) -> torch.Tensor:
        """[MoE layers, E] selection biases, on every rank (collective over the pipeline)."""
        return self._gathered({layer: r.expert_bias for layer, r in self.routers.items()}, False)


class ExpertBiasState:
    """The selection biases as a checkpoint holds them (metadata "moe")."""

    def __init__(self, loads: ExpertLoads):
        self.loads = loads

    def state_dict(self) -> dict:
        table = self.loads.biases().cpu().tolist()
        return {"expert_bias": {str(layer): row for layer, row in zip(self.loads.layers, table)}}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint without biases (saved without balancing, or converted) leaves them 0."""
        saved = state.get("expert_bias", {})
        for layer, router in self.loads.routers.items():
            if str(layer) in saved:
                router.expert_bias = torch.tensor(saved[str(layer)], dtype=torch.float32)
