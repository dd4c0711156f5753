"""The weight-gradient queue's ops (ptdp/parallel/weight_grad.py): a linear, LayerNorm, an
RMSNorm's gain and an embedding lookup whose backward returns the input gradient and hands the
weight gradient to the weight's queue, which keeps it for the W pass inside a B pass and
accumulates it at once outside one.

The weights enter the ops detached, so autograd holds no edge to them: a B pass neither
accumulates into them nor fires their accumulation hooks (it would, with a None gradient, if
they were inputs). Their gradients reach them only through the queue. An empty tensor that
requires grad goes in as well, so that autograd calls the backward even when no other input
needs a gradient (an embedding lookup of integer ids).

Linear, LayerNorm and the RMSNorm gain are custom operators (torch.library) whose backward is
another, opaque operator: torch.compile traces each as one op, so a compiled layer stays one
graph, and the backward operator, run with real tensors, finds its parameters and queue by the
weights' storage (`owner`) and hands the weight gradient over. Eager forwards use autograd
Functions with the same forward and backward bodies (`EagerLinear`, ...). The embedding lies
outside the compiled layers and stays an autograd Function.

The gradients come from the kernels autograd itself uses (the GEMMs, aten's LayerNorm and
embedding backward), so a split backward equals a plain one to round-off.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch
import torch.nn.functional as F


def gain(weight: torch.Tensor, offset: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A norm's gain: the weight, or offset + weight for a zero-centred norm (offset 1, whose
    weight's gradient is the gain's), in `dtype` when given."""
    weight = weight if dtype is None else weight.to(dtype)
    return weight + offset if offset else weight


def layer_norm(x, shape, weight, bias, eps: float, offset: float = 0.0):
    return F.layer_norm(x, shape, gain(weight, offset), bias, eps)


def scale(x, weight, offset: float = 0.0):
    return x * gain(weight, offset, x.dtype) if offset else x * weight



def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class DeferredEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, params, queue, trigger):
        ctx.save_for_backward(ids)
        ctx.num_weights, ctx.params, ctx.queue = weight.shape[0], params, queue
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        n = ctx.num_weights
        ctx.queue.collect(list(ctx.params), lambda: [torch.ops.aten.embedding_dense_backward(
            grad, ids, n, -1, False)])
        return None, None, None, None, None


# The custom operators ------------------------------------------------------------------------
QUEUES: weakref.WeakSet = weakref.WeakSet()   # the live WeightGradQueues (defer_weight_grads)
OWNERS: dict = {}   # (data_ptr, shape) of a weight -> weak references to it and its queue


def own(queue, *weights) -> None:
    """Note whose `weights` are (eager forwards: a compiled layer's are found by `owner`).
    An entry goes when its weight dies (`_forget`), so the table holds live weights only
    however many chunks are built and dropped; a known entry is left as it is (every forward
    after the first: no new references)."""
    for weight in weights:
        if weight is None:
            continue
        key = (weight.data_ptr(), weight.shape)
        entry = OWNERS.get(key)
        if entry is not None and entry[0]() is weight and entry[1]() is queue:
            continue
        forget = functools.partial(_forget, OWNERS, key)   # (no global lookup at exit)
        OWNERS[key] = (weakref.ref(weight, forget), weakref.ref(queue))


def _forget(table: dict, key: tuple, ref: weakref.ref) -> None:
    """A weight died: drop its entry, unless another weight has taken its key since."""
    entry = table.get(key)
    if entry is not None and entry[0] is ref:
        del table[key]


def owner(weight: torch.Tensor) -> tuple:
    """(parameter, queue) whose storage `weight` (a detached alias) is, looked up at backward
    time with real tensors; the live queues' chunks are searched when it is not known (a
    compiled layer's weights, or parameters moved into flat buffers since)."""
    key = (weight.data_ptr(), weight.shape)
    for attempt in range(2):
        entry = OWNERS.get(key)
        param, queue = (entry[0](), entry[1]()) if entry else (None, None)
        if param is not None and queue is not None and param.data_ptr() == key[0]:
            return param, queue
        if attempt == 0:
            for queue in list(QUEUES):
                chunk = queue.chunk()
                own(queue, *(chunk.parameters() if chunk is not None else ()))
    raise RuntimeError(f"a deferred weight gradient for a {tuple(weight.shape)} weight that no "
                       "queue owns (bind its chunk with defer_weight_grads)")


def _hand_over(weights: list, compute: Callable[..., list], tensors: list, copy: bool) -> None:
    """Give the gradient of `weights` (detached aliases, None allowed), `compute(*tensors)`,
    to their queue: deferred inside a B pass, computed now outside one. A compiled backward
    (`copy`) may write into its buffers after this op returns (inductor reuses them), so a
    deferred computation there keeps copies of its tensors."""
    owners = [None if w is None else owner(w) for w in weights]
    queue = next(owner[1] for owner in owners if owner is not None)
    if copy and queue.deferring:
        tensors = [t.clone() for t in tensors]
    queue.collect([None if owner is None else owner[0] for owner in owners],
                  lambda: compute(*tensors))


def _traced(grad: torch.Tensor) -> bool:
    """True while AOTAutograd traces a backward formula (its tensors are subclasses)."""
    return type(grad) is not torch.Tensor


@torch.library.custom_op("ptdp::deferred_linear", mutates_args=())
def _deferred_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     trigger: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight, bias)


@_deferred_linear.register_fake
def _(x, weight, bias, trigger):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _linear_input_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, copy: bool) -> torch.Tensor:
    def compute(grad, x):
        g = _flat(grad)
        return [g.t().matmul(_flat(x)), g.sum(0) if bias is not None else None]
    _hand_over([weight, bias], compute, [grad, x], copy)
    return grad.matmul(weight)


