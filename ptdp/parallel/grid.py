"""The (p, t, d) rank grid and its process groups.

Ranks are laid out with t varying fastest, then d, then p:

    rank = p_idx * (d * t) + d_idx * t + t_idx

so the t ranks of a tensor group are adjacent (on a cluster they share a node and NVLink),
and a pipeline stage's d*t ranks are contiguous. Groups are derived from one rank array
reshaped to (p, d, t), never from module globals: a `RankGrid` object is passed to whatever
needs to communicate.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Coordinates:
    pipeline: int
    data: int
    tensor: int

    def __str__(self) -> str:
        return f"(p={self.pipeline}, d={self.data}, t={self.tensor})"


def rank_layout(p: int, d: int, t: int) -> torch.Tensor:
    """World ranks arranged as a [p, d, t] array."""
    return torch.arange(p * d * t).reshape(p, d, t)


def group_rows(p: int, d: int, t: int) -> dict[str, list[list[int]]]:
    """Every tensor, data and pipeline group as a list of world ranks, in creation order."""
    layout = rank_layout(p, d, t)
    return {"tensor": layout.reshape(-1, t).tolist(),
            "data": layout.permute(0, 2, 1).reshape(-1, d).tolist(),
            "pipeline": layout.permute(1, 2, 0).reshape(-1, p).tolist()}


def coordinates_of(rank: int, p: int, d: int, t: int) -> Coordinates:
    pi, rest = divmod(rank, d * t)
    di, ti = divmod(rest, t)
    return Coordinates(pi, di, ti)


class RankGrid:
    """Process groups for one rank of a (p, t, d) job.

    Every rank creates every group in the same order (a torch.distributed requirement) and
    keeps the ones it belongs to. Groups of size 1 are kept too; callers skip communication
    on them via `size()`.
    """

    def __init__(self, pipeline: int, tensor: int, data: int, timeout_s: float = 600.0):
        if not dist.is_initialized():
            raise RuntimeError("RankGrid needs torch.distributed to be initialised first")
        world = dist.get_world_size()
        if pipeline * tensor * data != world:
            raise ValueError(f"p*t*d = {pipeline}*{tensor}*{data} != world size {world}")
        self.p, self.t, self.d = pipeline, tensor, data
        self.rank = dist.get_rank()
        self.coords = coordinates_of(self.rank, pipeline, data, tensor)
        timeout = timedelta(seconds=timeout_s)
        layout = rank_layout(pipeline, data, tensor)
        rows = group_rows(pipeline, data, tensor)
        self.tensor_group, self.tensor_ranks = self._build(rows["tensor"], timeout)
        self.data_group, self.data_ranks = self._build(rows["data"], timeout)
        self.pipeline_group, self.pipeline_ranks = self._build(rows["pipeline"], timeout)
        self.model_group, self.model_ranks = self._build(
            layout.permute(1, 0, 2).reshape(data, -1).tolist(), timeout)
        first_last = layout[[0, -1]] if pipeline > 1 else layout[[0]]
        self.embedding_group, self.embedding_ranks = self._build(
            first_last.permute(1, 2, 0).reshape(-1, first_last.shape[0]).tolist(), timeout)

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

    def describe(self) -> str:
        return (f"rank {self.rank} {self.coords}: tensor group {self.tensor_ranks}, "
                f"data group {self.data_ranks}, pipeline group {self.pipeline_ranks}")

