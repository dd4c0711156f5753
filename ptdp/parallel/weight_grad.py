"""The backward pass split in two, for zero-bubble pipeline schedules (Qi et al. 2023).

A layer's backward computes two things: the gradient of its input, which the previous stage
waits for (the pass called B), and the gradients of its weights, which nothing waits for until
the optimizer step (W). ZB-H1 (ptdp/pipeline/schedules.py) runs B as soon as it can and moves
W into what would otherwise be the pipeline's bubbles.

Every layer that owns weights computes its weighted products (linear, LayerNorm, embedding
lookup, an RMSNorm's gain) through its `weight_ops`: `PLAIN`, torch's own functions, unless
`defer_weight_grads(chunk)` binds the chunk's layers to a `WeightGradQueue`, the chunk's own
(kept as `chunk.weight_grads`). The queue's ops are autograd Functions in eager code and custom
operators inside a compiled layer (one implementation of each backward, below); their backward
returns the input gradient and, while a B pass of the queue is open (`queue.defer(mb)`), hands
the weight gradient over as a closure instead of computing it. `queue.run(mb)` (the W pass)
evaluates the closures of that micro-batch, sums them per weight and accumulates them through
autograd (`torch.autograd.backward` on the weights), so the hooks that follow an accumulation
fire as after a plain backward: fp32 gradient accumulation and the data-parallel buckets,
which therefore launch after the last W of the iteration. Outside a B pass the same ops
compute both gradients at once. The pipeline executor (ptdp/pipeline/executor.py) gives a chunk
an unbound queue (`weight_grads_of`) and binds its layers only for the forwards and backwards
of the micro-batches it splits (`queue.bound()`: zb-h1's every one, 1F1B's drain's), opens the
B pass and runs the W pass on it; a new chunk has a new queue, so nothing deferred outlives
the model it belongs to.

The gradients come from the kernels autograd itself uses (the GEMMs, aten's LayerNorm and
embedding backward), so a split backward equals a plain one to round-off. The elementwise
bias-add chains and the position-embedding slice keep their (cheap) weight gradients in B.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


def gain(weight: torch.Tensor, offset: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A norm's gain: the weight, or offset + weight for a zero-centred norm (offset 1, whose
    weight's gradient is the gain's), in `dtype` when given."""
    weight = weight if dtype is None else weight.to(dtype)
    return weight + offset if offset else weight


def _layer_norm(x, shape, weight, bias, eps: float, offset: float = 0.0):
    return F.layer_norm(x, shape, gain(weight, offset), bias, eps)


def _scale(x, weight, offset: float = 0.0):
    return x * gain(weight, offset, x.dtype) if offset else x * weight


class WeightOps:
    """The weighted products a layer computes, its weight gradients in the backward itself.

    A layer that owns weights declares `weight_ops = PLAIN` and calls `self.weight_ops.linear`
    (and so on); `defer_weight_grads` rebinds it to a queue with the same four ops. A norm's
    ops take the gain's `offset` (1 for a zero-centred norm), so that the weight they are given
    is the parameter itself, whose storage the queue knows."""

    linear = staticmethod(F.linear)
    embedding = staticmethod(F.embedding)
    layer_norm = staticmethod(_layer_norm)
    scale = staticmethod(_scale)   # x * (offset + weight) broadcast over the last dimension


PLAIN = WeightOps()


