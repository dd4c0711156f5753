"""Activation recomputation (`train.recompute`): less kept for backward, more computed in it.

* `recompute`: torch.utils.checkpoint that also replays the tensor-parallel dropout stream;
  `recompute=full` runs groups of layers through it (models/transformer.py TransformerStack).
* `checkpointed`: `recompute=selective`'s core_attn and mlp modules (ptdp/config/recompute.py),
  Megatron-LM's "normal checkpointing": the region keeps only its tensor inputs, saved as any
  op saves what its backward needs (so saved-tensor hooks see them, and `without_output` can
  drop a region's input that another region produced), and re-runs in backward.
* `without_output`: the layernorm and activation modules, Megatron-LM's "output-discarding
  checkpointing": consume(produce(x)) where the linear that consumes produce's output does not
  keep it; backward rebuilds it from x (which produce keeps anyway: a norm and GeLU save their
  inputs) when the linear's backward unpacks it.

Every recomputation re-runs the same kernels on the same inputs (and dropout on the same random
state), so gradients equal those without it bit for bit. All three are eager islands inside a
compiled layer (`torch.compiler.disable`): swapping generator states and saved-tensor hooks
are Python-side work dynamo must not trace.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ptdp.parallel.rng import TensorParallelRNG


@torch.compiler.disable  # selective recomputation runs inside a compiled layer: keep it eager
def recompute(rng: TensorParallelRNG, fn, *args):
    """torch.utils.checkpoint that also replays the tensor-parallel dropout stream.

    torch's checkpoint restores the default generator for the re-run; the tensor-parallel
    stream is ours, so the re-run starts from the state the first run saw and then puts back
    whatever state the stream had reached meanwhile (other micro-batches may have run).
    """
    start_state = rng.get_state()
    calls = []

    def run(*a):
        if not calls:
            calls.append(1)
            return fn(*a)
        current = rng.get_state()
        rng.set_state(start_state)
        try:
            return fn(*a)
        finally:
            rng.set_state(current)

    return checkpoint(run, *args, use_reentrant=False)


class _Checkpoint(torch.autograd.Function):
    """fn(*inputs) -> one tensor, keeping only `inputs` (save_for_backward); backward re-runs fn
    with the tensor-parallel stream where the forward found it and backpropagates through it.
    fn may draw random numbers from that stream only (core attention's dropout)."""

    @staticmethod
    def forward(ctx, fn, rng, *inputs):
        ctx.fn, ctx.rng = fn, rng
        ctx.start_state = rng.get_state() if rng is not None else None
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, grad):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        current = ctx.rng.get_state() if ctx.rng is not None else None
        if current is not None:
            ctx.rng.set_state(ctx.start_state)
        try:
            with torch.enable_grad():
                out = ctx.fn(*inputs)
        finally:
            if current is not None:
                ctx.rng.set_state(current)
        torch.autograd.backward(out, grad)
        return (None, None, *(x.grad if x.requires_grad else None for x in inputs))


@torch.compiler.disable
def checkpointed(rng: TensorParallelRNG | None, fn, *inputs: torch.Tensor) -> torch.Tensor:
    """fn(*inputs) (tensors in, one tensor out), recomputed in backward from `inputs` alone."""
    if not torch.is_grad_enabled():
        return fn(*inputs)
    return _Checkpoint.apply(fn, rng, *inputs)


class _Rebuilt:
    """produce(*args)'s output, recomputed once for the `count` saved views of it that backward
    unpacks, and let go after the last (a retained graph recomputes it again)."""

    def __init__(self, produce, args):
        self.produce, self.args, self.count, self.left, self.value = produce, args, 0, 0, None

    def take(self, view: tuple) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = self.produce(*self.args)
            self.left = self.count
        size, stride, offset = view
        out = self.value.as_strided(size, stride, offset)
        self.left -= 1
        if self.left == 0:
            self.value = None
        return out


@torch.compiler.disable
def without_output(produce, consume, *args):
    """consume(produce(*args)), where the tensors that consume's operations save for backward
    and that share produce's output's storage (its linear's input, or views of it) are not
    kept: backward rebuilds them from `args`. produce must be deterministic, draw no random
    numbers, return one fresh tensor and not modify `args`. Saved-tensor hooks active around
    the call (a memory measurement) see every tensor that is kept."""
    out = produce(*args)
    if not (torch.is_grad_enabled() and out.requires_grad):
        return consume(out)
    storage = out.untyped_storage().data_ptr()
    rebuilt = _Rebuilt(produce, args)
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(x):
        if x.untyped_storage().data_ptr() == storage:
            rebuilt.count += 1
            return rebuilt, (x.size(), x.stride(), x.storage_offset())
        return (None, outer_pack(x)) if outer_pack is not None else (None, x)

    def unpack(packed):
        source, value = packed
        if source is not None:
            return source.take(value)
        return outer_unpack(value) if outer_unpack is not None else value

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return consume(out)


def after_norm(ctx, norm_module, consume, x):
    """consume(norm(x)); with the layernorm module recomputed (`ctx.recomputes`, a
    ModelContext's), norm(x) is not kept for consume's backward but rebuilt from x
    (`without_output`). No norm: consume(x)."""
    if norm_module is None:
        return consume(x)
    if ctx.recomputes("layernorm"):
        return without_output(norm_module, consume, x)
    return consume(norm_module(x))
