"""The (p, t, c, d) rank grid and its process groups.

Ranks are laid out with t varying fastest, then c (context), then d, then p (Megatron's order:
tensor, context, data, pipeline):

    rank = ((p_idx * d + d_idx) * c + c_idx) * t + t_idx

so the t ranks of a tensor group are adjacent (on a cluster they share a node and NVLink), the
c ranks of a context ring come next (their ring traffic is per layer, so they too should share
a node where possible), and a pipeline stage's d*c*t ranks are contiguous. Groups are derived
from one rank array reshaped to (p, d, c, t), never from module globals: a `RankGrid` object
is passed to whatever needs to communicate. With c = 1 (the default) the layout and the groups
are exactly those of the (p, d, t) grid.

Groups: tensor (same p, d, c), context (same p, d, t: the ring of context parallelism), data
(same p, c, t), pipeline (same d, c, t), model (same d, c: one whole model), embedding (first
and last stage, same d, c, t), and the replica group (same p, t: every rank that holds the same
weights, data x context). Gradients are summed over the replica group: each context rank saw
different tokens of the same sequences, each data rank different sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Coordinates:
    pipeline: int
    data: int
    tensor: int
    context: int = 0
    context_size: int = field(default=1, compare=False, repr=False)

    def __str__(self) -> str:
        c = f", c={self.context}" if self.context_size > 1 else ""
        return f"(p={self.pipeline}, d={self.data}{c}, t={self.tensor})"


def rank_layout(p: int, d: int, t: int, c: int = 1) -> torch.Tensor:
    """World ranks arranged as a [p, d, c, t] array (c = 1: effectively [p, d, t])."""
    layout = torch.arange(p * d * c * t).reshape(p, d, c, t)
    return layout if c > 1 else layout.reshape(p, d, t)


def group_rows(p: int, d: int, t: int, c: int = 1) -> dict[str, list[list[int]]]:
    """Every tensor, data and pipeline group (and context and replica group when c > 1) as a
    list of world ranks, in creation order."""
    grid = torch.arange(p * d * c * t).reshape(p, d, c, t)
    rows = {"tensor": grid.reshape(-1, t).tolist(),
            "data": grid.permute(0, 2, 3, 1).reshape(-1, d).tolist(),
            "pipeline": grid.permute(1, 2, 3, 0).reshape(-1, p).tolist()}
    if c > 1:
        rows["context"] = grid.permute(0, 1, 3, 2).reshape(-1, c).tolist()
        rows["replica"] = grid.permute(0, 3, 1, 2).reshape(-1, d * c).tolist()
    return rows


def coordinates_of(rank: int, p: int, d: int, t: int, c: int = 1) -> Coordinates:
    pi, rest = divmod(rank, d * c * t)
    di, rest = divmod(rest, c * t)
    ci, ti = divmod(rest, t)
    return Coordinates(pi, di, ti, ci, c)


class RankGrid:
    """Process groups for one rank of a (p, t, c, d) job.

    Every rank creates every group in the same order (a torch.distributed requirement) and
    keeps the ones it belongs to. Groups of size 1 are kept too; callers skip communication
    on them via `size()`.
    """

    def __init__(self, pipeline: int, tensor: int, data: int, timeout_s: float = 600.0,
                 context: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("RankGrid needs torch.distributed to be initialised first")
        world = dist.get_world_size()
        if pipeline * tensor * context * data != world:
            raise ValueError(f"p*t*c*d = {pipeline}*{tensor}*{context}*{data} != world size "
                             f"{world}")
        self.p, self.t, self.d, self.c = pipeline, tensor, data, context
        self.rank = dist.get_rank()
        self.coords = coordinates_of(self.rank, pipeline, data, tensor, context)
        timeout = timedelta(seconds=timeout_s)
        grid = torch.arange(world).reshape(pipeline, data, context, tensor)
        rows = group_rows(pipeline, data, tensor, context)
        self.tensor_group, self.tensor_ranks = self._build(rows["tensor"], timeout)
        self.data_group, self.data_ranks = self._build(rows["data"], timeout)
        self.pipeline_group, self.pipeline_ranks = self._build(rows["pipeline"], timeout)
        self.model_group, self.model_ranks = self._build(
            grid.permute(1, 2, 0, 3).reshape(data * context, -1).tolist(), timeout)
        first_last = grid[[0, -1]] if pipeline > 1 else grid[[0]]
        self.embedding_group, self.embedding_ranks = self._build(
            first_last.permute(1, 2, 3, 0).reshape(-1, first_last.shape[0]).tolist(), timeout)
        if context > 1:
            self.context_group, self.context_ranks = self._build(rows["context"], timeout)
            self.replica_group, self.replica_ranks = self._build(rows["replica"], timeout)
        else:   # no new groups: the ring is this rank alone, the replicas are the data group
            self.context_group, self.context_ranks = None, [self.rank]
            self.replica_group, self.replica_ranks = self.data_group, self.data_ranks

    def _build(self, rows: list[list[int]], timeout: timedelta):
        """Create one group per row; return (group, ranks) of mine, (None, []) if none is.

        Only the embedding groups leave ranks out (middle pipeline stages)."""
        mine = (None, [])
        for row in rows:
            group = dist.new_group(row, timeout=timeout)
            if self.rank in row:
                mine = (group, row)
        return mine

    # Coordinates --------------------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        return self.coords.tensor

    @property
    def dp_rank(self) -> int:
        return self.coords.data

    @property
    def pp_rank(self) -> int:
        return self.coords.pipeline

    @property
    def cp_rank(self) -> int:
        return self.coords.context

    @property
    def replica_rank(self) -> int:
        """This rank's place among the ranks holding the same weights (data-major)."""
        return self.coords.data * self.c + self.coords.context

    @property
    def replicas(self) -> int:
        """How many ranks hold the same weights: d * c (the gradient reduction's size)."""
        return self.d * self.c

    def describe(self) -> str:
        ring = f", context group {self.context_ranks}" if self.c > 1 else ""
        return (f"rank {self.rank} {self.coords}: tensor group {self.tensor_ranks}{ring}, "
                f"data group {self.data_ranks}, pipeline group {self.pipeline_ranks}")

