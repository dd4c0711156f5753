"""Runs one pipeline rank's steps for one iteration.

The schedule (`ptdp.pipeline.schedules`) says *what* to run and in which order; the
communication plan (`ptdp.pipeline.comm_plan`) says which boundary tensors to send and
receive before each action. This module only knows how to run a forward or a backward of a
model chunk, where its input comes from and where its output goes. It knows nothing about GPT
or BERT: a chunk is any module called as `chunk(hidden_or_None, batch)` that returns a hidden
tensor, or `(loss, aux)` on the last stage.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from ptdp.pipeline.comm_plan import Step, needed_message, produced_message
from ptdp.pipeline.p2p import P2P
from ptdp.pipeline.schedules import BACKWARD, FORWARD
from ptdp.trace import NO_SPANS


@dataclass
class IterationResult:
    losses: list[torch.Tensor] = field(default_factory=list)   # unscaled, last stage only
    aux: list[dict] = field(default_factory=list)


class PipelineExecutor:
    """Executes a rank's steps over `chunks` ({global stage: module}).

    `loss_scale` multiplies each micro-batch's loss before backward: 1/(m*d) averages over the
    micro-batches of the whole data-parallel batch (times the fp16 loss scale, if any).
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
            return _Iteration(self, get_batch, loss_scale, spans, forward_only).run(steps)


class _Iteration:
    """The state of one run: received and to-be-sent tensors, stashes, results."""

    def __init__(self, executor: PipelineExecutor, get_batch, loss_scale, spans, forward_only):
        self.ex, self.get_batch, self.loss_scale = executor, get_batch, loss_scale
        self.spans, self.forward_only = spans, forward_only
        self.inbox: dict = {}      # message -> PendingRecv, posted and not yet used
        self.outbox: dict = {}     # message -> tensor produced, not yet sent
        self.stash: dict = {}      # (mb, stage) -> (input, output) kept for the backward
        self.batches: dict = {}
        self.posted: set = set()   # messages whose receive is already posted (lookahead)
        self.result = IterationResult()

    def run(self, steps: list[Step]) -> IterationResult:
        ex = self.ex
        for k, step in enumerate(steps):
            self.inbox.update(ex.p2p.exchange(self._to_post(steps, k), self.outbox,
                                              ex.activation_shape, ex.dtype, ex.device))
            action = step.action
            if action is None:
                continue
            with self.spans(str(action), "forward" if action.kind == FORWARD else "backward",
                            mb=action.mb, stage=action.stage):
                if action.kind == FORWARD:
                    self._forward(action)
                elif action.kind == BACKWARD:
                    self._backward(action)
                else:
                    raise ValueError(f"executor cannot run action kind {action.kind!r} ({action})")
        ex.p2p.wait_sends()
        leftovers = [f"unused receives {sorted(map(str, self.inbox))}" if self.inbox else "",
                     f"unsent outputs {sorted(map(str, self.outbox))}" if self.outbox else "",
                     f"forwards without backwards {sorted(self.stash)}" if self.stash else ""]
        if any(leftovers):
            raise RuntimeError("pipeline steps are inconsistent: " + "; ".join(filter(None, leftovers)))
        return self.result

    def _to_post(self, steps: list[Step], k: int) -> tuple:
        """Step k's exchange, plus the receives of the next `receive_lookahead` steps when the
        transport completes operations out of order (gloo): posted early, in the same order,
        they match the same messages and let transfers overlap compute. 0 under NCCL's rules."""
        ahead = self.ex.p2p.receive_lookahead
        if not ahead:
            return steps[k].exchange
        posted = self.posted
        now = [t for t in steps[k].exchange if t.send or t.message not in posted]
        for later in steps[k + 1: k + 1 + ahead]:
            now += [t for t in later.exchange if not t.send and t.message not in posted]
        posted.update(t.message for t in now if not t.send)
        return tuple(now)

    def _received(self, action):
        message = needed_message(action, self.ex.num_stages)
        if message is None:
            return None
        if message not in self.inbox:
            raise RuntimeError(f"{action} needs {message}, but no exchange before it received it")
        with self.spans(f"wait {message}", "wait", mb=action.mb, stage=action.stage):
            return self.inbox.pop(message).wait()

    def _produced(self, action, tensor) -> None:
        message = produced_message(action, self.ex.num_stages)
        if message is not None:
            self.outbox[message] = tensor

    def _forward(self, action) -> None:
        inp = self._received(action)
        if inp is not None and not self.forward_only:
            inp.requires_grad_()
        if action.mb not in self.batches:
            self.batches[action.mb] = self.get_batch(action.mb)
        out = self.ex.chunks[action.stage](inp, self.batches[action.mb])
        if action.stage == self.ex.last_stage:
            loss, aux = out
            self.result.losses.append(loss.detach())
            self.result.aux.append(aux)
            out = loss * self.loss_scale
        else:
            self._produced(action, out)
        if not self.forward_only:
            self.stash[(action.mb, action.stage)] = (inp, out)

    def _backward(self, action) -> None:
        inp, out = self.stash.pop((action.mb, action.stage))
        if action.stage == self.ex.last_stage:
            out.backward()
        else:
            torch.autograd.backward(out, self._received(action))
        if action.stage > 0:
            self._produced(action, inp.grad)
