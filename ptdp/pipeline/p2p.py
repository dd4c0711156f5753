"""Point-to-point exchange of activations and gradients between pipeline stages.

Sends are asynchronous (`isend`); a receive is posted when the executor reaches the matching
action and waited for only when the data is needed. Messages carry a tag unique within an
iteration, so they match regardless of the order two ranks issue them in.

Scatter/gather (SPEC item 26, source L3988–4036): with t > 1 the tensor ranks of a stage hold
identical boundary tensors, so each sends only its 1/t slice to its peer in the next stage
(in a cluster: one slice per InfiniBand card) and the receiving tensor group all-gathers the
slices (over NVLink). Bytes crossing the boundary per rank drop from bsh to bsh/t.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ACTIVATION, GRADIENT = 0, 1


class P2P:
    def __init__(self, *, tensor_group=None, tp_rank: int = 0, tp_size: int = 1,
                 scatter_gather: bool = False):
        self.tensor_group, self.tp_rank, self.tp_size = tensor_group, tp_rank, tp_size
        self.scatter_gather = scatter_gather and tp_size > 1
        self.pending_sends: list = []
        self.bytes_sent = 0          # payload bytes this rank put on stage boundaries
        self.messages_sent = 0

    def _slice(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.numel() % self.tp_size:
            raise ValueError(f"scatter/gather needs the boundary tensor's {flat.numel()} elements "
                             f"to divide by parallel.tensor={self.tp_size}")
        return flat.chunk(self.tp_size)[self.tp_rank]

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        payload = tensor.detach().reshape(-1)
        if self.scatter_gather:
            payload = self._slice(payload)
        payload = payload.contiguous()  # gloo refuses non-contiguous sends (peer would hang)
        self.pending_sends.append(dist.isend(payload, dst, tag=tag))
        self.bytes_sent += payload.numel() * payload.element_size()
        self.messages_sent += 1

    def post_recv(self, shape, dtype, device, src: int, tag: int) -> "PendingRecv":
        numel = int(torch.Size(shape).numel())
        count = numel // self.tp_size if self.scatter_gather else numel
        buffer = torch.empty(count, dtype=dtype, device=device)
        return PendingRecv(self, dist.irecv(buffer, src, tag=tag), buffer, shape)

    def _assemble(self, buffer: torch.Tensor, shape) -> torch.Tensor:
        if not self.scatter_gather:
            return buffer.view(shape)
        parts = [torch.empty_like(buffer) for _ in range(self.tp_size)]
        dist.all_gather(parts, buffer, group=self.tensor_group)
        return torch.cat(parts).view(shape)

    def wait_sends(self) -> None:
        """Complete every outstanding send (end of iteration), so buffers can be reused."""
        for work in self.pending_sends:
            work.wait()
        self.pending_sends.clear()


class PendingRecv:
    def __init__(self, p2p: P2P, work, buffer: torch.Tensor, shape):
        self.p2p, self.work, self.buffer, self.shape = p2p, work, buffer, shape

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.p2p._assemble(self.buffer, self.shape)


def message_tag(kind: int, mb: int, stage: int, num_stages: int) -> int:
    """Unique per (activation|gradient, micro-batch, receiving stage) within an iteration."""
    return (mb * num_stages + stage) * 2 + kind
