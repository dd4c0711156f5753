"""Gradient communication after backward: data-parallel reduction, tied embeddings, clipping.

Each parameter's gradient is summed over its own reduce group, the grid axes its role names
(ptdp/parallel/roles.py; data x context for every dense parameter): one set of buckets per
distinct group.

Data-parallel reduction is bucketed and overlapped with the backward pass: each parameter
counts its gradient accumulations; when it has received all `m` of the iteration, its bucket
is one step closer to ready, and a ready bucket's all-reduce is launched at once (async)
while backward continues on earlier layers. `finish()` waits for the last buckets.

The executor already scales each micro-batch loss by 1/(m*d), so a SUM all-reduce yields the
gradient of the mean loss over the whole global batch, as a single process computes it.

When the gradients live in one flat buffer (`FlatGrads`, ptdp/optim/buffers.py), a
bucket is a contiguous slice of it, all-reduced in place: no concatenation, no copy back.
With the distributed optimizer (ptdp/optim/distributed.py) a bucket is reduce-scattered
instead: each data rank receives the sum of its own shard of the bucket, the only part its
optimizer updates. Buckets that must end up whole on every rank (the tied word embedding,
summed again between the first and last stage afterwards) are still all-reduced.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ptdp.optim.buffers import FlatGrads, bucket_indices
from ptdp.optim.mixed_precision import grad_of, set_grad
from ptdp.parallel.mappings import reduce_scatter_single
from ptdp.parallel.roles import reduce_sets, role_of, writes


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _Bucket:
    def __init__(self, params: list[nn.Parameter], group, in_place: torch.Tensor | None = None,
                 shard: torch.Tensor | None = None, copy_back: bool = False,
                 wire_dtype: torch.dtype = torch.float32):
        self.params, self.group = params, group   # group: the params' reduce group
        self.in_place = in_place     # the bucket's slice of the flat gradient buffer, if any
        self.shard = shard           # this rank's part of in_place, when reduce-scattered
        self.copy_back = copy_back   # the sums go back into the gradients (flat buffer views)
        self.wire_dtype = wire_dtype  # reduce in this dtype (train.grad_reduce_dtype)
        self.ready = 0
        self.work = None
        self.flat = None
        self.wire = None             # (sent, received, into) while a collective is in flight

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` in the wire dtype (itself when that is its own)."""
        return tensor if tensor.dtype == self.wire_dtype else tensor.to(self.wire_dtype)

    def launch(self, group) -> None:
        if self.in_place is not None:   # the flat buffer's slice (and this rank's shard of it)
            into = self.shard if self.shard is not None else self.in_place
            sent = self._cast(self.in_place)
            if self.shard is not None:
                received = into if sent is self.in_place else sent.new_empty(into.shape)
                self.work = reduce_scatter_single(received, sent, group=group, async_op=True)
            else:   # summed in place on the wire tensor
                received = sent
                self.work = dist.all_reduce(sent, group=group, async_op=True)
            self.wire = (sent, received, into)   # alive until the collective is done
            return
        grads = [grad_of(p) for p in self.params]
        grads = [g if g is not None else torch.zeros_like(p, dtype=torch.float32)
                 for g, p in zip(grads, self.params)]
        self.flat = self._cast(torch.cat([g.reshape(-1) for g in grads]))
        self.work = dist.all_reduce(self.flat, group=group, async_op=True)

    def finish(self) -> None:
        self.work.wait()
        if self.in_place is not None:
            _, received, into = self.wire
            if received is not into:
                into.copy_(received)   # the sums, back from the wire dtype
            self.work = self.wire = None
            self.ready = 0
            return
        offset = 0
        for p in self.params:
            n = p.numel()
            summed = self.flat[offset: offset + n].view(p.shape).float()
            if self.copy_back:
                grad_of(p).copy_(summed)
            else:
                set_grad(p, summed)   # views keep flat alive
            offset += n
        self.work = self.flat = None
        self.ready = 0


