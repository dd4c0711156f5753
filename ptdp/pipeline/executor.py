"""Runs one pipeline rank's action list for one iteration.

The schedule (`ptdp.pipeline.schedules`) says *what* to run and in which order; this module
only knows how to run a forward or a backward of a model chunk, where its input comes from
and where its output goes. It knows nothing about GPT or BERT: a chunk is any module called as
`chunk(hidden_or_None, batch)` that returns a hidden tensor, or `(loss, aux)` on the last stage.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from ptdp.pipeline.p2p import ACTIVATION, GRADIENT, P2P, message_tag
from ptdp.pipeline.schedules import BACKWARD, FORWARD, Action, stage_rank


@dataclass
class StageLayout:
    """Where stages live: p ranks, v chunks each, and the world rank of each pipeline rank."""

    p: int
    v: int
    pipeline_ranks: list[int]

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def peer(self, stage: int) -> int:
        return self.pipeline_ranks[stage_rank(stage, self.p)]


@dataclass
class IterationResult:
    losses: list[torch.Tensor] = field(default_factory=list)   # unscaled, last stage only
    aux: list[dict] = field(default_factory=list)
    trace: list[tuple[str, float, float]] = field(default_factory=list)


class PipelineExecutor:
    """Executes `actions` over `chunks` ({global stage: module}) for one rank.

    `loss_scale` multiplies each micro-batch's loss before backward: 1/(m*d) averages over the
    micro-batches of the whole data-parallel batch (times the fp16 loss scale, if any).
    """

    def __init__(self, chunks: dict[int, nn.Module], layout: StageLayout, p2p: P2P, *,
                 activation_shape: tuple, activation_dtype: torch.dtype, device: torch.device):
        self.chunks, self.layout, self.p2p = chunks, layout, p2p
        self.activation_shape, self.dtype, self.device = activation_shape, activation_dtype, device
        self.last_stage = layout.num_stages - 1

    def run(self, actions: list[Action], get_batch: Callable[[int], dict], loss_scale: float,
            record_trace: bool = False, forward_only: bool = False) -> IterationResult:
        """Run `actions` in order. `forward_only` (validation): no graph, nothing stashed."""
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            return self._run(actions, get_batch, loss_scale, record_trace, forward_only)

    def _run(self, actions, get_batch, loss_scale, record_trace, forward_only) -> IterationResult:
        self.forward_only = forward_only
        result = IterationResult()
        stash: dict[tuple[int, int], tuple] = {}     # (mb, stage) -> (input, output)
        batches: dict[int, dict] = {}
        recvs = {}
        self._post_recv(actions, 0, recvs)
        for i, action in enumerate(actions):
            self._post_recv(actions, i + 1, recvs)  # overlap the next receive with this compute
            start = time.perf_counter()
            if action.kind == FORWARD:
                if action.mb not in batches:
                    batches[action.mb] = get_batch(action.mb)
                self._forward(action, batches[action.mb], recvs, stash, result, loss_scale)
            elif action.kind == BACKWARD:
                self._backward(action, recvs, stash)
            else:
                raise ValueError(f"executor cannot run action kind {action.kind!r} ({action})")
            if record_trace:
                result.trace.append((str(action), start, time.perf_counter()))
        self.p2p.wait_sends()
        if stash:
            raise RuntimeError(f"schedule left forwards without backwards: {sorted(stash)}")
        return result

    # Communication ----------------------------------------------------------------------------
    def _needs_recv(self, action: Action):
        if action.kind == FORWARD and action.stage > 0:
            return ACTIVATION, action.stage - 1
        if action.kind == BACKWARD and action.stage < self.last_stage:
            return GRADIENT, action.stage + 1
        return None

    def _post_recv(self, actions, i, recvs) -> None:
        if i >= len(actions) or actions[i] in recvs:
            return
        need = self._needs_recv(actions[i])
        if need is None:
            return
        kind, src_stage = need
        tag = message_tag(kind, actions[i].mb, actions[i].stage, self.layout.num_stages)
        recvs[actions[i]] = self.p2p.post_recv(self.activation_shape, self.dtype, self.device,
                                               self.layout.peer(src_stage), tag)

    def _send(self, tensor, kind: int, mb: int, to_stage: int) -> None:
        tag = message_tag(kind, mb, to_stage, self.layout.num_stages)
        self.p2p.send(tensor, self.layout.peer(to_stage), tag)

    # Compute ----------------------------------------------------------------------------------
    def _forward(self, action, batch, recvs, stash, result, loss_scale) -> None:
        mb, stage = action.mb, action.stage
        inp = None
        if stage > 0:
            inp = recvs.pop(action).wait()
            if not self.forward_only:
                inp.requires_grad_()
        out = self.chunks[stage](inp, batch)
        if stage == self.last_stage:
            loss, aux = out
            result.losses.append(loss.detach())
            result.aux.append(aux)
            out = loss * loss_scale
        else:
            self._send(out, ACTIVATION, mb, stage + 1)
        if not self.forward_only:
            stash[(mb, stage)] = (inp, out)

    def _backward(self, action, recvs, stash) -> None:
        mb, stage = action.mb, action.stage
        inp, out = stash.pop((mb, stage))
        if stage == self.last_stage:
            out.backward()
        else:
            torch.autograd.backward(out, recvs.pop(action).wait())
        if stage > 0:
            self._send(inp.grad, GRADIENT, mb, stage - 1)
