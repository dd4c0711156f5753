"""Timeline simulator for pipeline schedules (pure Python, no torch).

``simulate_lists`` plays every rank's action list against the dependency rule
(``ptdp.pipeline.actions.dependencies``): a rank runs its list strictly in order; an action
starts once the rank is free and the actions it depends on have finished, plus ``t_comm`` when
the input comes from another rank (``placement`` says which rank holds each stage: the
schedule's, ptdp/config/stages.py). Sends never block. Because each start time depends only on
the end times of earlier actions, scheduling them in any order that respects those dependencies
gives the same timeline as an event queue would; when no rank can take its next step the
schedule would deadlock, and ``DeadlockError`` says which rank waits for what.

``t_f`` and ``t_b`` are the forward and backward times of one micro-batch through a rank's
WHOLE share of layers, so one chunk takes ``t_f / v`` and ``t_b / v`` (§4.2.2). The ideal
iteration time is ``m * (t_f + t_b)`` and the bubble fraction is measured against it, which is
the quantity the dissertation's (p-1)/m and (p-1)/(v*m) describe. Times may be ``Fraction``s
for exact arithmetic. With split backwards (every one of ``zb-h1``'s, 1F1B's drain's) ``t_b``
is still the whole backward: a ``B`` followed by a ``Wg`` of the same micro-batch and stage
takes ``t_b - t_w`` and the ``Wg`` takes ``t_w`` (by default ``t_b / 2``, the paper's
``t_B = t_W``); any other ``B`` takes ``t_b``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ptdp.config.stages import Placement, StageMap
from ptdp.pipeline.actions import (Action, BACKWARD, FORWARD, RANK_ACTIONS, TIED, UPDATE, WEIGHTS,
                                   WEIGHT_GRAD, action_rank, dependencies, split_units)


def exact_times(v: int) -> dict:
    """Durations for deciding the order of events (plans, iteration ends): a forward of t_f = 1
    and a backward of t_b = 2, scaled by 2v so that every action lasts a whole number (a chunk's
    forward 2, backward 4, zb-h1's two halves 2 each). Float arithmetic on whole numbers is
    exact, so the order is that of exact fractions, at a fraction of their cost."""
    return {"t_f": 2 * v, "t_b": 4 * v}


class DeadlockError(RuntimeError):
    """No rank can start its next action: the schedule would hang."""


class Slot(NamedTuple):
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    name: str
    p: int
    v: int
    m: int
    t_f: float
    t_b: float
    t_comm: float
    ranks: list[list[Slot]]  # per rank, its slots in execution order
    stages: StageMap         # which rank holds each virtual stage

    @property
    def makespan(self) -> float:
        return max((row[-1].end for row in self.ranks if row), default=0)

    @property
    def ideal(self) -> float:
        return self.m * (self.t_f + self.t_b)

    @property
    def bubble_fraction(self) -> float:
        return (self.makespan - self.ideal) / self.ideal


def simulate_lists(
    schedule: list[list[Action]],
    p: int,
    v: int,
    m: int,
    t_f=1.0,
    t_b=2.0,
    t_comm=0.0,
    name: str = "custom",
    t_update=0,
    t_w=None,
    placement: Placement = Placement.LOOPED,
) -> Timeline:
    """Simulate explicit per-rank action lists (e.g. a hand-written or broken schedule).

    ``t_update``: how long a rank's optimizer step (W, U, T) takes; other rank actions take no
    time. ``placement``: the schedule's (``spec.placement``); an action on a stage its rank does
    not hold is an error."""
    if len(schedule) != p:
        raise ValueError(f"expected one action list per rank (p={p}), got {len(schedule)}")
    stages = StageMap(p, v, placement)
    # Rank actions take no simulated time: the optimizer and reductions are outside the
    # (p-1)/m accounting, and W/E still wait for every rank's R through their dependencies.
    duration = {FORWARD: t_f / v, BACKWARD: t_b / v, **{kind: 0 * t_f for kind in RANK_ACTIONS},
                **{kind: t_update for kind in (WEIGHTS, UPDATE, TIED)}}
    split = split_units(a for row in schedule for a in row)
    t_w = t_b / 2 if t_w is None else t_w
    duration[WEIGHT_GRAD] = t_w / v   # and a split B takes t_b - t_w (`_duration`)
    finished: dict[Action, float] = {}  # action -> end time
    rows: list[list[Slot]] = [[] for _ in range(p)]

    def ready_time(action: Action, rank: int):
        """When ``action``'s inputs are available on ``rank``, or None if some are not done."""
        ready = 0
        for dep in dependencies(action, p, v):
            if dep not in finished:
                return None
            # `and t_comm` keeps exact (Fraction) arithmetic when the default 0.0 is used
            latency = t_comm if t_comm and action_rank(dep, stages) != rank else 0
            ready = max(ready, finished[dep] + latency)
        return ready

    def advance(rank: int) -> bool:
        """Run ``rank``'s next action if its inputs are done; report whether it ran."""
        row = rows[rank]
        if len(row) == len(schedule[rank]):
            return False
        action = schedule[rank][len(row)]
        _check_action(action, rank, stages, duration, finished)
        ready = ready_time(action, rank)
        if ready is None:
            return False
        start = max(ready, row[-1].end if row else 0)
        end = start + _duration(action, duration, split, t_w / v)
        row.append(Slot(action, start, end))
        finished[action] = end
        return True

    while any(len(rows[r]) < len(schedule[r]) for r in range(p)):
        progressed = False
        for rank in range(p):
            while advance(rank):
                progressed = True
        if not progressed:
            raise DeadlockError(_deadlock_report(schedule, rows, finished, p, v))
    return Timeline(name, p, v, m, t_f, t_b, t_comm, rows, stages)


def _duration(action: Action, duration: dict, split: set, chunk_t_w):
    """How long `action` takes: a B whose Wg comes later leaves that part to it."""
    if action.kind == BACKWARD and (action.mb, action.stage) in split:
        return duration[BACKWARD] - chunk_t_w
    return duration[action.kind]


def _check_action(action: Action, rank: int, stages: StageMap, duration: dict,
                  finished: dict) -> None:
    if action.kind not in duration:
        raise ValueError(f"rank {rank}: cannot simulate action kind {action.kind!r} ({action})")
    if action.kind not in RANK_ACTIONS and not 0 <= action.stage < stages.num_stages:
        raise ValueError(f"rank {rank}: {action} is on no stage of p={stages.p}, v={stages.v}")
    if action_rank(action, stages) != rank:
        raise ValueError(f"rank {rank}: {action} belongs to rank {action_rank(action, stages)}")
    if action in finished:
        raise ValueError(f"rank {rank}: {action} is scheduled twice")


def _deadlock_report(schedule, rows, finished, p: int, v: int) -> str:
    """One line per blocked rank: its next action and the inputs it is still waiting for."""
    position = {a: (r, i) for r, actions in enumerate(schedule) for i, a in enumerate(actions)}
    lines = ["pipeline schedule deadlocks; no rank can start its next action:"]
    for rank in range(p):
        if len(rows[rank]) == len(schedule[rank]):
            continue
        action = schedule[rank][len(rows[rank])]
        waits = []
        for dep in dependencies(action, p, v):
            if dep in finished:
                continue
            if dep not in position:
                waits.append(f"{dep} (scheduled on no rank)")
            else:
                dep_rank, index = position[dep]
                waits.append(f"{dep} (rank {dep_rank}, position {index} in its list)")
        lines.append(f"  rank {rank} blocked at {action} (position {len(rows[rank])}), "
                     f"waiting for {', '.join(waits)}")
    return "\n".join(lines)
