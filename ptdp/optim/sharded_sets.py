"""The distributed optimizer over several reduce groups: one sharded set per group.

With expert parallelism a rank's parameters are reduced over two groups (ptdp/parallel/roles.py):
the dense ones over data x context, the experts over expert_data (the ranks holding the same
experts). Each group shards its own parameters' masters and moments, so `ShardedSets` keeps one
`ShardedMasterWeights` (ptdp/optim/distributed.py) per reduce set and answers the master
weights interface (ptdp/optim/weights.py) for the whole list, in the parameters' order. Every
collective of a set runs over that set's group, the sets in the same order on every rank of a
stage (the order in which their parameters first appear, the same on every rank).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ptdp.optim.distributed import ShardedMasterWeights
from ptdp.optim.optimizer import optimizer_moment_bytes
from ptdp.optim.weights import load_optimizer_states
from ptdp.parallel.roles import role_of


class ShardedSets:
    """The master weights interface over one `ShardedMasterWeights` per reduce set."""

    masters_are_pieces = True
    flat_grads = None   # each set has its own buffers

    def __init__(self, params: list[nn.Parameter], precision: str, grid, bucket_mb: float):
        self.params = params
        order: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            order.setdefault(role_of(p).reduce_axes, []).append(i)
        self.indices = list(order.values())   # per set, its parameters' places in `params`
        self.sets = [ShardedMasterWeights([params[i] for i in members], precision,
                                          grid.group(*axes), grid.index(*axes),
                                          grid.size(*axes), bucket_mb)
                     for axes, members in order.items()]
        self.masters = [m for s in self.sets for m in s.masters]

    @property
    def shard_layout(self) -> list[ShardedMasterWeights]:
        """The sets, each reduce-scattering its own buckets over its group (ptdp/optim/grads.py)."""
        return self.sets

    def _in_order(self, per_set: list[list]) -> list:
        """Per-set lists (each in its set's parameter order) -> one list in `params` order."""
        out = [None] * len(self.params)
        for members, values in zip(self.indices, per_set):
            for i, value in zip(members, values):
                out[i] = value
        return out

    def _per_set(self, values: list) -> list[list]:
        return [[values[i] for i in members] for members in self.indices]

    # The iteration ------------------------------------------------------------------------
    def zero_grads(self) -> None:
        for s in self.sets:
            s.zero_grads()

    def grads_to_masters(self) -> None:
        """Nothing to do: each set's pieces hold views of its reduced shards."""

    def sync_shared_embeddings(self, group, size: int) -> None:
        for s in self.sets:
            s.sync_shared_embeddings(group, size)

    def masters_to_model(self) -> None:
        for s in self.sets:
            s.masters_to_model()

    # Whole tensors (collective over each set's group, set by set) --------------------------
    def master_param_indices(self) -> list[int]:
        return [members[i] for members, s in zip(self.indices, self.sets)
                for i in s.master_param_indices()]

    def full_grads(self) -> list[torch.Tensor]:
        return self._in_order([s.full_grads() for s in self.sets])

    def state_dict(self) -> list[torch.Tensor]:
        return self._in_order([s.state_dict() for s in self.sets])

    def load_state_dict(self, values: list[torch.Tensor]) -> None:
        for s, part in zip(self.sets, self._per_set(values)):
            s.load_state_dict(part)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> list[dict]:
        return self._in_order([s.optimizer_state_dict(optimizer) for s in self.sets])

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                  per_param: list[dict]) -> None:
        """Every set's pieces' moments, put into the optimizer at once (one load keeps the
        others' state: ptdp/optim/weights.py `load_optimizer_states`)."""
        by_piece = {}
        for s, part in zip(self.sets, self._per_set(per_param)):
            by_piece.update(s.states_by_piece(part))
        load_optimizer_states(optimizer, by_piece)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        masters = sum(s.master_shard.numel() * 4 for s in self.sets if s.half)
        return masters + optimizer_moment_bytes(optimizer)
