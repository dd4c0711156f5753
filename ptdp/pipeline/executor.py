"""Runs one pipeline rank's steps: one iteration (flushing schedules) or a stream of them.

The schedule (`ptdp.pipeline.schedules`) says *what* to run and in which order; the
communication plan (`ptdp.pipeline.comm_plan`) says which boundary tensors to send and
receive before each action. This module only knows how to run a forward or a backward of a
model chunk, where its input comes from and where its output goes. It knows nothing about GPT
or BERT.

The chunk contract. A chunk is any module called as `chunk(inputs, batch)`:

* `inputs` is None on stage 0; otherwise what the previous stage handed on: one tensor, or a
  tuple when the boundary carries several (`boundary_shapes(stage)` gives the shapes of the
  tensors stage `stage` hands to `stage + 1`; both sides, and the plan, read the same function).
* It returns, on every stage but the last, its boundary: a tensor, or a tuple of as many tensors
  as `boundary_shapes` declares; on the last stage `(loss, parts)`: the micro-batch's loss and a
  dict of detached values it reports (BERT's `lm_loss`, `sop_loss`; they are not added to it).
* Any stage may wrap that return in `StageOutput(output, aux_losses)`
  (ptdp/parallel/stage_output.py): named scalar auxiliary losses, coefficients applied. They are
  added to what the stage backpropagates (so the gradients are those of loss + sum of aux losses,
  each scaled like the loss), and summed per name over this rank's micro-batches and stages
  into `IterationResult.aux_losses` for the report. Their names are declared up front
  (`aux_loss_names`, the same on every rank, so every rank reduces the same vector); an
  undeclared name is an error naming the stage. No-flush streams refuse them (their update
  rules and reports are not extended to side outputs).

No-flush schedules (2BW, PipeDream) never drain between iterations: `stream()` returns a
`Stream` whose `run(steps)` runs one iteration's steps and keeps what is in flight (stashed
activations, received tensors, losses of unfinished batches) for the next. With weight
versions (`ptdp.pipeline.weights.StashedVersions`) every forward activates the version its
micro-batch uses and stashes its id; the backward activates the same one. Rank actions (R, W,
U, T, E) are handed to the trainer's `rank_actions(action, stream)`: the optimizer and the
reductions are the trainer's business.

Split backwards (zb-h1's every one, the cooldown's of 1F1B and interleaved): a (micro-batch,
stage) whose steps hold a weight-gradient action (`Wg`) runs its forward and its `B` with the
chunk's layers bound to the chunk's queue (`ptdp.parallel.weight_grad`), the `B` deferring
the weight gradients, which its `Wg` computes; every other micro-batch runs torch's own ops.

Freed outputs (Megatron's `deallocate_output_tensor`): once a stage's output is posted to the
next stage, its backward needs only the autograd graph behind it, not its [s, b, h] values.
The stashed output's data is then swapped for one element, and its backward is run by the
autograd engine directly (torch.autograd.backward would compare the gradient's shape with
the emptied tensor's). The send keeps the values alive until the transport reports it
complete (`P2P.exchange` drops completed sends: at once under NCCL's completion; with gloo's
batches only at the end of the iteration). Only a stage that returns one boundary tensor and no
aux losses frees it: nothing else it computed from its output reaches the backward then. (A
second boundary tensor or an aux loss computed from the output may have saved it for its own
backward, as `h.pow(2)` saves `h`, and would see the emptied tensor: those outputs are kept.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.autograd.graph import _engine_run_backward

from ptdp.parallel.stage_output import StageOutput
from ptdp.parallel.weight_grad import pending_weight_grads, weight_grads_of
from ptdp.pipeline.actions import BACKWARD, END, FORWARD, REDUCE, WEIGHT_GRAD, split_units
from ptdp.pipeline.comm_plan import Message, Step, needed_messages, produced_messages
from ptdp.pipeline.p2p import P2P
from ptdp.runtime.trace import NO_SPANS


@dataclass
class IterationResult:
    losses: list[torch.Tensor] = field(default_factory=list)   # unscaled, last stage only
    parts: list[dict] = field(default_factory=list)            # each loss's reported parts
    micro_batches: list[int] = field(default_factory=list)     # whose losses these are
    # every declared aux loss: its sum over this rank's micro-batches and stages (float64)
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)


class PipelineExecutor:
    """Executes a rank's steps over `chunks` ({global stage: module}).

    `loss_scale` multiplies each micro-batch's loss (and aux losses) before backward: 1/(m*d)
    averages over the micro-batches of the whole data-parallel batch (times the fp16 loss
    scale, if any). It may also be a function of the micro-batch (2BW's fp16 scale is fixed per
    batch). `boundary_shapes(stage)`: the shapes of the tensors stage `stage` hands to the next
    (their gradients come back with the same shapes), in `activation_dtype`. `aux_loss_names`:
    the aux losses any stage may return (module doc).
    """

    def __init__(self, chunks: dict[int, nn.Module], num_stages: int, p2p: P2P, *,
                 boundary_shapes: Callable[[int], tuple[tuple, ...]],
                 activation_dtype: torch.dtype, device: torch.device,
                 aux_loss_names: tuple[str, ...] = ()):
        self.chunks, self.num_stages, self.p2p = chunks, num_stages, p2p
        self.boundary_shapes, self.dtype, self.device = boundary_shapes, activation_dtype, device
        self.aux_loss_names = tuple(aux_loss_names)
        self.last_stage = num_stages - 1

    def tensors(self, boundary: int) -> int:
        """How many tensors cross the boundary between stages `boundary` and `boundary + 1`."""
        return len(self.boundary_shapes(boundary))

    def full_shape(self, message: Message) -> tuple:
        return tuple(self.boundary_shapes(message.boundary)[message.index])

    def run(self, steps: list[Step], get_batch: Callable[[int], dict], loss_scale,
            spans=NO_SPANS, forward_only: bool = False) -> IterationResult:
        """Run `steps` in order. `forward_only` (validation): no graph, nothing stashed.

        `spans` records each action and each wait for a received tensor
        (ptdp/runtime/trace.py).
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
        if self.aux_loss_names:
            raise ValueError(f"auxiliary losses {list(self.aux_loss_names)} need a flushing "
                             f"schedule: no-flush schedules do not apply them")
        return Stream(_Run(self, get_batch, loss_scale, forward_only=False,
                           rank_actions=rank_actions, versions=versions))


