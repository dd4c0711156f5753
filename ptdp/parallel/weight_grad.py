"""The backward pass split in two, for zero-bubble pipeline schedules (Qi et al. 2023).

A layer's backward computes two things: the gradient of its input, which the previous stage
waits for (the pass called B), and the gradients of its weights, which nothing waits for until
the optimizer step (W). ZB-H1 (ptdp/pipeline/schedules.py) runs B as soon as it can and moves
W into what would otherwise be the pipeline's bubbles.

The weighted operations below (linear, LayerNorm, embedding lookup, an RMSNorm's gain) are
autograd Functions whose backward returns the input gradient and, while a B pass is open
(`STORE.defer(key)`), hands the weight gradient over as a closure instead of computing it.
`STORE.run(key)` (the W pass) evaluates the closures of that micro-batch and stage, sums them
per weight and accumulates them through autograd (`torch.autograd.backward` on the weights),
so the hooks that
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
        _accumulate([(params, compute()) for params, compute in self._pending.pop(key)])

    def pending(self) -> list:
        return sorted(self._pending, key=str)

    def clear(self) -> None:
        self._open, self._pending = None, {}


STORE = WeightGradStore()


def _accumulate(results: list[tuple[list, list]]) -> None:
    """Sum the gradients per weight (a tied table is used twice), then accumulate each once
    through autograd, so every weight sees one accumulation (and one hook call) per pass."""
    totals: dict[int, list] = {}
    for params, grads in results:
        for param, grad in zip(params, grads):
            if param is None or grad is None:
                continue
            entry = totals.setdefault(id(param), [param, None])
            entry[1] = grad if entry[1] is None else entry[1] + grad
    if totals:
        params, grads = zip(*totals.values())
        torch.autograd.backward(list(params), list(grads))


def _weight_grads(params: list, compute: Callable[[], list]) -> None:
    """Defer `compute` (inside a B pass), or compute and accumulate now."""
    if STORE.deferring:
        STORE.add(params, compute)
    else:
        _accumulate([(params, compute())])


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


# The weights enter these Functions detached (the parameters themselves ride along in a tuple,
# which autograd does not treat as an input), so autograd holds no edge to them: a B pass
# neither accumulates into them nor fires their accumulation hooks (it would, with a None
# gradient, if they were inputs). Their gradients reach them only through `_accumulate`.
# An empty tensor that requires grad goes in as well, so that autograd calls the backward
# even when no other input needs a gradient (an embedding lookup of integer ids).
_TRIGGERS: dict = {}


def _trigger(device) -> torch.Tensor:
    if device not in _TRIGGERS:
        _TRIGGERS[device] = torch.empty(0, device=device, requires_grad=True)
    return _TRIGGERS[device]

class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, params, trigger):
        ctx.save_for_backward(x, weight)
        ctx.params, ctx.has_bias = params, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None

        def compute():
            g = _flat(grad)
            return [g.t().matmul(_flat(x)), g.sum(0) if ctx.has_bias else None]

        _weight_grads(list(ctx.params), compute)
        return grad_x, None, None, None, None


# Eager (a graph break in a compiled layer): a compiled backward would fix the B-or-not branch
# at trace time.
@torch.compiler.disable
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose weight (and bias) gradients may be deferred to the W pass."""
    return _Linear.apply(x, weight.detach(), None if bias is None else bias.detach(), (weight, bias),
                         _trigger(x.device))


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, params, trigger):
        out, mean, rstd = torch.native_layer_norm(x, weight.shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.params = params
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        backward = torch.ops.aten.native_layer_norm_backward
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = backward(grad, x, weight.shape, mean, rstd, weight, bias,
                              [True, False, False])[0]
        _weight_grads(list(ctx.params), lambda: list(backward(
            grad, x, weight.shape, mean, rstd, weight, bias, [False, True, True])[1:]))
        return grad_x, None, None, None, None, None


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters and state dict) with a deferrable weight gradient."""

    @torch.compiler.disable
    def forward(self, x):
        return _LayerNorm.apply(x, self.weight.detach(), self.bias.detach(), self.eps,
                                (self.weight, self.bias), _trigger(x.device))


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, params, trigger):
        ctx.save_for_backward(ids)
        ctx.num_weights, ctx.params = weight.shape[0], params
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        n = ctx.num_weights
        _weight_grads(list(ctx.params), lambda: [torch.ops.aten.embedding_dense_backward(
            grad, ids, n, -1, False)])
        return None, None, None, None


@torch.compiler.disable
def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding whose weight gradient may be deferred to the W pass."""
    return _Embedding.apply(ids, weight.detach(), (weight,), _trigger(ids.device))


class _Scale(torch.autograd.Function):
    """x * weight broadcast over the last dimension (an RMSNorm's gain)."""

    @staticmethod
    def forward(ctx, x, weight, params, trigger):
        ctx.save_for_backward(x, weight)
        ctx.params = params
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad * weight if ctx.needs_input_grad[0] else None
        _weight_grads(list(ctx.params), lambda: [(_flat(grad) * _flat(x)).sum(0)])
        return grad_x, None, None, None


@torch.compiler.disable
def scale(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x * weight whose weight gradient may be deferred to the W pass."""
    return _Scale.apply(x, weight.detach(), (weight,), _trigger(x.device))