_deferred_linear_backward = torch.library.custom_op(
    "ptdp::deferred_linear_backward", _linear_input_grad, mutates_args=())


@_deferred_linear_backward.register_fake
def _(grad, x, weight, bias, copy):
    return x.new_empty(x.shape)


def _linear_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight, bias)


def _linear_backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    grad_x = torch.ops.ptdp.deferred_linear_backward(grad, x, weight, bias, _traced(grad))
    return grad_x, None, None, None


_deferred_linear.register_autograd(_linear_backward, setup_context=_linear_context)


@torch.library.custom_op("ptdp::deferred_layer_norm", mutates_args=())
def _deferred_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                         offset: float, trigger: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, mean, rstd = torch.native_layer_norm(x, weight.shape, gain(weight, offset), bias, eps)
    return out, mean, rstd


@_deferred_layer_norm.register_fake
def _(x, weight, bias, eps, offset, trigger):
    stats = x.new_empty(*x.shape[:x.dim() - weight.dim()], *([1] * weight.dim()))
    return x.new_empty(x.shape), stats, stats.new_empty(stats.shape)


def _layer_norm_input_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                           offset: float, copy: bool) -> torch.Tensor:
    backward = torch.ops.aten.native_layer_norm_backward
    g = gain(weight, offset)   # the gain's gradient is the weight's
    _hand_over([weight, bias], lambda *t: list(backward(
        *t[:2], weight.shape, *t[2:], g, bias, [False, True, True])[1:]),
        [grad, x, mean, rstd], copy)
    return backward(grad, x, weight.shape, mean, rstd, g, bias, [True, False, False])[0]


_deferred_layer_norm_backward = torch.library.custom_op(
    "ptdp::deferred_layer_norm_backward", _layer_norm_input_grad, mutates_args=())


@_deferred_layer_norm_backward.register_fake
def _(grad, x, weight, bias, mean, rstd, offset, copy):
    return x.new_empty(x.shape)


def _layer_norm_context(ctx, inputs, output):
    x, weight, bias, _, offset, _ = inputs
    ctx.offset = offset
    ctx.save_for_backward(x, weight, bias, output[1], output[2])


def _layer_norm_backward(ctx, grad, _mean_grad, _rstd_grad):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    grad_x = torch.ops.ptdp.deferred_layer_norm_backward(grad, x, weight, bias, mean, rstd,
                                                         ctx.offset, _traced(grad))
    return grad_x, None, None, None, None, None


_deferred_layer_norm.register_autograd(_layer_norm_backward, setup_context=_layer_norm_context)


@torch.library.custom_op("ptdp::deferred_scale", mutates_args=())
def _deferred_scale(x: torch.Tensor, weight: torch.Tensor, offset: float,
                    trigger: torch.Tensor) -> torch.Tensor:
    """x * (offset + weight) broadcast over the last dimension (an RMSNorm's gain)."""
    return scale(x, weight, offset)


@_deferred_scale.register_fake
def _(x, weight, offset, trigger):
    return x.new_empty(x.shape)


def _scale_input_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      offset: float, copy: bool) -> torch.Tensor:
    _hand_over([weight], lambda grad, x: [(_flat(grad) * _flat(x)).sum(0).to(weight.dtype)],
               [grad, x], copy)
    return scale(grad, weight, offset)   # the input's gradient: grad times the gain


_deferred_scale_backward = torch.library.custom_op(
    "ptdp::deferred_scale_backward", _scale_input_grad, mutates_args=())


@_deferred_scale_backward.register_fake
def _(grad, x, weight, offset, copy):
    return x.new_empty(x.shape)


def _scale_context(ctx, inputs, output):
    x, weight, offset, _ = inputs
    ctx.offset = offset
    ctx.save_for_backward(x, weight)


def _scale_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x = torch.ops.ptdp.deferred_scale_backward(grad, x, weight, ctx.offset, _traced(grad))
    return grad_x, None, None, None


_deferred_scale.register_autograd(_scale_backward, setup_context=_scale_context)

# Eager forwards take the same ops as autograd Functions: the same forward, the same backward
# bodies called directly (copy=False: nothing reuses an eager tensor's buffer), without the
# custom operators' dispatch, which cost a zb-h1 chunk 6 % of its forward and backward on CPU
# (docs/performance.md, "Host overhead on CPU").

class EagerLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, trigger):
        ctx.save_for_backward(x, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        return _linear_input_grad(grad, *ctx.saved_tensors, False), None, None, None


class EagerLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, offset, trigger):
        out, mean, rstd = torch.native_layer_norm(x, weight.shape, gain(weight, offset), bias, eps)
        ctx.offset = offset
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_x = _layer_norm_input_grad(grad, *ctx.saved_tensors, ctx.offset, False)
        return grad_x, None, None, None, None, None


class EagerScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offset, trigger):
        ctx.offset = offset
        ctx.save_for_backward(x, weight)
        return scale(x, weight, offset)

    @staticmethod
    def backward(ctx, grad):
        return _scale_input_grad(grad, *ctx.saved_tensors, ctx.offset, False), None, None, None


# The backward operators act through their queue: never dropped as unused nor reordered.
# torch's AOTAutograd cache keys a compiled layer on its forward graph, not on these
# operators' Python: a changed backward operator needs a new name (or a cleared cache).
for _op in (torch.ops.ptdp.deferred_linear_backward.default,
            torch.ops.ptdp.deferred_layer_norm_backward.default,
            torch.ops.ptdp.deferred_scale_backward.default):
    torch.fx.node.has_side_effect(_op)
