"""The backward pass split in two, for zero-bubble pipeline schedules (Qi et al. 2023).

A layer's backward computes two things: the gradient of its input, which the previous stage
waits for (the pass called B), and the gradients of its weights, which nothing waits for until
the optimizer step (W). ZB-H1 (ptdp/pipeline/schedules.py) runs B as soon as it can and moves
W into what would otherwise be the pipeline's bubbles.

The weighted operations below (linear, LayerNorm, embedding lookup) are autograd Functions
whose backward returns the input gradient and, while a B pass is open (`STORE.defer(key)`),
hands the weight gradient over as a closure instead of computing it. `STORE.run(key)` (the W
pass) evaluates the closures of that micro-batch and stage, sums them per weight and
accumulates them through autograd (`torch.autograd.backward` on the weights), so the hooks that
follow an accumulation fire as after a plain backward: fp32 gradient accumulation and the
data-parallel buckets, which therefore launch after the last W of the iteration. Outside a
B pass the same Functions compute both gradients at once.

The gradients come from the kernels autograd itself uses (the GEMMs, aten's LayerNorm and
embedding backward), so a split backward equals a plain one to round-off. The elementwise
bias-add chains and the position-embedding slice keep their (cheap) weight gradients in B.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class WeightGradStore:
    """Deferred weight gradients by (micro-batch, stage), one store per process (rank)."""

    def __init__(self):
        self._open: list | None = None
        self._pending: dict = {}

    @property
    def deferring(self) -> bool:
        return self._open is not None

    @contextlib.contextmanager
    def defer(self, key):
        """Run a B pass: weight gradients produced inside are kept for `run(key)`."""
        if self._open is not None:
            raise RuntimeError(f"a B pass is already open while starting {key}")
        self._open = []
        try:
            yield
        finally:
            self._pending.setdefault(key, []).extend(self._open)
            self._open = None

    def add(self, params: list, compute: Callable[[], list]) -> None:
        self._open.append((params, compute))

    def run(self, key) -> None:
        """The W pass of `key`: compute its weight gradients and accumulate them."""
        if key not in self._pending:
            raise RuntimeError(f"W pass of {key} without its B pass")
        totals: dict[int, list] = {}
        for params, compute in self._pending.pop(key):
            for param, grad in zip(params, compute()):
                if param is None or grad is None:
                    continue
                entry = totals.setdefault(id(param), [param, None])
                entry[1] = grad if entry[1] is None else entry[1] + grad
        if totals:
            params, grads = zip(*totals.values())
            torch.autograd.backward(list(params), list(grads))

    def pending(self) -> list:
        return sorted(self._pending, key=str)

    def clear(self) -> None:
        self._open, self._pending = None, {}


STORE = WeightGradStore()


def _weight_grads(params: list, compute: Callable[[], list]) -> list:
    """Either defer `compute` (inside a B pass) and return Nones, or compute now."""
    if STORE.deferring:
        STORE.add(params, compute)
        return [None] * len(params)
    return compute()


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose weight (and bias) gradients may be deferred to the W pass."""
    return _LinearWithBias.apply(x, weight, bias) if bias is not None else _LinearNoBias.apply(x, weight)


class _LinearNoBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        (grad_w,) = _weight_grads([weight], lambda: [_flat(grad).t().matmul(_flat(x))])
        return grad_x, grad_w


class _LinearWithBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w, grad_b = _weight_grads(
            [weight, bias], lambda: [_flat(grad).t().matmul(_flat(x)), _flat(grad).sum(0)])
        return grad_x, grad_w, grad_b


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float):
        out, mean, rstd = torch.native_layer_norm(x, weight.shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        backward = torch.ops.aten.native_layer_norm_backward
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = backward(grad, x, weight.shape, mean, rstd, weight, bias,
                              [True, False, False])[0]
        grad_w, grad_b = _weight_grads([weight, bias], lambda: list(backward(
            grad, x, weight.shape, mean, rstd, weight, bias, [False, True, True])[1:]))
        return grad_x, grad_w, grad_b, None


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters and state dict) with a deferrable weight gradient."""

    def forward(self, x):
        return _LayerNorm.apply(x, self.weight, self.bias, self.eps)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.num_weights = weight.shape[0]
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        weight, n = ctx.weight, ctx.num_weights
        (grad_w,) = _weight_grads([weight], lambda: [torch.ops.aten.embedding_dense_backward(
            grad, ids, n, -1, False)])
        return None, grad_w


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding whose weight gradient may be deferred to the W pass."""
    return _Embedding.apply(ids, weight)
