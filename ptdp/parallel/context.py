"""Context parallelism: the sequence itself split across the c ranks of a context group.

Load-balanced placement (Megatron-LM's): the sequence of s tokens is cut into 2c chunks of
L = s/(2c); context rank i holds chunks i and 2c-1-i, in that order, so under a causal mask
every rank has the same attention work (an early chunk sees few keys, its mirror many). Each
rank's micro-batch holds only its 2L tokens, labels and loss-mask entries
(ptdp/data/batching.py); positions follow the chunks (`ContextParallel.positions`: the learned
position table's rows and the rotary angles of the true positions).

Outside attention every token is independent, so the layers run unchanged on [2L, b, h].
Attention is a ring (ptdp/parallel/ring_attention.py): key/value blocks travel around the
context group and the partial outputs merge by their log-sum-exp.

The ring's exchanges are pure data too: at each step every rank posts one batch (one
`batch_isend_irecv` on the context group) with its sends to the next rank and its receives
from the previous one, ordered by message kind (K/V, then dK/dV) on both sides, so they hold
under NCCL's rules (no tags, in-order completion; tests/pipeline/nccl_rules.py). The
transport is replaceable, like the pipeline's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ptdp.parallel.batched_p2p import AllOf, BatchedP2P

# The ring's message kinds, in the order a batch lists them.
KV, GRAD_KV = 0, 1


@dataclass(frozen=True)
class RingMessage:
    kind: int      # KV (keys and values) or GRAD_KV (their gradients, going home)
    step: int      # the ring step that sends it
    src: int       # context rank of the sender
    dst: int       # context rank of the receiver

    def header(self) -> list[int]:
        """What an in-order test transport checks a payload against (kind, step, src, dst)."""
        return [self.kind, self.step, self.src, self.dst]


@dataclass(frozen=True)
class RingTransfer:
    send: bool
    message: RingMessage

    def __str__(self) -> str:
        m = self.message
        what = ("K/V", "dK/dV")[m.kind]
        return f"{'send' if self.send else 'recv'} {what} of step {m.step} {m.src}->{m.dst}"


def ring_exchange(step: int, rank: int, size: int, sends: dict[int, torch.Tensor]) -> list:
    """The transfers of ring step `step` on context rank `rank`: for each message kind in
    `sends` (in kind order), send to the next rank and receive the same kind from the previous
    one. Both neighbours derive the same list, so the per-peer order matches (NCCL rule 1)."""
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    out = []
    for kind in sorted(sends):
        out.append(RingTransfer(True, RingMessage(kind, step, rank, nxt)))
    for kind in sorted(sends):
        out.append(RingTransfer(False, RingMessage(kind, step, prev, rank)))
    return out


@dataclass
class ContextParallel:
    """The context group (the ring) and this rank's place in it."""

    group: object = None
    rank: int = 0
    size: int = 1
    ranks: list = field(default_factory=lambda: [0])   # world ranks, in context order
    transport: object = None                           # None: BatchedP2P(group)
    bytes_sent: int = 0                                # payload bytes this rank put on the ring

    @classmethod
    def from_grid(cls, grid) -> "ContextParallel":
        return cls(grid.group("context"), grid.cp_rank, grid.c, grid.ranks("context"))

    def chunks(self) -> tuple[int, int]:
        """The two chunks (of 2c) this rank holds, in its local order."""
        return chunk_ids(self.rank, self.size)

    def positions(self, local_length: int, device=None) -> torch.Tensor:
        """Global positions [local_length] of this rank's tokens."""
        return local_positions(local_length, self.rank, self.size, device)

    def exchange(self, step: int, sends: dict[int, torch.Tensor],
                 receives: dict[int, torch.Tensor]) -> AllOf:
        """Post ring step `step`: send each tensor of `sends` (by kind) to the next rank and
        receive the same kinds from the previous one into `receives`. Wait on the result."""
        if self.transport is None:
            self.transport = BatchedP2P(self.group)
        transfers = ring_exchange(step, self.rank, self.size, sends)
        ops = [(t, (sends if t.send else receives)[t.message.kind],
                self.ranks[t.message.dst if t.send else t.message.src]) for t in transfers]
        self.bytes_sent += sum(x.numel() * x.element_size() for t, x, _ in ops if t.send)
        return AllOf(self.transport.post(ops))


def chunk_ids(rank: int, size: int) -> tuple[int, int]:
    return rank, 2 * size - 1 - rank


def local_positions(local_length: int, rank: int, size: int, device=None) -> torch.Tensor:
    """[local_length] positions in the whole sequence of context rank `rank`'s tokens."""
    half = local_length // 2
    first, second = chunk_ids(rank, size)
    return torch.cat([torch.arange(first * half, (first + 1) * half, device=device),
                      torch.arange(second * half, (second + 1) * half, device=device)])


def context_shard(x: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s two chunks of `x` along `dim` (the full sequence), concatenated."""
    if size == 1:
        return x
    assert x.shape[dim] % (2 * size) == 0, f"sequence {x.shape[dim]} does not cut into {2 * size}"
    parts = x.chunk(2 * size, dim=dim)
    first, second = chunk_ids(rank, size)
    return torch.cat([parts[first], parts[second]], dim=dim)


def context_unshard(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The inverse of `context_shard`: every rank's local tensor (in context order) -> the full
    sequence along `dim`."""
    size = len(parts)
    pieces = [None] * (2 * size)
    for rank, local in enumerate(parts):
        first, second = chunk_ids(rank, size)
        pieces[first], pieces[second] = local.chunk(2, dim=dim)
    return torch.cat(pieces, dim=dim)
