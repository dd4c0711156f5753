"""Gradient communication after backward: data-parallel reduction, tied embeddings, clipping.

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
from ptdp.parallel.roles import role_of


class _Bucket:
    def __init__(self, params: list[nn.Parameter], in_place: torch.Tensor | None = None,
                 shard: torch.Tensor | None = None):
        self.params = params
        self.in_place = in_place     # the bucket's slice of the flat gradient buffer, if any
        self.shard = shard           # this rank's part of in_place, when reduce-scattered
        self.ready = 0
        self.work = None
        self.flat = None

    def launch(self, group) -> None:
        if self.shard is not None:   # in place: the shard is a view of its bucket
            self.work = dist.reduce_scatter_single(self.shard, self.in_place, group=group,
                                                   async_op=True)
            return
        if self.in_place is not None:
            self.work = dist.all_reduce(self.in_place, group=group, async_op=True)
            return
        grads = [grad_of(p) for p in self.params]
        grads = [g if g is not None else torch.zeros_like(p, dtype=torch.float32)
                 for g, p in zip(grads, self.params)]
        self.flat = torch.cat([g.reshape(-1) for g in grads])
        self.work = dist.all_reduce(self.flat, group=group, async_op=True)

    def finish(self) -> None:
        self.work.wait()
        if self.in_place is not None:
            self.work, self.ready = None, 0
            return
        offset = 0
        for p in self.params:
            n = p.numel()
            set_grad(p, self.flat[offset: offset + n].view(p.shape))  # views keep flat alive
            offset += n
        self.work = self.flat = None
        self.ready = 0


class DataParallelGradients:
    """Sums gradients over the data group in buckets launched during the last backward.

    `accumulations` is how many backward passes each parameter sees per iteration (m).
    `flat`: the gradient buffer the parameters' gradients are views of, if there is one.
    `sharded`: the distributed optimizer's weights (ptdp/optim/distributed.py), whose layout
    fixes the buckets and which part of each this rank receives.
    """

    def __init__(self, params: list[nn.Parameter], group, size: int, accumulations: int,
                 bucket_mb: float = 25.0, flat: FlatGrads | None = None, sharded=None):
        self.group, self.size, self.accumulations = group, size, accumulations
        self.params = [p for p in params if p.requires_grad]
        self.flat = flat
        if size <= 1:
            self.buckets = []
        elif sharded is not None:
            self.buckets = [_Bucket(b.params, b.grads, None if b.all_reduce else b.own_grads)
                            for b in sharded.buckets]
        else:
            self.buckets = self._make_buckets(bucket_mb * 2**20)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.counts: dict[int, int] = {}
        self.launched_during_backward = 0   # buckets whose all-reduce overlapped backward
        if size > 1:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_accumulated)

    def _make_buckets(self, limit_bytes: float) -> list[_Bucket]:
        # Reverse registration order approximates the order gradients become ready.
        groups = bucket_indices([p.numel() * p.element_size() for p in self.params], limit_bytes)
        return [self._bucket([self.params[i] for i in group]) for group in groups]

    def _bucket(self, params: list[nn.Parameter]) -> _Bucket:
        # The flat buffer is laid out in the same reversed order, so the slice holds exactly
        # these parameters' gradients (and alignment padding, which stays zero).
        return _Bucket(params, self.flat.slice_for(params) if self.flat is not None else None)

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
                bucket.launch(self.group)
                self.launched_during_backward += 1

    def finish(self) -> None:
        """Launch buckets whose parameters got no gradient, then wait for all of them."""
        for bucket in self.buckets:
            if bucket.work is None:
                bucket.launch(self.group)
        for bucket in self.buckets:
            bucket.finish()


def sync_shared_embeddings(params: list[nn.Parameter], group, size: int) -> None:
    """Sum the gradients of the word embedding's two copies (first and last stage)."""
    if size <= 1:
        return
    for p in params:
        if role_of(p).shared_embedding:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)


def reduce_sequence_parallel_grads(params: list[nn.Parameter], group, size: int) -> None:
    """Sum, over the tensor group, the gradients of replicated weights that sequence
    parallelism applies to 1/t of the tokens on each rank (LayerNorms, the row-parallel
    biases, position and token-type embeddings): one all-reduce of their concatenation."""
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


def global_grad_norm(params: list[nn.Parameter], model_group, tp_rank: int,
                     data_group=None, *, device: torch.device) -> torch.Tensor:
    """The gradient norm of the whole model, as a float64 tensor on `device` (no host sync).

    `device` is the rank's own, given rather than read from `params`: with the distributed
    optimizer a rank may hold no piece at all, and its (zero) share must still reach the
    collectives on the device (NCCL takes no CPU tensor).
    `data_group`: the gradients are sharded over it (distributed optimizer), so the squares
    are summed over it too. A non-finite element on any rank makes the norm non-finite on
    every rank: fp16's overflow check and skip are then common to all shards.
    """
    grads = [p.grad.detach() for p in params if p.grad is not None and counts_in_norm(p, tp_rank)]
    total = torch.zeros((), dtype=torch.float64, device=device)  # NCCL needs device tensors
    if grads:
        total += torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
    for group in (data_group, model_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
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
