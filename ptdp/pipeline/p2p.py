"""Point-to-point exchange of activations and gradients between pipeline stages.

The executor hands over one *exchange* at a time (``ptdp.pipeline.comm_plan``): the sends and
receives a rank posts together between two compute actions (one message per boundary tensor:
a boundary that carries several tensors sends each as its own message, shapes from the plan). They go out as one
``batch_isend_irecv`` on the pipeline group, in the plan's order and without tags: messages
match by order alone, as NCCL requires, so the same code path is correct on NCCL and gloo.
Nothing waits for a send until the end of the iteration; a receive is waited for only when
its tensor is needed (on NCCL that makes the compute stream wait, not the host).

Scatter/gather (dissertation ch. 4): with t > 1 the tensor ranks of a stage hold
identical boundary tensors, so each sends only its 1/t slice to its peer in the next stage
(in a cluster: one slice per InfiniBand card) and the receiving tensor group all-gathers the
slices (over NVLink). Bytes crossing the boundary per rank drop from bsh to bsh/t.

The transport (how a batch is posted) is replaceable: tests put one in that imposes NCCL's
in-order completion on gloo (``tests/pipeline/nccl_rules.py``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from ptdp.parallel.batched_p2p import BatchedP2P
from ptdp.parallel.mappings import all_gather_single
from ptdp.pipeline.comm_plan import Message, Transfer


class BatchedTransport(BatchedP2P):
    """Posts a batch of sends and receives with ``dist.batch_isend_irecv`` on ``group``.

    ``receive_lookahead``: on gloo, whose operations complete in any order, receives of that
    many later exchanges are posted early (see the executor); NCCL gets the plan exactly.
    """

    def __init__(self, group=None):
        super().__init__(group)
        gloo = dist.get_backend(group) == "gloo" if dist.is_initialized() else False
        self.receive_lookahead = LOOKAHEAD if gloo else 0


LOOKAHEAD = 2


class P2P:
    """One rank's pipeline exchange; counts the payload bytes it puts on stage boundaries.

    ``pipeline_ranks[i]`` is the world rank of pipeline rank ``i`` in this rank's pipeline.
    """

    def __init__(self, pipeline_ranks: list[int], *, group=None, tensor_group=None,
                 tp_rank: int = 0, tp_size: int = 1, scatter_gather: bool = False,
                 transport=None):
        self.pipeline_ranks = pipeline_ranks
        self.tensor_group, self.tp_rank, self.tp_size = tensor_group, tp_rank, tp_size
        self.scatter_gather = scatter_gather and tp_size > 1
        self.transport = transport or BatchedTransport(group)
        self.pending_sends: list = []
        self.previous_sends: list = []   # a no-flush run's sends of its previous iteration
        self.bytes_sent = 0          # payload bytes this rank put on stage boundaries
        self.messages_sent = 0

    @property
    def receive_lookahead(self) -> int:
        return getattr(self.transport, "receive_lookahead", 0)

    def wire_shape(self, shape: tuple) -> tuple:
        """The shape a boundary tensor of ``shape`` has on the wire (1/t of it, flat, with s/g)."""
        if not self.scatter_gather:
            return tuple(shape)
        numel = math.prod(shape)
        if numel % self.tp_size:
            raise ValueError(f"scatter/gather needs the boundary tensor's {numel} elements "
                             f"to divide by parallel.tensor={self.tp_size}")
        return (numel // self.tp_size,)

    def exchange(self, transfers: tuple[Transfer, ...], outbox: dict,
                 full_shape: Callable[[Message], tuple], dtype: torch.dtype,
                 device: torch.device) -> dict[Message, "PendingRecv"]:
        """Post ``transfers`` as one batch. Sends take their tensor from ``outbox`` (removed);
        returns {message: PendingRecv} for the receives, each assembled to
        ``full_shape(message)`` (the wire may carry a slice, see ``wire_shape``)."""
        if not transfers:
            return {}
        ops, received = [], {}
        # Receives first: on gloo a receive posted while a send to the same peer is being
        # written waits for it. (Only the order among sends, and among receives, matters.)
        for t in sorted(transfers, key=lambda t: t.send):
            if t.send:
                tensor = self._payload(outbox.pop(t.message), t)
                self.bytes_sent += tensor.numel() * tensor.element_size()
                self.messages_sent += 1
            else:
                tensor = torch.empty(t.shape, dtype=dtype, device=device)
            ops.append((t, tensor, self.pipeline_ranks[t.peer]))
        works = self.transport.post(ops)
        for (t, tensor, _), work in zip(ops, works):
            if t.send:
                self.pending_sends.append((work, tensor))  # keep the buffer alive until sent
            else:
                received[t.message] = PendingRecv(self, work, tensor, full_shape(t.message))
        # Sends the transport reports complete release their buffers (the pipeline outputs
        # the executor frees); gloo reports a send complete only once waited for, so with
        # gloo's batches they wait for the end of the iteration.
        self.pending_sends = [(work, tensor) for work, tensor in self.pending_sends
                              if not work.is_completed()]
        return received

    def _payload(self, tensor: torch.Tensor, transfer: Transfer) -> torch.Tensor:
        flat = tensor.detach().reshape(-1)
        if self.scatter_gather:
            flat = flat.chunk(self.tp_size)[self.tp_rank]
        payload = flat.contiguous().view(transfer.shape)  # gloo refuses non-contiguous sends
        return payload

    def _assemble(self, buffer: torch.Tensor, shape) -> torch.Tensor:
        if not self.scatter_gather:
            return buffer.view(shape)
        whole = buffer.new_empty(buffer.numel() * self.tp_size)
        all_gather_single(whole, buffer, group=self.tensor_group)   # slices land in place
        return whole.view(shape)

    def release_completed_sends(self) -> None:
        """End of a no-flush iteration: retire the previous iteration's sends.

        A no-flush run never waits for this iteration's sends (the next iteration's compute
        overlaps them). It cannot simply drop completed ones either: gloo reports a send as
        completed only once it was waited for, so the list (and the activations it keeps
        alive) would grow every iteration. The previous iteration's sends are waited instead:
        their receives belong to that iteration (comm_plan keeps every exchange inside its
        iteration), which every rank can finish without us, so this wait never blocks on
        progress, only on a transfer already under way.
        """
        for work, _ in self.previous_sends:
            work.wait()
        self.previous_sends = [(work, tensor) for work, tensor in self.pending_sends
                               if not work.is_completed()]
        self.pending_sends = []

    def wait_sends(self) -> None:
        """Complete every outstanding send (end of iteration), so buffers can be reused."""
        for work, _ in self.previous_sends + self.pending_sends:
            work.wait()
        self.previous_sends, self.pending_sends = [], []


class PendingRecv:
    def __init__(self, p2p: P2P, work, buffer: torch.Tensor, shape):
        self.p2p, self.work, self.buffer, self.shape = p2p, work, buffer, shape

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.p2p._assemble(self.buffer, self.shape)
