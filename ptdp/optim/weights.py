"""The master weights interface: what the steps and the training state ask of fp32 masters.

Two kinds implement it: replicated masters, every data rank holding all of them
(`MasterWeights`, ptdp/optim/mixed_precision.py), and masters sharded over the data group
with the distributed optimizer (`ShardedMasterWeights`, ptdp/optim/distributed.py; with
parameters of several reduce groups, experts beside dense ones, one per group:
`ShardedSets`, ptdp/optim/sharded_sets.py). A fully
sharded kind (the model weights sharded too, gathered per layer) would be a third. Callers
never ask which kind they hold: each kind says how its gradients are reduced, what the
gradient norm sums over, and how it saves and loads its masters and optimizer moments.

Saving and loading speak whole local tensors per model parameter, this rank's shard of each
in the tensor-parallel layout, whatever the kind: a sharded kind assembles them from (and
slices them into) its pieces, collectively over the group it is sharded over.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn

from ptdp.optim.buffers import FlatGrads

MOMENTS = ("exp_avg", "exp_avg_sq")   # AdamW's per-element state, besides its "step"


class Weights(Protocol):
    params: list[nn.Parameter]       # the model's parameters of this rank
    masters: list[nn.Parameter]      # what the optimizer steps
    flat_grads: FlatGrads | None     # the gradient buffer the reduction slices, if one
    shard_layout: list | None        # the sharded sets whose buckets the data-parallel
                                     # reduction reduce-scatters, one per reduce group
                                     # (ptdp/optim/grads.py); None: all-reduced
    masters_are_pieces: bool         # each master is this rank's own piece of a parameter
                                     # (sharded): the norm counts every piece where it is,
                                     # not a whole tensor once per replica group

    # The iteration ---------------------------------------------------------------------------
    def zero_grads(self) -> None: ...

    def grads_to_masters(self) -> None:
        """Hand the data-parallel sums to the masters' `.grad`."""

    def sync_shared_embeddings(self, group, size: int) -> None:
        """Sum the tied word embedding's gradient between its first- and last-stage copies."""

    def masters_to_model(self) -> None:
        """The stepped masters into the model's (maybe low-precision) weights."""

    # Whole tensors (checkpoints, tests, reports) ----------------------------------------------
    def master_param_indices(self) -> list[int]:
        """Per master, the index in `params` of the parameter it is (part of)."""

    def full_grads(self) -> list[torch.Tensor | None]:
        """Per parameter, its whole reduced gradient (after `grads_to_masters`)."""

    def state_dict(self) -> list[torch.Tensor]:
        """Per parameter, its fp32 master, shaped like the parameter."""

    def load_state_dict(self, values: list[torch.Tensor]) -> None:
        """Masters from `values` (as `state_dict` gives them); the model's weights follow."""

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> list[dict]:
        """Per parameter {"exp_avg", "exp_avg_sq", "step"}, whole; {} before the first step."""

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                  per_param: list[dict]) -> None:
        """Moments and step from `per_param` (as `optimizer_state_dict` gives them); a
        parameter without them keeps a fresh state."""

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of fp32 state kept for the optimizer (masters apart from the model, moments)."""


def has_moments(saved: dict) -> bool:
    return "step" in saved and all(key in saved for key in MOMENTS)


def load_optimizer_states(optimizer: torch.optim.Optimizer, by_master: dict[int, dict]) -> None:
    """Put {id(master): {"step", *MOMENTS}} into `optimizer` through its own
    `load_state_dict`, so torch places and casts them; other masters keep a fresh state."""
    sd = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sd["state"] = {index: by_master[id(p)] for index, p in enumerate(params)
                   if id(p) in by_master}
    optimizer.load_state_dict(sd)
