"""Vocabulary-parallel cross-entropy: the loss over logits split along the vocabulary across
the tensor group, computed without ever gathering them."""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.distributed as dist

from ptdp.parallel.mappings import TensorParallel


class _Slice:
    """This rank's part of the vocabulary: columns [start, start + per_rank), of which the
    first `real_here` are real (the rest is padding), and the targets as local columns
    (`outside`: the target lies on another rank; its local column is then 0)."""

    def __init__(self, logits, target, vocab_size: int, tp: TensorParallel):
        self.per_rank = logits.shape[-1]
        self.start = tp.rank * self.per_rank
        self.real_here = max(0, min(self.per_rank, vocab_size - self.start))
        local_target = target - self.start
        self.outside = (local_target < 0) | (local_target >= self.per_rank)
        self.local_target = local_target.masked_fill(self.outside, 0)


def _global_max(logits, part: _Slice, tp: TensorParallel):
    """The max over the whole vocabulary's real columns, in fp32 (fp64 stays fp64): taken on
    the input dtype (a max needs no rounding) over this rank's real columns only, so neither
    an fp32 copy nor a masked clone of the padded logits is needed; then all-reduced."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    if part.real_here > 0:
        logits_max = logits[..., :part.real_here].amax(dim=-1).to(compute)
    else:  # this rank holds only padding columns
        logits_max = torch.full(logits.shape[:-1], float("-inf"), dtype=compute,
                                device=logits.device)
    if tp.size > 1:
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp.group)
    return logits_max


def _summed(target_logit, sum_exp, tp: TensorParallel):
    """The target logit and the exponentials' sum over the tensor group, in one all-reduce."""
    sums = torch.stack([target_logit, sum_exp])
    if tp.size > 1:
        dist.all_reduce(sums, group=tp.group)
    return sums[0], sums[1]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary, never gathering them.

    Three reductions over the tensor group: max (for stability), then the target logit and
    the sum of exponentials together in one all-reduce.

    Memory: the logits are [s, b, V/t], the largest activation of the model (GPT 1.3B at
    micro-batch 8: 0.8 G elements, 1.7 GB in bf16). Exactly one fp32 tensor of that shape is
    made: `logits - max` (fp32 by type promotion, which also upcasts bf16 exactly), turned in
    place into exp, then the softmax that backward keeps, then in backward into the gradient.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_size: int, tp: TensorParallel):
        ctx.logits_dtype = logits.dtype
        part = _Slice(logits, target, vocab_size, tp)
        logits_max = _global_max(logits, part, tp)
        shifted = torch.sub(logits, logits_max.unsqueeze(-1))  # the one fp32 copy
        if part.real_here < part.per_rank:  # padded columns never win and get no gradient
            shifted[..., part.real_here:] = float("-inf")
        target_logit = shifted.gather(-1, part.local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(part.outside, 0.0)
        exp = shifted.exp_()
        target_logit, sum_exp = _summed(target_logit, exp.sum(dim=-1), tp)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), part.local_target, part.outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # in place: backward runs once, and the softmax is not needed after it
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


# ------------------------------------------------------------------ fused (train.compile)
def _shifted(logits, logits_max, real_here: int):
    """logits - max in the max's dtype (fp32; fp64 stays fp64), the padding columns -inf.
    Inside the compiled kernels below it is never stored: each pass recomputes it from the
    logits as it reads them."""
    shifted = logits.to(logits_max.dtype) - logits_max.unsqueeze(-1)
    if real_here < logits.shape[-1]:
        columns = torch.arange(logits.shape[-1], device=logits.device)
        shifted = shifted.masked_fill(columns >= real_here, float("-inf"))
    return shifted


def _target_and_sum_exp(logits, logits_max, local_target, outside, real_here: int):
    shifted = _shifted(logits, logits_max, real_here)
    target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    return target_logit.masked_fill(outside, 0.0), shifted.exp().sum(dim=-1)


def _logits_grad(logits, logits_max, sum_exp, local_target, outside, grad_loss,
                 real_here: int):
    softmax = _shifted(logits, logits_max, real_here).exp() / sum_exp.unsqueeze(-1)
    columns = torch.arange(logits.shape[-1], device=logits.device)
    hit = (columns == local_target.unsqueeze(-1)) & ~outside.unsqueeze(-1)
    return ((softmax - hit.to(softmax.dtype)) * grad_loss.unsqueeze(-1)).to(logits.dtype)


@functools.cache
def _compiled(fn):
    return torch.compile(fn)


@contextlib.contextmanager
def _quiet_inductor():
    """Over few long rows (BERT's masked positions) inductor splits a pass's reduction and warns
    that online softmax is off, in every BERT job's log (one H200 run): these passes take the
    max as an input, so there is no online softmax to lose. That warning alone is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled",
                                category=UserWarning)
        yield


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """The same loss and gradient, each pass one compiled kernel over the logits as they are
    (bf16 on a GPU) instead of eager PyTorch's passes over an fp32 copy: forward reads them
    twice (max; the exponentials' sum with the target logit), backward once and writes the
    gradient in their dtype. It keeps the logits for backward instead of an fp32 softmax
    (half the bytes in bf16) and makes no fp32 tensor of their shape. The all-reduces between
    the passes stay eager. Equal to the eager Function up to float round-off (the reductions'
    order; tests/parallel/test_tensor_ops.py)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_size: int, tp: TensorParallel):
        part = _Slice(logits, target, vocab_size, tp)
        logits_max = _global_max(logits, part, tp)
        with _quiet_inductor():
            passed = _compiled(_target_and_sum_exp)(logits, logits_max, part.local_target,
                                                    part.outside, part.real_here)
        target_logit, sum_exp = _summed(*passed, tp)
        ctx.real_here = part.real_here
        ctx.save_for_backward(logits, logits_max, sum_exp, part.local_target, part.outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        logits, logits_max, sum_exp, local_target, outside = ctx.saved_tensors
        with _quiet_inductor():
            grad = _compiled(_logits_grad)(logits, logits_max, sum_exp, local_target, outside,
                                           grad_loss, ctx.real_here)
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int,
                                 tp: TensorParallel, fused: bool = False) -> torch.Tensor:
    """Per-token loss ([s, b], fp32) from this rank's [s, b, V_padded/t] logits slice.

    `vocab_size` is the real vocabulary; columns past it are padding and are masked out.
    t = 1 takes the same path (with no communication): F.cross_entropy on the unpadded
    columns would make two fp32 copies of the logits (the upcast and the log-softmax).
    `fused` (train.compile): each pass over the logits one compiled kernel, no fp32 copy.
    """
    function = _FusedVocabParallelCrossEntropy if fused else _VocabParallelCrossEntropy
    return function.apply(logits, target, vocab_size, tp)