class Stream:
    """Runs consecutive iterations of a no-flush schedule; `close()` after the last."""

    def __init__(self, run: "_Run"):
        self._run = run
        self.losses: dict[int, tuple[torch.Tensor, dict]] = {}   # mb -> (loss, parts), not yet taken

    def run(self, steps: list[Step], spans=NO_SPANS) -> None:
        self._run.run(steps, spans, stream=self)
        self._run.ex.p2p.release_completed_sends()

    def take_losses(self, micro_batches) -> list[tuple[torch.Tensor, dict]]:
        """The (loss, parts) of these micro-batches (last stage), forgotten afterwards."""
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
        self.split: set = set()    # (mb, stage) with a Wg action: its B defers weight gradients
        self.result = self._new_result()
        self.spans = NO_SPANS

    def run(self, steps: list[Step], spans, stream: Stream | None = None) -> None:
        ex, self.spans = self.ex, spans
        self.split = split_units(s.action for s in steps if s.action is not None)
        for k, step in enumerate(steps):
            transfers = self._to_post(steps, k)
            self.inbox.update(ex.p2p.exchange(transfers, self.outbox, ex.full_shape, ex.dtype,
                                              ex.device))
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
        result, self.result = self.result, self._new_result()
        return result

    def _new_result(self) -> IterationResult:
        zeros = lambda: torch.zeros((), dtype=torch.float64, device=self.ex.device)  # noqa: E731
        return IterationResult(aux_losses={name: zeros() for name in self.ex.aux_loss_names})

    def _received(self, action) -> tuple | None:
        """The tensors `action` needs from the adjacent stage (None: it needs none)."""
        messages = needed_messages(action, self.ex.num_stages, self.ex.tensors)
        if not messages:
            return None
        for message in messages:
            if message not in self.inbox:
                raise RuntimeError(f"{action} needs {message}, but no exchange before it "
                                   f"received it")
            self.posted.discard(message)
        with self.spans(f"wait {messages[0]}", "wait", mb=action.mb, stage=action.stage):
            return tuple(self.inbox.pop(message).wait() for message in messages)

    def _produced(self, action, tensors: tuple) -> tuple:
        """Put `action`'s tensors for the adjacent stage in the outbox; returns their messages."""
        messages = produced_messages(action, self.ex.num_stages, self.ex.tensors)
        self.outbox.update(zip(messages, tensors))
        return messages

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
        inputs = self._received(action)
        if inputs is not None and not self.forward_only:
            for tensor in inputs:
                tensor.requires_grad_()
        ids = self.versions.forward(action.mb) if self.versions is not None else None
        chunk = self.ex.chunks[action.stage]
        with self._splittable(action, chunk):
            out = chunk(_unpacked(inputs), self._batch(action.mb))
        out, aux = (out.output, out.aux_losses) if isinstance(out, StageOutput) else (out, {})
        self._add_aux_losses(action, aux)
        side = None   # a middle stage's aux losses, scaled, backpropagated with its outputs
        if action.stage == self.ex.last_stage:
            loss, parts = out
            if stream is not None:   # a no-flush stream hands losses out per micro-batch
                stream.losses[action.mb] = (loss.detach(), parts)
            else:
                self.result.losses.append(loss.detach())
                self.result.parts.append(parts)
                self.result.micro_batches.append(action.mb)
            outputs = ((loss + sum(aux.values()) if aux else loss) * self.scale(action.mb),)
        else:
            outputs = self._boundary(action, out)
            messages = self._produced(action, outputs)
            if not self.forward_only:
                if len(outputs) == 1 and not aux:   # nothing else may have saved it (module doc)
                    self.unsent.update(zip(messages, outputs))
                side = sum(aux.values()) * self.scale(action.mb) if aux else None
        if not self.forward_only:
            self.stash[(action.mb, action.stage)] = (inputs, outputs, side, ids)
            self._log(action, ids)

    def _boundary(self, action, out) -> tuple:
        """A middle stage's return as the tuple of tensors its boundary carries."""
        outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        expected = self.ex.tensors(action.stage)
        if len(outputs) != expected:
            raise ValueError(f"stage {action.stage} returned {len(outputs)} boundary tensor(s); "
                             f"its boundary carries {expected} (boundary_shapes)")
        return outputs

    def _add_aux_losses(self, action, aux: dict) -> None:
        unknown = sorted(set(aux) - set(self.result.aux_losses))
        if unknown:
            raise ValueError(f"stage {action.stage} returned aux losses {unknown} that are not "
                             f"declared (aux_loss_names: {list(self.ex.aux_loss_names)})")
        for name, value in aux.items():
            self.result.aux_losses[name] += value.detach().double()

    def _backward(self, action) -> None:
        inputs, outputs, side, ids = self.stash.pop((action.mb, action.stage))
        if ids is not None:
            self.versions.backward(ids)
        last = action.stage == self.ex.last_stage
        grads = None if last else self._received(action)
        chunk = self.ex.chunks[action.stage]
        with self._splittable(action, chunk), self._deferring(action, chunk):
            if last:   # the loss (with its stage's aux losses)
                torch.autograd.backward(outputs[0])
            else:
                self._backward_outputs(outputs, grads, side)
        if action.stage > 0:   # an input the chunk did not use gets a zero gradient
            self._produced(action, tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                                         for t in inputs))
        if ids is not None:
            self.versions.done(ids)
            self._log(action, ids)

    def _splittable(self, action, chunk):
        """A split micro-batch's forward, and its B (which may recompute the forward), run
        with the chunk's layers on its weight-gradient queue."""
        if (action.mb, action.stage) not in self.split:
            return contextlib.nullcontext()
        return weight_grads_of(chunk).bound()

    def _deferring(self, action, chunk):
        """A split micro-batch's B leaves its weight gradients to its Wg."""
        if (action.mb, action.stage) not in self.split:
            return contextlib.nullcontext()
        return weight_grads_of(chunk).defer(action.mb)

    @staticmethod
    def _backward_outputs(outputs: tuple, grads: tuple, side) -> None:
        """Backpropagate the received gradients of the outputs (and the stage's own aux
        losses). The outputs may have been freed (_free_data): the engine itself runs it."""
        pairs = [(out, grad) for out, grad in zip(outputs, grads) if out.requires_grad]
        if side is not None:
            pairs.append((side, torch.ones_like(side)))
        if pairs:
            tensors, grads = zip(*pairs)
            _engine_run_backward(tensors, grads, False, False, (), allow_unreachable=True,
                                 accumulate_grad=True)

    def _log(self, action, ids) -> None:
        if ids is not None:
            self.versions.log.append((action.kind, action.mb, action.stage, ids))


def _unpacked(inputs: tuple | None):
    """What a chunk receives: None, the one tensor of its boundary, or the tuple of them."""
    return inputs[0] if inputs is not None and len(inputs) == 1 else inputs


def _free_data(out: torch.Tensor) -> None:
    """Drop a sent output's values, keeping the tensor (and so its autograd graph): Megatron's
    deallocate_output_tensor. A view is left alone (its base holds the memory anyway)."""
    if out._base is None and out.numel() > 1:
        out.data = torch.empty((1,), dtype=out.dtype, device=out.device)


_CATEGORY = {FORWARD: "forward", BACKWARD: "backward", WEIGHT_GRAD: "backward", REDUCE: "reduce",
             END: "reduce"}
