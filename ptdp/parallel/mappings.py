"""Tensor (intra-layer) model parallelism's communication, as in Megatron-LM (Narayanan's
dissertation, chapter 4): each pattern is a pair of small autograd Functions.

* `copy_to_tensor_region` is the paper's **f**: identity forward, all-reduce backward.
* `reduce_from_tensor_region` is **g**: all-reduce forward, identity backward.
* `gather_from_tensor_region` / `scatter_to_tensor_region`: all-gather / split along the last
  dimension (a gathered column-parallel output, a row-parallel layer fed replicated input).

A column-parallel GEMM followed by a row-parallel one needs one f and one g: two all-reduces
forward and two backward per transformer block (ptdp/parallel/layers.py). With sequence
parallelism f and g become the sequence all-gather and reduce-scatter
(ptdp/parallel/sequence.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallel:
    """The tensor group a layer communicates over, and this rank's place in it."""

    group: object = None
    rank: int = 0
    size: int = 1
    sequence_parallel: bool = False   # activations outside the regions are [s/t, b, h]

    @classmethod
    def from_grid(cls, grid, sequence_parallel: bool = False) -> "TensorParallel":
        return cls(grid.group("tensor"), grid.tp_rank, grid.t, sequence_parallel and grid.t > 1)

    def shard(self, n: int) -> int:
        assert n % self.size == 0, f"{n} is not divisible by tensor parallel size {self.size}"
        return n // self.size


# Newer torch names the tensor forms (all_gather_into_tensor, reduce_scatter_tensor) *_single;
# torch 2.11, the GPU machines' release, has only the older names. Call these, never dist.*_single.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                         or dist.reduce_scatter_tensor)


def _all_reduce_(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """Sum `x` over the group, in place when it is contiguous (no copy). The callers own `x`:
    g's input is a GEMM's fresh partial output (or the masked embedding lookup), f's backward
    gets the input gradient of the one GEMM its output feeds."""
    if size == 1:
        return x
    out = x.contiguous()   # a copy only for a non-contiguous tensor
    dist.all_reduce(out, group=group)
    return out


def _gather_last_dim(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """All-gather along the last dimension: one collective into one buffer (the ranks' slices
    stacked along the first dimension), then the one copy that interleaves them (a
    last-dimension concatenation is no view of it)."""
    if size == 1:
        return x
    x = x.contiguous()
    gathered = x.new_empty((size * x.shape[0], *x.shape[1:]))
    all_gather_single(gathered, x, group=group)
    return torch.cat(gathered.chunk(size, dim=0), dim=-1)


def _split_last_dim(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    if size == 1:
        return x
    return x.chunk(size, dim=-1)[rank].contiguous()


class _CopyToTensorRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, tp: TensorParallel):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_(grad, ctx.tp.group, ctx.tp.size), None


class _ReduceFromTensorRegion(torch.autograd.Function):
    """g: all-reduce forward (in place: the input is a partial sum nobody else reads),
    identity backward."""

    @staticmethod
    def forward(ctx, x, tp: TensorParallel):
        out = _all_reduce_(x, tp.group, tp.size)
        if out is x:
            ctx.mark_dirty(x)   # autograd checks that no saved tensor was x
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTensorRegion(torch.autograd.Function):
    """All-gather along the last dim forward, keep my slice backward."""

    @staticmethod
    def forward(ctx, x, tp: TensorParallel):
        ctx.tp = tp
        return _gather_last_dim(x, tp.group, tp.size)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.tp.rank, ctx.tp.size), None


class _ScatterToTensorRegion(torch.autograd.Function):
    """Keep my slice of the last dim forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, tp: TensorParallel):
        ctx.tp = tp
        return _split_last_dim(x, tp.rank, tp.size)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.tp.group, ctx.tp.size), None


@torch.compiler.disable
def _communicate(mapping, x, tp: TensorParallel):
    """Run a mapping eagerly: a compiled layer (train.compile) breaks its graph here rather
    than tracing our in-place process-group calls. With t = 1 the mappings are the identity
    and are never called, so the layer compiles to one graph."""
    return mapping.apply(x, tp)


def copy_to_tensor_region(x, tp: TensorParallel):
    return _communicate(_CopyToTensorRegion, x, tp) if tp.size > 1 else x


def reduce_from_tensor_region(x, tp: TensorParallel):
    return _communicate(_ReduceFromTensorRegion, x, tp) if tp.size > 1 else x


def gather_from_tensor_region(x, tp: TensorParallel):
    return _communicate(_GatherFromTensorRegion, x, tp) if tp.size > 1 else x


def scatter_to_tensor_region(x, tp: TensorParallel):
    return _communicate(_ScatterToTensorRegion, x, tp) if tp.size > 1 else x
