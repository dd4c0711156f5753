"""The backward pass split in two, for zero-bubble pipeline schedules (Qi et al. 2023).

A layer's backward computes two things: the gradient of its input, which the previous stage
waits for (the pass called B), and the gradients of its weights, which nothing waits for until
the optimizer step (W). ZB-H1 (ptdp/pipeline/schedules.py) runs B as soon as it can and moves
W into what would otherwise be the pipeline's bubbles.

Every layer that owns weights computes its weighted products (linear, LayerNorm, embedding
lookup, an RMSNorm's gain) through its `weight_ops`: `PLAIN`, torch's own functions, unless
`defer_weight_grads(chunk)` binds the chunk's layers to a `WeightGradQueue`, the chunk's own
(kept as `chunk.weight_grads`). The queue's ops (ptdp/parallel/deferred_ops.py) are autograd
Functions in eager code and custom operators inside a compiled layer; their backward returns
the input gradient and, while a B pass of the queue is open (`queue.defer(mb)`), hands
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
import weakref
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ptdp.parallel.deferred_ops import (QUEUES, DeferredEmbedding, EagerLayerNorm, EagerLinear,
                                        EagerScale, layer_norm, own, scale)


class WeightOps:
    """The weighted products a layer computes, its weight gradients in the backward itself.

    A layer that owns weights declares `weight_ops = PLAIN` and calls `self.weight_ops.linear`
    (and so on); `defer_weight_grads` rebinds it to a queue with the same four ops. A norm's
    ops take the gain's `offset` (1 for a zero-centred norm), so that the weight they are given
    is the parameter itself, whose storage the queue knows."""

    linear = staticmethod(F.linear)
    embedding = staticmethod(F.embedding)
    layer_norm = staticmethod(layer_norm)
    scale = staticmethod(scale)   # x * (offset + weight) broadcast over the last dimension


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
        if self.deferring:
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

    @property
    def deferring(self) -> bool:
        """Whether a B pass is open: weight gradients handed over now wait for its W."""
        return self._open is not None

    def collect(self, params: list, compute: Callable[[], list]) -> None:
        """Called from a backward: defer `compute` (inside a B pass), or accumulate it now."""
        if self._open is not None:
            self._open.append((params, compute))
        else:
            _accumulate([(params, compute)])

    # The ops (ptdp/parallel/deferred_ops.py) take the weights detached and an empty tensor that
    # requires grad (the trigger: autograd then calls their backward even for integer ids);
    # compiled, the custom operators, eager, the autograd Functions.

    def _trigger(self, device) -> torch.Tensor:
        if device not in self._triggers:
            self._triggers[device] = torch.empty(0, device=device, requires_grad=True)
        return self._triggers[device]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        args = (x, weight.detach(), None if bias is None else bias.detach(),
                self._trigger(x.device))
        if torch.compiler.is_compiling():
            return torch.ops.ptdp.deferred_linear(*args)
        own(self, weight, bias)
        return EagerLinear.apply(*args)

    @torch.compiler.disable
    def embedding(self, ids: torch.Tensor, weight: torch.Tensor):
        return DeferredEmbedding.apply(ids, weight.detach(), (weight,), self, self._trigger(ids.device))

    def layer_norm(self, x: torch.Tensor, shape, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float, offset: float = 0.0):
        assert tuple(shape) == tuple(weight.shape), "the normalised shape is the weight's"
        args = (x, weight.detach(), bias.detach(), eps, float(offset), self._trigger(x.device))
        if torch.compiler.is_compiling():
            return torch.ops.ptdp.deferred_layer_norm(*args)[0]
        own(self, weight, bias)
        return EagerLayerNorm.apply(*args)

    def scale(self, x: torch.Tensor, weight: torch.Tensor, offset: float = 0.0):
        args = (x, weight.detach(), float(offset), self._trigger(x.device))
        if torch.compiler.is_compiling():
            return torch.ops.ptdp.deferred_scale(*args)
        own(self, weight)
        return EagerScale.apply(*args)


def defer_weight_grads(chunk: nn.Module, bind: bool = True) -> WeightGradQueue:
    """Give `chunk` a new queue, kept as `chunk.weight_grads`, and bind every layer of it that
    owns weights (has `weight_ops`) to the queue: the chunk's B passes then leave their weight
    gradients to its W. With `bind=False` the layers keep torch's own ops except inside
    `queue.bound()`: only the micro-batches run there can split their backward (1F1B splits
    only its cooldown's, ptdp/pipeline/flushing.py), and the others pay nothing for it."""
    queue = WeightGradQueue()
    queue.chunk = weakref.ref(chunk)   # where `owner` finds a compiled layer's weights
    QUEUES.add(queue)
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


