"""Expert parallelism: the expert group, and the all-to-all that moves tokens to their experts.

With e expert ranks (ptdp/parallel/grid.py: an expert group is e ranks of one stage with other
data or context coordinates and the same tensor coordinate) each rank holds E/e consecutive
experts: rank r experts [r E/e, (r+1) E/e). A rank sends each (token, choice) row to the rank
holding its expert and gets the rows other ranks send to its experts; after the experts ran,
the rows go back the same way. Both are `dist.all_to_all_single` with uneven splits (gloo and
NCCL): the row counts are exchanged first (`exchange_counts`, an even all-to-all of E counts),
then the rows (`all_to_all`, an autograd Function whose backward is the reverse all-to-all).
Every expert rank issues the same all-to-alls in the same order: all of them run the same
layer of the same micro-batch at the same step of the same schedule, forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ExpertParallel:
    """The expert group and this rank's place in it (size 1: every rank holds every expert)."""

    group: object = None
    rank: int = 0
    size: int = 1

    @classmethod
    def from_grid(cls, grid) -> "ExpertParallel":
        if getattr(grid, "e", 1) == 1:
            return cls()
        return cls(grid.group("expert"), grid.index("expert"), grid.size("expert"))

    def held(self, num_experts: int) -> range:
        """The global indices of the experts this rank holds."""
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


def exchange_counts(counts: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """counts [E] (rows this rank sends to each expert) -> [e, E/e]: the rows each rank of the
    group sends to each of this rank's experts."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=ep.group)
    return received.view(ep.size, -1)


class _AllToAll(torch.autograd.Function):
    """Rows [sum(send), ...] -> [sum(receive), ...]: send[r] rows to rank r, receive[r] from it.
    Backward: the gradients go back the same way reversed."""

    @staticmethod
    def forward(ctx, rows, ep: ExpertParallel, send: list[int], receive: list[int]):
        ctx.ep, ctx.send, ctx.receive = ep, send, receive
        return _exchange(rows, ep, send, receive)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.ep, ctx.receive, ctx.send), None, None, None


def _exchange(rows: torch.Tensor, ep: ExpertParallel, send: list[int],
              receive: list[int]) -> torch.Tensor:
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=receive,
                           input_split_sizes=send, group=ep.group)
    return out


def all_to_all(rows: torch.Tensor, ep: ExpertParallel, send: list[int],
               receive: list[int]) -> torch.Tensor:
    return _AllToAll.apply(rows, ep, send, receive)


def by_local_expert(received: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """The rows an all-to-all delivered, source rank by source rank and within each by local
    expert (`received[r][j]` rows from rank r for local expert j), reordered by local expert
    (within each, by source rank): (that permutation, rows per local expert). A loop over
    ranks and experts, never over tokens."""
    starts, offset = [], 0
    for row in received:
        starts.append([])
        for count in row:
            starts[-1].append(offset)
            offset += count
    pieces = [torch.arange(starts[r][j], starts[r][j] + received[r][j])
              for j in range(len(received[0])) for r in range(len(received))]
    order = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    return order, [sum(row[j] for row in received) for j in range(len(received[0]))]
