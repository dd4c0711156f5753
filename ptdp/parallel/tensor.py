"""Tensor (intra-layer) model parallelism, as in Megatron-LM (Narayanan's dissertation, chapter 4).

* `copy_to_tensor_region` is the paper's **f**: identity forward, all-reduce backward.
* `reduce_from_tensor_region` is **g**: all-reduce forward, identity backward.
* `ColumnParallelLinear` splits the weight's output dimension, `RowParallelLinear` its input
  dimension, so an MLP or attention block needs one f and one g: two all-reduces forward and
  two backward per transformer layer.
* `VocabParallelEmbedding` and `vocab_parallel_cross_entropy` split the vocabulary, so the
  full [s, b, V] logits never exist on one rank.
* Sequence parallelism (`TensorParallel.sequence_parallel`, Korthikanti et al. 2022): between
  the tensor-parallel regions (LayerNorm, dropout, residual adds) each rank holds 1/t of the
  sequence, [s/t, b, h]. f becomes an all-gather along the sequence (reduce-scatter backward)
  and g a reduce-scatter (all-gather backward): the same bytes as the all-reduces they replace,
  and the activations of those regions drop by t. Weights used there are replicated but see
  only the local tokens, so they carry `sequence_parallel` and their gradients are summed over
  the tensor group (ptdp/optim/grads.py).

Every parameter is initialised from the *full* tensor's RNG stream (seeded by the run seed
and the parameter's global name) and then sliced, so any tensor/pipeline layout starts from
exactly the weights a single process would have. Split parameters carry `tp_split_dim`.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ptdp.parallel import weight_grad


# --------------------------------------------------------------------------------------------
# The tensor-parallel group
# --------------------------------------------------------------------------------------------

@dataclass
class TensorParallel:
    """The tensor group a layer communicates over, and this rank's place in it."""

    group: object = None
    rank: int = 0
    size: int = 1
    sequence_parallel: bool = False   # activations outside the regions are [s/t, b, h]

    @classmethod
    def from_grid(cls, grid, sequence_parallel: bool = False) -> "TensorParallel":
        return cls(grid.tensor_group, grid.tp_rank, grid.t, sequence_parallel and grid.t > 1)

    def shard(self, n: int) -> int:
        assert n % self.size == 0, f"{n} is not divisible by tensor parallel size {self.size}"
        return n // self.size


# --------------------------------------------------------------------------------------------
# f and g, plus gather/scatter along the last dimension
# --------------------------------------------------------------------------------------------

def _all_reduce(x: torch.Tensor, group, size: int) -> torch.Tensor:
    if size == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _gather_last_dim(x: torch.Tensor, group, size: int) -> torch.Tensor:
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


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
        return _all_reduce(grad, ctx.tp.group, ctx.tp.size), None


class _ReduceFromTensorRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, tp: TensorParallel):
        return _all_reduce(x, tp.group, tp.size)

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


# --------------------------------------------------------------------------------------------
# Sequence parallelism: the same pairs along the first (sequence) dimension
# --------------------------------------------------------------------------------------------

