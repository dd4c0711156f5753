"""Sequence parallelism (Korthikanti et al. 2022): between the tensor-parallel regions
(LayerNorm, dropout, residual adds) each tensor rank holds 1/t of the sequence, [s/t, b, h].

f becomes an all-gather along the sequence (reduce-scatter backward) and g a reduce-scatter
(all-gather backward): the same bytes as the all-reduces they replace, and the activations of
those regions drop by t. Weights used there are replicated but see only the local tokens, so
they carry the `sequence_parallel` role and their gradients are summed over the tensor group
(ptdp/optim/grads.py). `enter_tensor_region` / `leave_tensor_region` pick f/g or their sequence
forms, so layers need not know which is on.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ptdp.parallel.mappings import (TensorParallel, all_gather_single, copy_to_tensor_region,
                                    reduce_from_tensor_region, reduce_scatter_single)
from ptdp.parallel.roles import declare_role


def _gather_first_dim(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[s/t, ...] -> [s, ...]: the ranks' slices land in place in the output (no concatenation)."""
    out = x.new_empty((x.shape[0] * size, *x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_first_dim(x: torch.Tensor, group, size: int) -> torch.Tensor:
    assert x.shape[0] % size == 0, f"sequence {x.shape[0]} does not split {size} ways"
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def _split_first_dim(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return x.chunk(size, dim=0)[rank].clone()  # a row slice is contiguous: copy to free the rest


class _GatherFromSequenceRegion(torch.autograd.Function):
    """All-gather the sequence forward. Backward: reduce-scatter when the consumer is split
    across the tensor group (a column-parallel GEMM: each rank holds a partial gradient of the
    whole sequence), else keep my slice (a replicated consumer: every rank has the full one)."""

    @staticmethod
    def forward(ctx, x, tp: TensorParallel, reduce_grad: bool):
        ctx.tp, ctx.reduce_grad = tp, reduce_grad
        return _gather_first_dim(x, tp.group, tp.size)

    @staticmethod
    def backward(ctx, grad):
        tp = ctx.tp
        if ctx.reduce_grad:
            return _reduce_scatter_first_dim(grad, tp.group, tp.size), None, None
        return _split_first_dim(grad, tp.rank, tp.size), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Sum the partial outputs and keep my slice of the sequence forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, tp: TensorParallel):
        ctx.tp = tp
        return _reduce_scatter_first_dim(x, tp.group, tp.size)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.tp.group, ctx.tp.size), None


@torch.compiler.disable
def gather_from_sequence_region(x, tp: TensorParallel, reduce_grad: bool = True):
    """[s/t, b, h] -> [s, b, h] (see `_GatherFromSequenceRegion` for the backward)."""
    return _GatherFromSequenceRegion.apply(x, tp, reduce_grad) if tp.size > 1 else x


@torch.compiler.disable
def reduce_scatter_to_sequence_region(x, tp: TensorParallel):
    """[s, b, h] partial sums -> my [s/t, b, h] slice of their total."""
    return _ReduceScatterToSequenceRegion.apply(x, tp) if tp.size > 1 else x


def enter_tensor_region(x, tp: TensorParallel):
    """What a column-parallel GEMM's input goes through: f, or the sequence all-gather."""
    if tp.sequence_parallel:
        return gather_from_sequence_region(x, tp)
    return copy_to_tensor_region(x, tp)


def leave_tensor_region(x, tp: TensorParallel):
    """What a row-parallel GEMM's partial output goes through: g, or the reduce-scatter."""
    if tp.sequence_parallel:
        return reduce_scatter_to_sequence_region(x, tp)
    return reduce_from_tensor_region(x, tp)


def sequence_shard(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """My rows of a tensor laid out along the full sequence (identity without SP)."""
    if not tp.sequence_parallel:
        return x
    return x.chunk(tp.size, dim=0)[tp.rank]


def mark_sequence_parallel(param: nn.Parameter, tp: TensorParallel) -> nn.Parameter:
    """A replicated weight applied to the local tokens only: its gradient is partial."""
    if tp.sequence_parallel:
        declare_role(param, sequence_parallel=True)
    return param


def sequence_parallel_dropout(x: torch.Tensor, p: float, tp: TensorParallel) -> torch.Tensor:
    """Dropout of my [s/t, b, h] slice with my rows of the mask the whole tensor would get.

    The mask is drawn for the full [s, b, h] shape from the default generator (identical on
    every tensor rank) and sliced, exactly as F.dropout draws it on CPU (bernoulli, then
    scale by 1/(1-p), computed as it computes it), so a sequence-parallel run drops the same
    elements as one without it: the layouts stay interchangeable. Only my rows are kept for
    backward, as a bool mask (1 byte an element, not the activation's 2 or 4); drawing the
    full mask costs t times the random numbers, not memory that outlives this call.
    """
    full = (x.shape[0] * tp.size, *x.shape[1:])
    draws = torch.empty(full, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    keep = sequence_shard(draws, tp).bool()          # a copy: the full draws are freed
    scale = torch.ones((), dtype=x.dtype, device=x.device).div_(1 - p)
    return x.masked_fill(~keep, 0) * scale
