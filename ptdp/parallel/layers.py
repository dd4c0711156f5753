"""Tensor-parallel layers: column- and row-parallel linears, the vocabulary-parallel embedding
and logits, and the layout-independent initialisation they share.

* `ColumnParallelLinear` splits the weight's output dimension, `RowParallelLinear` its input
  dimension, so an MLP or attention block needs one f and one g (ptdp/parallel/mappings.py).
* `VocabParallelEmbedding` and `parallel_logits` split the vocabulary, so the full [s, b, V]
  logits never exist on one rank (the loss: ptdp/parallel/cross_entropy.py).

Every parameter is initialised from the *full* tensor's RNG stream (seeded by the run seed and
the parameter's global name) and then sliced, so any tensor/pipeline layout starts from exactly
the weights a single process would have; the linears and the embedding draw only their slice
of that stream (ptdp/parallel/initial_weights.py). Split parameters declare `tp_split_dim` in
their role (ptdp/parallel/roles.py).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn

from ptdp.parallel.initial_weights import normal_rows, normal_slice
from ptdp.parallel.mappings import (TensorParallel, copy_to_tensor_region,
                                    gather_from_tensor_region, scatter_to_tensor_region)
from ptdp.parallel.roles import declare_role
from ptdp.parallel.sequence import (enter_tensor_region, gather_from_sequence_region,
                                    leave_tensor_region, mark_sequence_parallel)
from ptdp.parallel.weight_grad import PLAIN, WeightOps


def stable_seed(seed: int, key: str) -> int:
    """A seed that depends only on the run seed and the parameter's global name."""
    return zlib.crc32(f"{seed}:{key}".encode()) & 0x7FFFFFFF


def full_normal(shape, std: float, seed: int, key: str) -> torch.Tensor:
    """The full (unsplit) tensor as a single process would draw it, in fp32 on CPU."""
    generator = torch.Generator().manual_seed(stable_seed(seed, key))
    return torch.randn(shape, generator=generator) * std


def normal_param(shape, std: float, seed: int, key: str, split_dim: int | None,
                 tp: TensorParallel) -> nn.Parameter:
    """`shard_param(full_normal(shape, std, seed, key), split_dim, tp)`, bit for bit, drawing
    only my slice."""
    split = split_dim if tp.size > 1 else None
    param = nn.Parameter(normal_slice(shape, std, stable_seed(seed, key), split, tp.size, tp.rank))
    declare_role(param, tp_split_dim=split)
    return param


def shard_param(full: torch.Tensor, split_dim: int | None, tp: TensorParallel) -> nn.Parameter:
    """Slice my part of `full` along `split_dim` (None: replicated) into a Parameter."""
    if split_dim is None or tp.size == 1:
        data = full.clone()
    else:
        data = full.chunk(tp.size, dim=split_dim)[tp.rank].clone()
    param = nn.Parameter(data)
    declare_role(param, tp_split_dim=split_dim if tp.size > 1 else None)
    return param


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns: each rank computes Y_i = X A_i + b_i.

    The input must be replicated across the tensor group (f is applied here); the output
    stays split unless `gather_output`. With `skip_bias_add` the layer returns (X A_i, b_i)
    and the caller adds the bias inside a fused elementwise chain (ptdp/kernels/fused.py).
    """

    weight_ops = PLAIN   # zb-h1 rebinds it (ptdp/parallel/weight_grad.py), as every layer's below

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, *, seed: int,
                 key: str, std: float, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False):
        super().__init__()
        assert not (gather_output and skip_bias_add), "a gathered output needs its bias added"
        self.tp, self.gather_output, self.skip_bias_add = tp, gather_output, skip_bias_add
        self.weight = normal_param((out_features, in_features), std, seed, f"{key}.weight", 0, tp)
        self.bias = shard_param(torch.zeros(out_features), 0, tp) if bias else None

    def forward(self, x):
        bias = None if self.skip_bias_add else self.bias
        y = self.weight_ops.linear(enter_tensor_region(x, self.tp), self.weight, bias)
        if self.skip_bias_add:
            return y, self.bias
        return gather_from_tensor_region(y, self.tp) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows: Y = g(sum_i X_i A_i) + b.

    The input is normally already split (`input_is_parallel`, the output of a
    ColumnParallelLinear); the bias is added once, after the all-reduce, or with
    `skip_bias_add` returned as (Y without bias, b) for the caller's fused chain.
    """

    weight_ops = PLAIN

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, *, seed: int,
                 key: str, std: float, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False):
        super().__init__()
        self.tp, self.input_is_parallel, self.skip_bias_add = tp, input_is_parallel, skip_bias_add
        self.weight = normal_param((out_features, in_features), std, seed, f"{key}.weight", 1, tp)
        self.bias = (mark_sequence_parallel(shard_param(torch.zeros(out_features), None, tp), tp)
                     if bias else None)

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_region(x, self.tp)
        y = leave_tensor_region(self.weight_ops.linear(x, self.weight), self.tp)
        if self.skip_bias_add:
            return y, self.bias
        return y + self.bias if self.bias is not None else y


