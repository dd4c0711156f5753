"""One batch of point-to-point sends and receives, posted together with
`dist.batch_isend_irecv` (NCCL rule 2 of DESIGN.md: a step's sends and receives go out as one
batch, in an order both peers derive from the same plan). The pipeline's exchanges
(ptdp/pipeline/p2p.py) and the context-parallel ring (ptdp/parallel/context.py) both post
through it."""

from __future__ import annotations

import torch
import torch.distributed as dist


class BatchedP2P:
    def __init__(self, group=None):
        self.group = group

    def post(self, ops: list[tuple[object, torch.Tensor, int]]) -> list:
        """`ops`: (transfer with a `.send` flag, tensor, peer's world rank), in plan order.
        Returns one waitable per op."""
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if t.send else dist.irecv, x, peer,
                                                   self.group) for t, x, peer in ops])
        if len(works) == len(ops):
            return works
        return [AllOf(works)] * len(ops)   # NCCL coalesces a batch into one work


class AllOf:
    """Waits for every work of a batch."""

    def __init__(self, works):
        self.works = works

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