class DataParallelGradients:
    """Sums each parameter's gradient over its reduce group (its role's `reduce_axes`,
    ptdp/parallel/roles.py), in buckets launched during the last backward: one set of buckets
    per distinct group.

    `accumulations` is how many backward passes each parameter sees per iteration (m).
    `flat`: the gradient buffer the parameters' gradients are views of, if there is one.
    `sharded`: the distributed optimizer's sharded sets (ptdp/optim/distributed.py, one per
    reduce group), whose layouts fix the buckets and which part of each this rank receives.
    `reduce_dtype` (train.grad_reduce_dtype): "bf16" sends each bucket as a bf16 copy and
    casts the sums back into the fp32 gradients (half the bytes; Megatron's
    --grad-reduce-in-bf16, which also accumulates in bf16); "fp32" sums them as they are
    (the gradients to reduce are fp32 always: ptdp/optim/mixed_precision.py), and None, the
    older configs' spelling of the default, is "fp32".
    """

    def __init__(self, params: list[nn.Parameter], grid, accumulations: int,
                 bucket_mb: float = 25.0, flat: FlatGrads | None = None, sharded=None,
                 reduce_dtype: str | None = None):
        self.accumulations = accumulations
        wire = REDUCE_DTYPES[reduce_dtype or "fp32"]
        self.params = [p for p in params if p.requires_grad]
        self.flat = flat
        self.buckets: list[_Bucket] = []
        if sharded is not None:   # each set over the reduce group it is sharded over
            self.buckets = [_Bucket(b.params, part.group, b.grads,
                                    None if b.all_reduce else b.own_grads, wire_dtype=wire)
                            for part in sharded if part.size > 1 for b in part.buckets]
        else:
            for axes, members in reduce_sets(self.params).items():
                if grid.size(*axes) > 1:
                    self.buckets += self._make_buckets(members, grid.group(*axes),
                                                       bucket_mb * 2**20)
            for bucket in self.buckets:
                bucket.wire_dtype = wire
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.counts: dict[int, int] = {}
        self.launched_during_backward = 0   # buckets whose all-reduce overlapped backward
        for p in self.params:
            if id(p) in self.bucket_of:
                p.register_post_accumulate_grad_hook(self._on_accumulated)

    def _make_buckets(self, params: list[nn.Parameter], group,
                      limit_bytes: float) -> list[_Bucket]:
        # Reverse registration order approximates the order gradients become ready.
        indices = bucket_indices([p.numel() * p.element_size() for p in params], limit_bytes)
        return [self._bucket([params[i] for i in bucket], group) for bucket in indices]

    def _bucket(self, params: list[nn.Parameter], group) -> _Bucket:
        # The flat buffer is laid out in the same reversed order, so the slice holds exactly
        # these parameters' gradients (and alignment padding, which stays zero) unless
        # parameters of another reduce group sit between them: those buckets are copied.
        if self.flat is None:
            return _Bucket(params, group)
        alone = self._slice_of_only(params)
        return _Bucket(params, group, alone, copy_back=alone is None)

    def _slice_of_only(self, params: list[nn.Parameter]) -> torch.Tensor | None:
        """The flat buffer's slice spanning `params`, None if it spans other tensors too."""
        mine = {self.flat.index_of[id(p)] for p in params}
        start, end = self.flat.layout.span(list(mine))
        others = (offset for i, offset in enumerate(self.flat.layout.offsets) if i not in mine)
        if any(start <= offset < end for offset in others):
            return None
        return self.flat.buffer[start:end]

    def start_iteration(self, accumulations: int | None = None) -> None:
        """A new iteration; `accumulations`: its backward passes per parameter when they
        change between iterations (a batch ramp-up)."""
        if accumulations is not None:
            self.accumulations = accumulations
        self.counts.clear()
        self.launched_during_backward = 0

    def _on_accumulated(self, param: nn.Parameter) -> None:
        count = self.counts.get(id(param), 0) + 1
        self.counts[id(param)] = count
        if count == self.accumulations:
            bucket = self.bucket_of[id(param)]
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                bucket.launch(bucket.group)
                self.launched_during_backward += 1

    def finish(self) -> None:
        """Launch buckets whose parameters got no gradient, then wait for all of them."""
        for bucket in self.buckets:
            if bucket.work is None:
                bucket.launch(bucket.group)
        for bucket in self.buckets:
            bucket.finish()


def reduce_sequence_parallel_grads(params: list[nn.Parameter], group, size: int) -> None:
    """Sum, over the tensor group, the gradients of replicated weights that sequence
    parallelism applies to 1/t of the tokens on each rank (LayerNorms, the row-parallel
    biases, position and token-type embeddings), and the QK-norm gains each tensor rank applies
    to its own heads (models/norms.py): one all-reduce of their concatenation."""
    grads = [p.grad for p in params if role_of(p).sequence_parallel and p.grad is not None]
    if size <= 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    torch._foreach_copy_(grads, [part.view_as(g) for part, g in
                                 zip(flat.split([g.numel() for g in grads]), grads)])


def counts_in_norm(param: nn.Parameter, tp_rank: int) -> bool:
    """Count every weight exactly once in the global norm.

    Split weights contribute their shard on every tensor rank; replicated weights only on
    tensor rank 0; the last stage's copy of the tied embedding not at all.
    """
    role = role_of(param)
    if role.duplicate:
        return False
    return role.tp_split_dim is not None or tp_rank == 0


def global_grad_norm(params: list[nn.Parameter], grid, *, sharded: bool = False,
                     device: torch.device) -> torch.Tensor:
    """The gradient norm of the whole model, as a float64 tensor on `device` (no host sync).

    Each parameter counts once: on the first rank of its reduce group (`writes`), or with the
    distributed optimizer (`sharded`) on every rank for its own pieces. The squares are summed
    over data x context, inside which every reduce group lies, then over the model's pipeline
    and tensor ranks. (A dense model sums zeros from all but one replica, the same bits.)
    `device` is the rank's own, given rather than read from `params`: with the distributed
    optimizer a rank may hold no piece at all, and its (zero) share must still reach the
    collectives on the device (NCCL takes no CPU tensor). A non-finite element on any rank
    makes the norm non-finite on every rank: fp16's overflow check and skip are then common to
    all shards.
    """
    grads = [p.grad.detach() for p in params if p.grad is not None
             and counts_in_norm(p, grid.tp_rank) and (sharded or writes(p, grid))]
    total = torch.zeros((), dtype=torch.float64, device=device)  # NCCL needs device tensors
    if grads:
        total += torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
    for axes in (("data", "context"), ("pipeline", "tensor")):
        if grid.size(*axes) > 1:
            dist.all_reduce(total, group=grid.group(*axes))
    return total.sqrt()


def clip_gradients(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients so the global norm is at most `max_norm` (0 disables), on the device.

    A non-finite norm leaves the gradients as they are, so the divergence check can still
    name the first parameter whose gradient is not finite.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if max_norm <= 0 or not grads:
        return
    coef = (max_norm / (torch.as_tensor(norm, dtype=torch.float64) + 1e-6)).clamp(max=1.0)
    coef = torch.where(torch.isfinite(coef), coef, torch.ones_like(coef))
    torch._foreach_mul_(grads, coef.to(device=grads[0].device, dtype=grads[0].dtype))