class ReplicatedLinear(nn.Module):
    """Y = X A^T with A whole on every tensor rank, applied to the tokens the rank holds: all
    of them (A's gradient is then the same everywhere), or with sequence parallelism its 1/t of
    them (partial: summed over the tensor group like a norm's). Latent attention's
    down-projections (models/latent_attention.py)."""

    weight_ops = PLAIN

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, *, seed: int,
                 key: str, std: float):
        super().__init__()
        self.weight = mark_sequence_parallel(
            normal_param((out_features, in_features), std, seed, f"{key}.weight", None, tp), tp)

    def forward(self, x):
        return self.weight_ops.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; rank i owns rows [i*V/t, (i+1)*V/t).

    Rows past the real vocabulary (padding up to a multiple of 128*t) are zero and are never
    looked up; the loss masks them, so they stay zero and the model is layout-independent.
    """

    weight_ops = PLAIN

    def __init__(self, vocab_size: int, padded_vocab_size: int, hidden: int, tp: TensorParallel,
                 *, seed: int, key: str, std: float):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.per_rank = padded_vocab_size // tp.size
        self.vocab_start = tp.rank * self.per_rank
        # my rows of the padded table: the real ones drawn from the full table's stream
        start, stop = (min(vocab_size, self.vocab_start + n) for n in (0, self.per_rank))
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden))
        if stop > start:
            normal_rows((vocab_size, hidden), std, stable_seed(seed, f"{key}.weight"), start, stop,
                        out=self.weight.data[:stop - start])
        declare_role(self.weight, tp_split_dim=0 if tp.size > 1 else None, vocab_padded=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.weight_ops.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = self.weight_ops.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tensor_region(out, self.tp)  # [s/t, b, h] with sequence parallelism


def parallel_logits(hidden: torch.Tensor, embedding_weight: torch.Tensor, tp: TensorParallel,
                    bias: torch.Tensor | None = None, sequence_sharded: bool = False,
                    ops: WeightOps = PLAIN) -> torch.Tensor:
    """[s, b, h] x [V/t, h]^T -> this rank's [s, b, V/t] slice of the logits.

    `sequence_sharded`: `hidden` is my [s/t, b, h] slice; it is all-gathered (reduce-scatter
    backward) instead of going through f. `ops`: the calling module's `weight_ops`.
    """
    linear = ops.linear
    if sequence_sharded:
        return linear(gather_from_sequence_region(hidden, tp), embedding_weight, bias)
    return linear(copy_to_tensor_region(hidden, tp), embedding_weight, bias)


def scaled_std(std: float, num_layers: int) -> float:
    """Output projections get std / sqrt(2 L) so the residual stream's variance stays flat."""
    return std / math.sqrt(2.0 * num_layers)