class WeightGradQueue(WeightOps):
    """One chunk's deferred weight gradients by micro-batch, and the ops that defer them."""

    def __init__(self):
        self.chunk: Callable[[], nn.Module | None] = lambda: None   # defer_weight_grads binds it
        self._open: list | None = None
        self._pending: dict = {}
        self._triggers: dict = {}
        self._layers, self._always = [], True   # (defer_weight_grads): bound for good or not

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

    @contextlib.contextmanager
    def bound(self):
        """Run a forward (or a backward that recomputes one) whose backward may be split: the
        chunk's layers use this queue's ops inside, torch's own again after (a queue made
        with `bind=False`; a bound one always uses its ops)."""
        if self._always:
            yield
            return
        for module in self._layers:
            module.weight_ops = self
        try:
            yield
        finally:   # the class's PLAIN again, not a copy in the instance: a compiled layer's
            for module in self._layers:   # guards then see the module as before (one graph)
                module.__dict__.pop("weight_ops", None)

    def run(self, mb) -> None:
        """The W pass of `mb`: compute its weight gradients and accumulate them."""
        if mb not in self._pending:
            raise RuntimeError(f"W pass of {mb} without its B pass")
        _accumulate(self._pending.pop(mb))

    def pending(self) -> list:
        """The micro-batches whose B pass ran and whose W pass did not."""
        return sorted(self._pending, key=str)

    def collect(self, params: list, compute: Callable[[], list]) -> None:
        """Called from a backward: defer `compute` (inside a B pass), or accumulate it now."""
        if self._open is not None:
            self._open.append((params, compute))
        else:
            _accumulate([(params, compute)])

    # The weights enter the ops detached, so autograd holds no edge to them: a B pass neither
    # accumulates into them nor fires their accumulation hooks (it would, with a None
    # gradient, if they were inputs). Their gradients reach them only through `_accumulate`.
    # An empty tensor that requires grad goes in as well, so that autograd calls the backward
    # even when no other input needs a gradient (an embedding lookup of integer ids).
    #
    # Linear, LayerNorm and the RMSNorm gain are custom operators (torch.library) whose
    # backward is another, opaque operator: torch.compile traces each as one op, so a compiled
    # layer stays one graph, and the backward operator, run with real tensors, finds its
    # parameters and queue by the weights' storage (`_owner`) and hands the weight gradient
    # over. The embedding lies outside the compiled layers and stays an autograd Function.

    def _trigger(self, device) -> torch.Tensor:
        if device not in self._triggers:
            self._triggers[device] = torch.empty(0, device=device, requires_grad=True)
        return self._triggers[device]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        args = (x, weight.detach(), None if bias is None else bias.detach(),
                self._trigger(x.device))
        if torch.compiler.is_compiling():
            return torch.ops.ptdp.deferred_linear(*args)
        _own(self, weight, bias)
        return _EagerLinear.apply(*args)

    @torch.compiler.disable
    def embedding(self, ids: torch.Tensor, weight: torch.Tensor):
        return _Embedding.apply(ids, weight.detach(), (weight,), self, self._trigger(ids.device))

    def layer_norm(self, x: torch.Tensor, shape, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float, offset: float = 0.0):
        assert tuple(shape) == tuple(weight.shape), "the normalised shape is the weight's"
        args = (x, weight.detach(), bias.detach(), eps, float(offset), self._trigger(x.device))
        if torch.compiler.is_compiling():
            return torch.ops.ptdp.deferred_layer_norm(*args)[0]
        _own(self, weight, bias)
        return _EagerLayerNorm.apply(*args)

    def scale(self, x: torch.Tensor, weight: torch.Tensor, offset: float = 0.0):
        args = (x, weight.detach(), float(offset), self._trigger(x.device))
        if torch.compiler.is_compiling():
            return torch.ops.ptdp.deferred_scale(*args)
        _own(self, weight)
        return _EagerScale.apply(*args)


def defer_weight_grads(chunk: nn.Module, bind: bool = True) -> WeightGradQueue:
    """Give `chunk` a new queue, kept as `chunk.weight_grads`, and bind every layer of it that
    owns weights (has `weight_ops`) to the queue: the chunk's B passes then leave their weight
    gradients to its W. With `bind=False` the layers keep torch's own ops except inside
    `queue.bound()`: only the micro-batches run there can split their backward (1F1B splits
    only its cooldown's, ptdp/pipeline/flushing.py), and the others pay nothing for it."""
    queue = WeightGradQueue()
    queue.chunk = weakref.ref(chunk)   # where `_owner` finds a compiled layer's weights
    _QUEUES.add(queue)
    for device in {p.device for p in chunk.parameters()}:   # (not inside a compiled layer)
        queue._trigger(device)
    queue._layers = [module for module in chunk.modules() if hasattr(module, "weight_ops")]
    queue._always = bind
    if bind:
        for module in queue._layers:
            module.weight_ops = queue
    chunk.weight_grads = queue
    return queue


def weight_grads_of(chunk: nn.Module) -> WeightGradQueue:
    """`chunk`'s queue, for the executor's split forwards, B and W passes: the one
    `defer_weight_grads` gave it, or on first use an unbound one (its layers on the queue's
    ops only inside `queue.bound()`)."""
    queue = getattr(chunk, "weight_grads", None)
    return queue if queue is not None else defer_weight_grads(chunk, bind=False)


def pending_weight_grads(chunks: dict) -> list:
    """(micro-batch, stage) of every B pass whose W pass has not run, over {stage: chunk}."""
    queues = {stage: getattr(chunk, "weight_grads", None) for stage, chunk in chunks.items()}
    return [(mb, stage) for stage, queue in sorted(queues.items()) if queue is not None
            for mb in queue.pending()]


