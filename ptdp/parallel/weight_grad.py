"""The backward pass split in two, for zero-bubble pipeline schedules (Qi et al. 2023).

A layer's backward computes two things: the gradient of its input, which the previous stage
waits for (the pass called B), and the gradients of its weights, which nothing waits for until
the optimizer step (W). ZB-H1 (ptdp/pipeline/schedules.py) runs B as soon as it can and moves
W into what would otherwise be the pipeline's bubbles.

Every layer that owns weights computes its weighted products (linear, LayerNorm, embedding
lookup, an RMSNorm's gain) through its `weight_ops`: `PLAIN`, torch's own functions, unless
`defer_weight_grads(chunk)` binds the chunk's layers to a `WeightGradQueue`, the chunk's own
(kept as `chunk.weight_grads`). The queue's ops are autograd Functions whose backward returns
the input gradient and, while a B pass of the queue is open (`queue.defer(mb)`), hands the
weight gradient over as a closure instead of computing it. `queue.run(mb)` (the W pass)
evaluates the closures of that micro-batch, sums them per weight and accumulates them through
autograd (`torch.autograd.backward` on the weights), so the hooks that follow an accumulation
fire as after a plain backward: fp32 gradient accumulation and the data-parallel buckets,
which therefore launch after the last W of the iteration. Outside a B pass the same Functions
compute both gradients at once. The pipeline executor (ptdp/pipeline/executor.py) opens the B
pass and runs the W pass on the queue of the stage it executes; a new chunk has a new queue,
so nothing deferred outlives the model it belongs to.

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


class WeightOps:
    """The weighted products a layer computes, its weight gradients in the backward itself.

    A layer that owns weights declares `weight_ops = PLAIN` and calls `self.weight_ops.linear`
    (and so on); `defer_weight_grads` rebinds it to a queue with the same four ops."""

    linear = staticmethod(F.linear)
    embedding = staticmethod(F.embedding)
    layer_norm = staticmethod(F.layer_norm)
    scale = staticmethod(torch.mul)   # x * weight broadcast over the last dimension


PLAIN = WeightOps()


class WeightGradQueue(WeightOps):
    """One chunk's deferred weight gradients by micro-batch, and the ops that defer them."""

    def __init__(self):
        self._open: list | None = None
        self._pending: dict = {}
        self._triggers: dict = {}

    @contextlib.contextmanager
    def defer(self, mb):
        """Run a B pass: weight gradients produced inside are kept for `run(mb)`."""
        if self._open is not None:
            raise RuntimeError(f"a B pass is already open while starting {mb}")
        self._open = []
        try:
            yield
        finally:
            self._pending.setdefault(mb, []).extend(self._open)
            self._open = None

    def run(self, mb) -> None:
        """The W pass of `mb`: compute its weight gradients and accumulate them."""
        if mb not in self._pending:
            raise RuntimeError(f"W pass of {mb} without its B pass")
        _accumulate([(params, compute()) for params, compute in self._pending.pop(mb)])

    def pending(self) -> list:
        """The micro-batches whose B pass ran and whose W pass did not."""
        return sorted(self._pending, key=str)

    def collect(self, params: list, compute: Callable[[], list]) -> None:
        """Called from a backward: defer `compute` (inside a B pass), or accumulate it now."""
        if self._open is not None:
            self._open.append((params, compute))
        else:
            _accumulate([(params, compute())])

    # The weights enter the Functions detached (the parameters themselves ride along in a
    # tuple, which autograd does not treat as an input), so autograd holds no edge to them: a
    # B pass neither accumulates into them nor fires their accumulation hooks (it would, with
    # a None gradient, if they were inputs). Their gradients reach them only through
    # `_accumulate`. An empty tensor that requires grad goes in as well, so that autograd calls
    # the backward even when no other input needs a gradient (an embedding lookup of integer
    # ids). The ops run eagerly (a graph break in a compiled layer): a compiled backward would
    # fix the B-or-not branch at trace time.

    def _trigger(self, device) -> torch.Tensor:
        if device not in self._triggers:
            self._triggers[device] = torch.empty(0, device=device, requires_grad=True)
        return self._triggers[device]

    @torch.compiler.disable
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        return _Linear.apply(x, weight.detach(), None if bias is None else bias.detach(),
                             (weight, bias), self, self._trigger(x.device))

    @torch.compiler.disable
    def embedding(self, ids: torch.Tensor, weight: torch.Tensor):
        return _Embedding.apply(ids, weight.detach(), (weight,), self, self._trigger(ids.device))

    @torch.compiler.disable
    def layer_norm(self, x: torch.Tensor, shape, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float):
        assert tuple(shape) == tuple(weight.shape), "the normalised shape is the weight's"
        return _LayerNorm.apply(x, weight.detach(), bias.detach(), eps, (weight, bias), self,
                                self._trigger(x.device))

    @torch.compiler.disable
    def scale(self, x: torch.Tensor, weight: torch.Tensor):
        return _Scale.apply(x, weight.detach(), (weight,), self, self._trigger(x.device))


