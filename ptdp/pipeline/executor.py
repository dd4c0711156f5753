"""Runs one pipeline rank's steps: one iteration (flushing schedules) or a stream of them.

The schedule (`ptdp.pipeline.schedules`) says *what* to run and in which order; the
communication plan (`ptdp.pipeline.comm_plan`) says which boundary tensors to send and
receive before each action. This module only knows how to run a forward or a backward of a
model chunk, where its input comes from and where its output goes. It knows nothing about GPT
or BERT: a chunk is any module called as `chunk(hidden_or_None, batch)` that returns a hidden
tensor, or `(loss, aux)` on the last stage.

No-flush schedules (2BW, PipeDream) never drain between iterations: `stream()` returns a
`Stream` whose `run(steps)` runs one iteration's steps and keeps what is in flight (stashed
activations, received tensors, losses of unfinished batches) for the next. With weight
versions (`ptdp.pipeline.weights.StashedVersions`) every forward activates the version its
micro-batch uses and stashes its id; the backward activates the same one. Rank actions (R, W,
U, T, E) are handed to the trainer's `rank_actions(action, stream)`: the optimizer and the
reductions are the trainer's business.

Split backwards (zb-h1): when the steps hold weight-gradient actions (`Wg`), a `B` runs with
the weight gradients deferred to its chunk's queue (`ptdp.parallel.weight_grad`) and its `Wg`
computes them later.

Freed outputs (Megatron's `deallocate_output_tensor`): once a stage's output is posted to the
next stage, its backward needs only the autograd graph behind it, not its [s, b, h] values.
The stashed output's data is then swapped for one element, and its backward is run by the
autograd engine directly (torch.autograd.backward would compare the gradient's shape with
the emptied tensor's). The send keeps the values alive until the transport reports it
complete (`P2P.exchange` drops completed sends: at once under NCCL's completion; with gloo's
batches only at the end of the iteration). A saved reference to the output elsewhere in the
graph would keep its own copy of the storage, so freeing never changes a result.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.autograd.graph import _engine_run_backward

from ptdp.parallel.weight_grad import pending_weight_grads, weight_grads_of
from ptdp.pipeline.actions import BACKWARD, END, FORWARD, REDUCE, WEIGHT_GRAD
from ptdp.pipeline.comm_plan import Step, needed_message, produced_message
from ptdp.pipeline.p2p import P2P
from ptdp.runtime.trace import NO_SPANS

@dataclass
class IterationResult:
    losses: list[torch.Tensor] = field(default_factory=list)   # unscaled, last stage only
    aux: list[dict] = field(default_factory=list)
    micro_batches: list[int] = field(default_factory=list)     # whose losses these are


class PipelineExecutor:
    """Executes a rank's steps over `chunks` ({global stage: module}).

    `loss_scale` multiplies each micro-batch's loss before backward: 1/(m*d) averages over the
    micro-batches of the whole data-parallel batch (times the fp16 loss scale, if any).
    It may also be a function of the micro-batch (2BW's fp16 scale is fixed per batch).
    `activation_shape` is the [s, b, h] shape of every boundary tensor.
    """

    def __init__(self, chunks: dict[int, nn.Module], num_stages: int, p2p: P2P, *,
                 activation_shape: tuple, activation_dtype: torch.dtype, device: torch.device):
        self.chunks, self.num_stages, self.p2p = chunks, num_stages, p2p
        self.activation_shape, self.dtype, self.device = activation_shape, activation_dtype, device
        self.last_stage = num_stages - 1

    def run(self, steps: list[Step], get_batch: Callable[[int], dict], loss_scale,
            spans=NO_SPANS, forward_only: bool = False) -> IterationResult:
        """Run `steps` in order. `forward_only` (validation): no graph, nothing stashed.

        `spans` records each action and each wait for a received tensor (`ptdp.trace`).
        """
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            run = _Run(self, get_batch, loss_scale, forward_only=forward_only)
            run.run(steps, spans)
            self.p2p.wait_sends()
            run.check_drained()
            return run.take_result()

    def stream(self, get_batch: Callable[[int], dict], loss_scale, rank_actions: Callable,
               versions=None) -> "Stream":
        """A no-flush run: iterations' steps, one `Stream.run` each, on one shared state.
        `versions`: the weight versions every forward and backward activates
        (ptdp.pipeline.weights.StashedVersions; None: the parameters as they are)."""
        return Stream(_Run(self, get_batch, loss_scale, forward_only=False,
                           rank_actions=rank_actions, versions=versions))


class Stream:
    """Runs consecutive iterations of a no-flush schedule; `close()` after the last."""

    def __init__(self, run: "_Run"):
        self._run = run
        self.losses: dict[int, tuple[torch.Tensor, dict]] = {}   # mb -> (loss, aux), not yet taken

    def run(self, steps: list[Step], spans=NO_SPANS) -> None:
        self._run.run(steps, spans, stream=self)
        self._run.ex.p2p.release_completed_sends()

    def take_losses(self, micro_batches) -> list[tuple[torch.Tensor, dict]]:
        """The (loss, aux) of these micro-batches (last stage), forgotten afterwards."""
        return [self.losses.pop(mb) for mb in micro_batches if mb in self.losses]

    def close(self) -> None:
        self._run.ex.p2p.wait_sends()
        self._run.check_drained()
        if self.losses:
            raise RuntimeError(f"losses never taken for micro-batches {sorted(self.losses)}")



class _Run:
    """The state of a run: received and to-be-sent tensors, stashes, results."""

    def __init__(self, executor: PipelineExecutor, get_batch, loss_scale, *, forward_only: bool,
                 rank_actions: Callable | None = None, versions=None):
        self.ex, self.get_batch, self.forward_only = executor, get_batch, forward_only
        self.scale = loss_scale if callable(loss_scale) else (lambda mb: loss_scale)
        self.rank_actions = rank_actions
        self.versions = versions
        self.inbox: dict = {}      # message -> PendingRecv, posted and not yet used
        self.outbox: dict = {}     # message -> tensor produced, not yet sent
        self.stash: dict = {}      # (mb, stage) -> (input, output, version ids) for the backward
        self.batches: dict = {}    # mb -> (batch, forwards of it still to run on this rank)
        self.posted: set = set()   # receives posted ahead of their step and not yet used
        self.unsent: dict = {}     # message -> stashed output to free once it is sent
        self.split = False         # the steps hold Wg actions: B defers weight gradients
        self.result = IterationResult()
        self.spans = NO_SPANS

    def run(self, steps: list[Step], spans, stream: Stream | None = None) -> None:
        ex, self.spans = self.ex, spans
        self.split = any(s.action is not None and s.action.kind == WEIGHT_GRAD for s in steps)
        for k, step in enumerate(steps):
            transfers = self._to_post(steps, k)
            self.inbox.update(ex.p2p.exchange(transfers, self.outbox, ex.activation_shape,
                                              ex.dtype, ex.device))
            for t in transfers:
                if t.send and t.message in self.unsent:
                    _free_data(self.unsent.pop(t.message))
            action = step.action
            if action is None:
                continue
            with spans(str(action), _CATEGORY.get(action.kind, "optimizer"),
                       mb=action.mb, stage=action.stage):
                if action.kind == FORWARD:
                    self._forward(action, stream)
                elif action.kind == BACKWARD:
                    self._backward(action)
                elif action.kind == WEIGHT_GRAD:
                    weight_grads_of(self.ex.chunks[action.stage]).run(action.mb)
                elif self.rank_actions is not None:
                    self.rank_actions(action, stream)
                else:
                    raise ValueError(f"executor cannot run action kind {action.kind!r} ({action})")

    def check_drained(self) -> None:
        deferred = pending_weight_grads(self.ex.chunks)
        leftovers = [f"unused receives {sorted(map(str, self.inbox))}" if self.inbox else "",
                     f"unsent outputs {sorted(map(str, self.outbox))}" if self.outbox else "",
                     f"forwards without backwards {sorted(self.stash)}" if self.stash else "",
                     f"backwards without weight-gradient passes {deferred}" if deferred else ""]
        if any(leftovers):
            raise RuntimeError("pipeline steps are inconsistent: " + "; ".join(filter(None, leftovers)))

    def _to_post(self, steps: list[Step], k: int) -> tuple:
        """Step k's exchange, plus the receives of the next `receive_lookahead` steps when the
        transport completes operations out of order (gloo): posted early, in the same order,
        they match the same messages and let transfers overlap compute. 0 under NCCL's rules.
        (Only within `steps`: a no-flush iteration never posts the next one's receives.)"""
        ahead = self.ex.p2p.receive_lookahead
        if not ahead:
            return steps[k].exchange
        posted = self.posted
        now = [t for t in steps[k].exchange if t.send or t.message not in posted]
        for later in steps[k + 1: k + 1 + ahead]:
            now += [t for t in later.exchange if not t.send and t.message not in posted]
        posted.update(t.message for t in now if not t.send and t not in steps[k].exchange)
        return tuple(now)

    def take_result(self) -> IterationResult:
        result, self.result = self.result, IterationResult()
        return result

    def _received(self, action):
        message = needed_message(action, self.ex.num_stages)
        if message is None:
            return None
        if message not in self.inbox:
            raise RuntimeError(f"{action} needs {message}, but no exchange before it received it")
        self.posted.discard(message)
        with self.spans(f"wait {message}", "wait", mb=action.mb, stage=action.stage):
            return self.inbox.pop(message).wait()

    def _produced(self, action, tensor):
        message = produced_message(action, self.ex.num_stages)
        if message is not None:
            self.outbox[message] = tensor
        return message

    def _batch(self, mb: int) -> dict:
        """The micro-batch's tensors, built once and dropped after its last forward here."""
        if mb not in self.batches:
            self.batches[mb] = [self.get_batch(mb), len(self.ex.chunks)]
        entry = self.batches[mb]
        entry[1] -= 1
        if not entry[1]:
            del self.batches[mb]
        return entry[0]

    def _forward(self, action, stream) -> None:
        inp = self._received(action)
        if inp is not None and not self.forward_only:
            inp.requires_grad_()
        ids = self.versions.forward(action.mb) if self.versions is not None else None
        out = self.ex.chunks[action.stage](inp, self._batch(action.mb))
        if action.stage == self.ex.last_stage:
            loss, aux = out
            if stream is not None:   # a no-flush stream hands losses out per micro-batch
                stream.losses[action.mb] = (loss.detach(), aux)
            else:
                self.result.losses.append(loss.detach())
                self.result.aux.append(aux)
                self.result.micro_batches.append(action.mb)
            out = loss * self.scale(action.mb)
        else:
            message = self._produced(action, out)
            if message is not None and not self.forward_only:
                self.unsent[message] = out
        if not self.forward_only:
            self.stash[(action.mb, action.stage)] = (inp, out, ids)
            self._log(action, ids)

    def _backward(self, action) -> None:
        inp, out, ids = self.stash.pop((action.mb, action.stage))
        if ids is not None:
            self.versions.backward(ids)
        grad = None if action.stage == self.ex.last_stage else self._received(action)
        chunk = self.ex.chunks[action.stage]
        with weight_grads_of(chunk).defer(action.mb) if self.split else contextlib.nullcontext():
            if grad is None:   # the last stage's loss
                torch.autograd.backward(out)
            else:              # the output may have been freed (_free_data): the engine itself
                _engine_run_backward((out,), (grad,), False, False, (), allow_unreachable=True,
                                     accumulate_grad=True)
        if action.stage > 0:
            self._produced(action, inp.grad)
        if ids is not None:
            self.versions.done(ids)
            self._log(action, ids)

    def _log(self, action, ids) -> None:
        if ids is not None:
            self.versions.log.append((action.kind, action.mb, action.stage, ids))


def _free_data(out: torch.Tensor) -> None:
    """Drop a sent output's values, keeping the tensor (and so its autograd graph): Megatron's
    deallocate_output_tensor. A view is left alone (its base holds the memory anyway)."""
    if out._base is None and out.numel() > 1:
        out.data = torch.empty((1,), dtype=out.dtype, device=out.device)


_CATEGORY = {FORWARD: "forward", BACKWARD: "backward", WEIGHT_GRAD: "backward", REDUCE: "reduce",
             END: "reduce"}