def _accumulate(pending: list[tuple[list, Callable[[], list]]]) -> None:
    """Compute the closures in order and accumulate each weight's gradient through autograd
    once its last contribution is in (a tied table is used twice: summed first), so every
    weight sees one accumulation (and one hook call) per pass, and the pass holds the
    gradients of one closure and of the weights still waiting for another, not all of them."""
    left = collections.Counter(id(p) for params, _ in pending for p in params if p is not None)
    totals: dict[int, torch.Tensor] = {}
    for params, compute in pending:
        ready = []
        for param, grad in zip(params, compute()):
            if param is None:
                continue
            key = id(param)
            if grad is not None:
                totals[key] = grad if key not in totals else totals[key] + grad
            left[key] -= 1
            if not left[key] and key in totals:
                ready.append((param, totals.pop(key)))
        if ready:
            torch.autograd.backward(*map(list, zip(*ready)))


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


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


# The custom operators ------------------------------------------------------------------------
_QUEUES: "weakref.WeakSet[WeightGradQueue]" = weakref.WeakSet()
_OWNERS: dict = {}   # (data_ptr, shape) of a weight -> weak references to it and its queue


def _own(queue: WeightGradQueue, *weights) -> None:
    """Note whose `weights` are (eager forwards: a compiled layer's are found by `_owner`).
    An entry goes when its weight dies (`_forget`), so the table holds live weights only
    however many chunks are built and dropped; a known entry is left as it is (every forward
    after the first: no new references)."""
    for weight in weights:
        if weight is None:
            continue
        key = (weight.data_ptr(), weight.shape)
        entry = _OWNERS.get(key)
        if entry is not None and entry[0]() is weight and entry[1]() is queue:
            continue
        forget = functools.partial(_forget, _OWNERS, key)   # (no global lookup at exit)
        _OWNERS[key] = (weakref.ref(weight, forget), weakref.ref(queue))


def _forget(table: dict, key: tuple, ref: weakref.ref) -> None:
    """A weight died: drop its entry, unless another weight has taken its key since."""
    entry = table.get(key)
    if entry is not None and entry[0] is ref:
        del table[key]


def _owner(weight: torch.Tensor) -> tuple:
    """(parameter, queue) whose storage `weight` (a detached alias) is, looked up at backward
    time with real tensors; the live queues' chunks are searched when it is not known (a
    compiled layer's weights, or parameters moved into flat buffers since)."""
    key = (weight.data_ptr(), weight.shape)
    for attempt in range(2):
        entry = _OWNERS.get(key)
        param, queue = (entry[0](), entry[1]()) if entry else (None, None)
        if param is not None and queue is not None and param.data_ptr() == key[0]:
            return param, queue
        if attempt == 0:
            for queue in list(_QUEUES):
                chunk = queue.chunk()
                _own(queue, *(chunk.parameters() if chunk is not None else ()))
    raise RuntimeError(f"a deferred weight gradient for a {tuple(weight.shape)} weight that no "
                       "queue owns (bind its chunk with defer_weight_grads)")


def _hand_over(weights: list, compute: Callable[..., list], tensors: list, copy: bool) -> None:
    """Give the gradient of `weights` (detached aliases, None allowed), `compute(*tensors)`,
    to their queue: deferred inside a B pass, computed now outside one. A compiled backward
    (`copy`) may write into its buffers after this op returns (inductor reuses them), so a
    deferred computation there keeps copies of its tensors."""
    owners = [None if w is None else _owner(w) for w in weights]
    queue = next(owner[1] for owner in owners if owner is not None)
    if copy and queue._open is not None:
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
    return _scale(x, weight, offset)


@_deferred_scale.register_fake
def _(x, weight, offset, trigger):
    return x.new_empty(x.shape)


def _scale_input_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      offset: float, copy: bool) -> torch.Tensor:
    _hand_over([weight], lambda grad, x: [(_flat(grad) * _flat(x)).sum(0).to(weight.dtype)],
               [grad, x], copy)
    return _scale(grad, weight, offset)   # the input's gradient: grad times the gain


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

class _EagerLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, trigger):
        ctx.save_for_backward(x, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        return _linear_input_grad(grad, *ctx.saved_tensors, False), None, None, None


class _EagerLayerNorm(torch.autograd.Function):
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


class _EagerScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offset, trigger):
        ctx.offset = offset
        ctx.save_for_backward(x, weight)
        return _scale(x, weight, offset)

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