def _gather_first_dim(x: torch.Tensor, group, size: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_first_dim(x: torch.Tensor, group, size: int) -> torch.Tensor:
    assert x.shape[0] % size == 0, f"sequence {x.shape[0]} does not split {size} ways"
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


# torch renamed reduce_scatter_tensor (deprecated since 2.10); keep older releases working
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
        param.sequence_parallel = True
    return param


def sequence_parallel_dropout(x: torch.Tensor, p: float, tp: TensorParallel) -> torch.Tensor:
    """Dropout of my [s/t, b, h] slice with my rows of the mask the whole tensor would get.

    The mask is drawn for the full [s, b, h] shape from the default generator (identical on
    every tensor rank) and sliced, exactly as F.dropout draws it on CPU (bernoulli, then
    divide by 1-p), so a sequence-parallel run drops the same elements as one without it:
    the layouts stay interchangeable. Only the slice is kept for backward; drawing the full
    mask costs t times the random numbers, not memory that outlives this call.
    """
    full = (x.shape[0] * tp.size, *x.shape[1:])
    noise = torch.empty(full, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    noise = sequence_shard(noise, tp).clone().div_(1 - p)  # a copy: the full mask is freed
    return x * noise


# --------------------------------------------------------------------------------------------
# Layout-independent initialisation
# --------------------------------------------------------------------------------------------

def stable_seed(seed: int, key: str) -> int:
    """A seed that depends only on the run seed and the parameter's global name."""
    return zlib.crc32(f"{seed}:{key}".encode()) & 0x7FFFFFFF


def full_normal(shape, std: float, seed: int, key: str) -> torch.Tensor:
    """The full (unsplit) tensor as a single process would draw it, in fp32 on CPU."""
    generator = torch.Generator().manual_seed(stable_seed(seed, key))
    return torch.randn(shape, generator=generator) * std


def shard_param(full: torch.Tensor, split_dim: int | None, tp: TensorParallel) -> nn.Parameter:
    """Slice my part of `full` along `split_dim` (None: replicated) into a Parameter."""
    if split_dim is None or tp.size == 1:
        data = full.clone()
    else:
        data = full.chunk(tp.size, dim=split_dim)[tp.rank].clone()
    param = nn.Parameter(data)
    param.tp_split_dim = split_dim if tp.size > 1 else None
    return param


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns: each rank computes Y_i = X A_i + b_i.

    The input must be replicated across the tensor group (f is applied here); the output
    stays split unless `gather_output`. With `skip_bias_add` the layer returns (X A_i, b_i)
    and the caller adds the bias inside a fused elementwise chain (ptdp/kernels/fused.py).
    """

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, *, seed: int,
                 key: str, std: float, bias: bool = True, gather_output: bool = False,
                 full_weight: torch.Tensor | None = None, skip_bias_add: bool = False,
                 defer_weight_grad: bool = False):
        super().__init__()
        assert not (gather_output and skip_bias_add), "a gathered output needs its bias added"
        self.tp, self.gather_output, self.skip_bias_add = tp, gather_output, skip_bias_add
        self.linear = weight_grad.linear if defer_weight_grad else F.linear
        full = full_weight if full_weight is not None else full_normal(
            (out_features, in_features), std, seed, f"{key}.weight")
        self.weight = shard_param(full, 0, tp)
        self.bias = shard_param(torch.zeros(out_features), 0, tp) if bias else None

    def forward(self, x):
        bias = None if self.skip_bias_add else self.bias
        y = self.linear(enter_tensor_region(x, self.tp), self.weight, bias)
        if self.skip_bias_add:
            return y, self.bias
        return gather_from_tensor_region(y, self.tp) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows: Y = g(sum_i X_i A_i) + b.

    The input is normally already split (`input_is_parallel`, the output of a
    ColumnParallelLinear); the bias is added once, after the all-reduce, or with
    `skip_bias_add` returned as (Y without bias, b) for the caller's fused chain.
    """

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, *, seed: int,
                 key: str, std: float, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, defer_weight_grad: bool = False):
        super().__init__()
        self.tp, self.input_is_parallel, self.skip_bias_add = tp, input_is_parallel, skip_bias_add
        self.linear = weight_grad.linear if defer_weight_grad else F.linear
        full = full_normal((out_features, in_features), std, seed, f"{key}.weight")
        self.weight = shard_param(full, 1, tp)
        self.bias = (mark_sequence_parallel(shard_param(torch.zeros(out_features), None, tp), tp)
                     if bias else None)

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_region(x, self.tp)
        y = leave_tensor_region(self.linear(x, self.weight), self.tp)
        if self.skip_bias_add:
            return y, self.bias
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; rank i owns rows [i*V/t, (i+1)*V/t).

    Rows past the real vocabulary (padding up to a multiple of 128*t) are zero and are never
    looked up; the loss masks them, so they stay zero and the model is layout-independent.
    """

    def __init__(self, vocab_size: int, padded_vocab_size: int, hidden: int, tp: TensorParallel,
                 *, seed: int, key: str, std: float, defer_weight_grad: bool = False):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.embedding = weight_grad.embedding if defer_weight_grad else F.embedding
        full = torch.zeros(padded_vocab_size, hidden)
        full[:vocab_size] = full_normal((vocab_size, hidden), std, seed, f"{key}.weight")
        self.weight = shard_param(full, 0, tp)
        self.weight.vocab_padded = True
        self.per_rank = padded_vocab_size // tp.size
        self.vocab_start = tp.rank * self.per_rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = self.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tensor_region(out, self.tp)  # [s/t, b, h] with sequence parallelism


def parallel_logits(hidden: torch.Tensor, embedding_weight: torch.Tensor, tp: TensorParallel,
                    bias: torch.Tensor | None = None, sequence_sharded: bool = False,
                    defer_weight_grad: bool = False) -> torch.Tensor:
    """[s, b, h] x [V/t, h]^T -> this rank's [s, b, V/t] slice of the logits.

    `sequence_sharded`: `hidden` is my [s/t, b, h] slice; it is all-gathered (reduce-scatter
    backward) instead of going through f.
    """
    linear = weight_grad.linear if defer_weight_grad else F.linear
    if sequence_sharded:
        return linear(gather_from_sequence_region(hidden, tp), embedding_weight, bias)
    return linear(copy_to_tensor_region(hidden, tp), embedding_weight, bias)


# --------------------------------------------------------------------------------------------
# Vocab-parallel cross-entropy
# --------------------------------------------------------------------------------------------

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary, never gathering them.

    Three reductions over the tensor group: max (for stability), then the target logit and
    the sum of exponentials together in one all-reduce.

    Memory: the logits are [s, b, V/t], the largest activation of the model (GPT 1.3B at
    micro-batch 8: 0.8 G elements, 1.7 GB in bf16). Exactly one fp32 tensor of that shape is
    made: `logits - max` (fp32 by type promotion, which also upcasts bf16 exactly), turned in
    place into exp, then the softmax that backward keeps, then in backward into the gradient.
    The max is taken on the input dtype (a max needs no rounding) over the real columns only,
    so neither an fp32 copy nor a masked clone of the padded logits is needed.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_size: int, tp: TensorParallel):
        ctx.logits_dtype = logits.dtype
        compute = torch.promote_types(logits.dtype, torch.float32)  # fp32; fp64 stays fp64
        per_rank = logits.shape[-1]
        start = tp.rank * per_rank
        real_here = max(0, min(per_rank, vocab_size - start))
        if real_here > 0:
            logits_max = logits[..., :real_here].amax(dim=-1).to(compute)
        else:  # this rank holds only padding columns
            logits_max = torch.full(logits.shape[:-1], float("-inf"), dtype=compute,
                                    device=logits.device)
        if tp.size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = torch.sub(logits, logits_max.unsqueeze(-1))  # the one fp32 copy
        if real_here < per_rank:  # padded columns never win and get no gradient
            shifted[..., real_here:] = float("-inf")

        local_target = target - start
        outside = (local_target < 0) | (local_target >= per_rank)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        exp = shifted.exp_()
        sums = torch.stack([target_logit, exp.sum(dim=-1)])
        if tp.size > 1:
            dist.all_reduce(sums, group=tp.group)
        target_logit, sum_exp = sums[0], sums[1]

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # in place: backward runs once, and the softmax is not needed after it
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int,
                                 tp: TensorParallel) -> torch.Tensor:
    """Per-token loss ([s, b], fp32) from this rank's [s, b, V_padded/t] logits slice.

    `vocab_size` is the real vocabulary; columns past it are padding and are masked out.
    t = 1 takes the same path (with no communication): F.cross_entropy on the unpadded
    columns would make two fp32 copies of the logits (the upcast and the log-softmax).
    """
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_size, tp)


# --------------------------------------------------------------------------------------------
# RNG for dropout
# --------------------------------------------------------------------------------------------

TENSOR_RNG_OFFSET = 2718


class TensorParallelRNG:
    """A second RNG stream for dropout *inside* tensor-parallel regions.

    Activations inside a tensor-parallel region (e.g. attention probabilities of this rank's
    heads) are different tensors on each rank, so their dropout masks must differ: that stream
    is seeded with the tensor rank. Activations outside (the replicated hidden state) must be
    dropped identically on every tensor rank, so they use the default torch generator, which
    is seeded identically across the tensor group.
    """

    def __init__(self, seed: int, tp_rank: int, device: torch.device):
        self.device = torch.device(device)
        self._state = self._fresh_state(seed + TENSOR_RNG_OFFSET + tp_rank)

    def _fresh_state(self, seed: int) -> torch.Tensor:
        saved = self._get()
        torch.manual_seed(seed) if self.device.type == "cpu" else torch.cuda.manual_seed(seed)
        state = self._get()
        self._set(saved)
        return state

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def get_state(self) -> torch.Tensor:
        return self._state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state.clone()

    @contextlib.contextmanager
    def fork(self):
        """Run the body with the tensor-parallel stream, then restore the default stream."""
        default = self._get()
        self._set(self._state)
        try:
            yield
        finally:
            self._state = self._get()
            self._set(default)


def seed_everything(seed: int, pp_rank: int) -> None:
    """Default generator: same across tensor and data ranks, distinct per pipeline stage."""
    torch.manual_seed(seed + 100 * pp_rank)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed + 100 * pp_rank)


def scaled_std(std: float, num_layers: int) -> float:
    """Output projections get std / sqrt(2 L) so the residual stream's variance stays flat."""
    return std / math.sqrt(2.0 * num_layers)
