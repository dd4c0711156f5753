"""The steps of each iteration of a no-flush run (2BW, PipeDream), planned once and repeated.

A no-flush schedule is one stream over the whole job (``ptdp.pipeline.schedules``). The trainer
runs it an iteration at a time: iteration t on a rank is its steps from just after its ``E`` of
batch t-1 through its ``E`` of batch t (``comm_plan`` keeps every exchange inside its iteration;
only stashed activations, received tensors and the losses of unfinished batches carry over, in
the executor's ``Stream``).

Planning every iteration of a long job is unnecessary: after the start-up iteration the
schedule repeats, iteration t's steps being iteration 1's with every micro-batch id shifted by
(t-1)*m, until the last, which drains. So a window of at most ``WINDOW`` batches is planned and
checked (``comm_plan.check_plans``, with barriers at every iteration boundary); iteration 0 is
the window's first iteration, the job's last the window's last, every other one the window's
second, shifted. That the window's middle iterations are all shifts of its second (the
schedule really is periodic) is checked when the plan is built. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ptdp.config.catalogue import schedule_spec
from ptdp.pipeline.actions import END
from ptdp.pipeline.comm_plan import Message, Step, check_plans, one_tensor, plan_exchanges
from ptdp.pipeline.schedules import build_all

WINDOW = 6   # batches planned explicitly: start-up, 4 steady iterations, drain


def shift_steps(steps: list[Step], delta: int) -> list[Step]:
    """``steps`` with every micro-batch id (actions and messages) moved by ``delta``."""
    if not delta:
        return list(steps)
    return [Step(tuple(replace(t, message=replace(t.message, mb=t.message.mb + delta))
                       for t in step.exchange),
                 None if step.action is None else replace(step.action, mb=step.action.mb + delta))
            for step in steps]


def split_iterations(steps: list[Step]) -> list[list[Step]]:
    """A rank's steps cut after each ``E`` (the final exchange-only step joins the last)."""
    out, current = [], []
    for step in steps:
        current.append(step)
        if step.action is not None and step.action.kind == END:
            out.append(current)
            current = []
    if current:
        if not out:
            return [current]
        out[-1].extend(current)
    return out


class NoFlushPlan:
    """Every rank's steps for iterations ``first .. first+iterations-1`` of a no-flush run.

    Micro-batch ids are global (batch t holds ``t*m .. t*m+m-1``), as the data loader and the
    weight-version rules use them. ``shape_of`` and ``tensors``: as for
    ``comm_plan.plan_exchanges``.
    """

    def __init__(self, name: str, p: int, v: int, m: int, *, first: int, iterations: int,
                 shape_of: Callable[[Message], tuple] = lambda message: (),
                 tensors: Callable[[int], int] = one_tensor):
        if schedule_spec(name).flushing:
            raise ValueError(f"{name!r} flushes: plan it per iteration (comm_plan.plan_exchanges)")
        if iterations < 1:
            raise ValueError(f"a no-flush plan needs at least one iteration (got {iterations})")
        self.name, self.p, self.v, self.m = name, p, v, m
        self.first, self.iterations = first, iterations
        self.window = min(iterations, WINDOW)
        self.schedule = build_all(name, p, v, m, self.window)
        plans = plan_exchanges(self.schedule, p, v, shape_of, tensors,
                               placement=schedule_spec(name).placement)
        check_plans(plans)
        self.segments = [split_iterations(steps) for steps in plans]
        if iterations > self.window:
            self._check_periodic()

    def _check_periodic(self) -> None:
        for rank, segments in enumerate(self.segments):
            for i in range(2, self.window - 1):
                if segments[i] != shift_steps(segments[1], (i - 1) * self.m):
                    raise RuntimeError(f"schedule {self.name!r} p={self.p} v={self.v} m={self.m}: "
                                       f"rank {rank}'s iteration {i} is not iteration 1 shifted; "
                                       f"the no-flush plan cannot be repeated")

    def steps(self, rank: int, iteration: int) -> list[Step]:
        """Rank ``rank``'s steps of (global) ``iteration``."""
        index = iteration - self.first
        if not 0 <= index < self.iterations:
            raise ValueError(f"iteration {iteration} is outside the planned "
                             f"{self.first}..{self.first + self.iterations - 1}")
        if self.iterations <= self.window or index == 0:
            template, offset = index, 0
        elif index == self.iterations - 1:
            template, offset = self.window - 1, self.iterations - self.window
        else:
            template, offset = 1, index - 1
        return shift_steps(self.segments[rank][template], (self.first + offset) * self.m)