def defer_weight_grads(chunk: nn.Module) -> WeightGradQueue:
    """Bind every layer of `chunk` that owns weights (has `weight_ops`) to a new queue, kept as
    `chunk.weight_grads`: the chunk's B passes then leave their weight gradients to its W."""
    queue = WeightGradQueue()
    for module in chunk.modules():
        if hasattr(module, "weight_ops"):
            module.weight_ops = queue
    chunk.weight_grads = queue
    return queue


def weight_grads_of(chunk: nn.Module) -> WeightGradQueue:
    """The queue `defer_weight_grads` gave `chunk`, for the executor's B and W passes."""
    queue = getattr(chunk, "weight_grads", None)
    if queue is None:
        raise RuntimeError("the steps split the backward (Wg actions), but this chunk defers no "
                           "weight gradients: build it with defer_weight_grads")
    return queue


def pending_weight_grads(chunks: dict) -> list:
    """(micro-batch, stage) of every B pass whose W pass has not run, over {stage: chunk}."""
    queues = {stage: getattr(chunk, "weight_grads", None) for stage, chunk in chunks.items()}
    return [(mb, stage) for stage, queue in sorted(queues.items()) if queue is not None
            for mb in queue.pending()]


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


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, params, queue, trigger):
        ctx.save_for_backward(x, weight)
        ctx.params, ctx.queue, ctx.has_bias = params, queue, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None

        def compute():
            g = _flat(grad)
            return [g.t().matmul(_flat(x)), g.sum(0) if ctx.has_bias else None]

        ctx.queue.collect(list(ctx.params), compute)
        return grad_x, None, None, None, None, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, params, queue, trigger):
        out, mean, rstd = torch.native_layer_norm(x, weight.shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.params, ctx.queue = params, queue
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        backward = torch.ops.aten.native_layer_norm_backward
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = backward(grad, x, weight.shape, mean, rstd, weight, bias,
                              [True, False, False])[0]
        ctx.queue.collect(list(ctx.params), lambda: list(backward(
            grad, x, weight.shape, mean, rstd, weight, bias, [False, True, True])[1:]))
        return grad_x, None, None, None, None, None, None


class _Embedding(torch.autograd.Function):
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


class _Scale(torch.autograd.Function):
    """x * weight broadcast over the last dimension (an RMSNorm's gain)."""

    @staticmethod
    def forward(ctx, x, weight, params, queue, trigger):
        ctx.save_for_backward(x, weight)
        ctx.params, ctx.queue = params, queue
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad * weight if ctx.needs_input_grad[0] else None
        ctx.queue.collect(list(ctx.params), lambda: [(_flat(grad) * _flat(x)).sum(0)])
        return grad_x, None, None, None, None
