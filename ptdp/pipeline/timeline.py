"""Timeline simulator for pipeline schedules (pure Python, no torch).

``simulate`` plays every rank's action list (``ptdp.pipeline.schedules``) against the dependency
rule: a rank runs its list strictly in order; an action starts once the rank is free and the
actions it depends on have finished, plus ``t_comm`` when the input comes from another rank.
Sends never block. Because each start time depends only on the end times of earlier actions,
scheduling them in any order that respects those dependencies gives the same timeline as an
event queue would; when no rank can take its next step the schedule would deadlock, and
``DeadlockError`` says which rank waits for what.

``t_f`` and ``t_b`` are the forward and backward times of one micro-batch through a rank's
WHOLE share of layers, so one chunk takes ``t_f / v`` and ``t_b / v`` (§4.2.2). The ideal
iteration time is ``m * (t_f + t_b)`` and the bubble fraction is measured against it, which is
the quantity the dissertation's (p-1)/m and (p-1)/(v*m) describe. Times may be ``Fraction``s
for exact arithmetic. With split backwards (``zb-h1``) ``t_b`` is still the whole backward:
``B`` takes ``t_b - t_w`` and ``Wg`` takes ``t_w`` (by default ``t_b / 2``, the paper's
``t_B = t_W``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from ptdp.pipeline.schedules import (
    BACKWARD,
    END,
    FORWARD,
    REDUCE,
    RANK_ACTIONS,
    TIED,
    UPDATE,
    WEIGHT_GRAD,
    WEIGHTS,
    Action,
    build_all,
    dependencies,
    local_chunk,
    stage_rank,
)


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

    @property
    def makespan(self) -> float:
        return max((row[-1].end for row in self.ranks if row), default=0)

    @property
    def ideal(self) -> float:
        return self.m * (self.t_f + self.t_b)

    @property
    def bubble_fraction(self) -> float:
        return (self.makespan - self.ideal) / self.ideal


def simulate(name: str, p: int, v: int, m: int, t_f=1.0, t_b=2.0, t_comm=0.0,
             batches: int = 1, t_w=None) -> Timeline:
    """Simulate schedule ``name`` on ``p`` ranks with ``v`` chunks each and ``m`` micro-batches
    per batch, over ``batches`` consecutive batches (the timeline's ``m`` is all of them)."""
    return simulate_lists(build_all(name, p, v, m, batches), p, v, m * batches, t_f, t_b, t_comm,
                          name=name, t_w=t_w)


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
) -> Timeline:
    """Simulate explicit per-rank action lists (e.g. a hand-written or broken schedule).

    ``t_update``: how long a rank's optimizer step (W, U, T) takes; other rank actions take no
    time."""
    if len(schedule) != p:
        raise ValueError(f"expected one action list per rank (p={p}), got {len(schedule)}")
    # Rank actions take no simulated time: the optimizer and reductions are outside the
    # (p-1)/m accounting, and W/E still wait for every rank's R through their dependencies.
    duration = {FORWARD: t_f / v, BACKWARD: t_b / v, **{kind: 0 * t_f for kind in RANK_ACTIONS},
                **{kind: t_update for kind in (WEIGHTS, UPDATE, TIED)}}
    if any(a.kind == WEIGHT_GRAD for row in schedule for a in row):  # split backwards
        t_w = t_b / 2 if t_w is None else t_w
        duration.update({BACKWARD: (t_b - t_w) / v, WEIGHT_GRAD: t_w / v})
    finished: dict[Action, float] = {}  # action -> end time
    rows: list[list[Slot]] = [[] for _ in range(p)]

    def ready_time(action: Action, rank: int):
        """When ``action``'s inputs are available on ``rank``, or None if some are not done."""
        ready = 0
        for dep in dependencies(action, p, v):
            if dep not in finished:
                return None
            # `and t_comm` keeps exact (Fraction) arithmetic when the default 0.0 is used
            latency = t_comm if stage_rank(dep.stage, p) != rank and t_comm else 0
            ready = max(ready, finished[dep] + latency)
        return ready

    def advance(rank: int) -> bool:
        """Run ``rank``'s next action if its inputs are done; report whether it ran."""
        row = rows[rank]
        if len(row) == len(schedule[rank]):
            return False
        action = schedule[rank][len(row)]
        _check_action(action, rank, p, duration, finished)
        ready = ready_time(action, rank)
        if ready is None:
            return False
        start = max(ready, row[-1].end if row else 0)
        end = start + duration[action.kind]
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
    return Timeline(name, p, v, m, t_f, t_b, t_comm, rows)


def place_iteration_ends(rows: list[list[Action]], p: int, v: int, m: int, *,
                         weights: bool) -> list[list[Action]]:
    """Insert ``E`` of every batch into each rank's list (and ``W`` right before it if
    ``weights``), at the first action boundary no earlier than the simulated moment the last
    rank ran that batch's ``R``; so a rank reaching ``E`` (or ``W``) finds the iteration's
    reduction already launched everywhere and never waits. A ``W`` is moved earlier if needed
    so that it precedes the rank's first forward of batch t+2, which uses its version.
    """
    timeline = simulate_lists(rows, p, v, m, t_f=Fraction(1), t_b=Fraction(2))
    done = {}  # batch -> when its last R ends
    for row in timeline.ranks:
        for slot in row:
            if slot.action.kind == REDUCE:
                batch = slot.action.mb // m
                done[batch] = max(done.get(batch, slot.end), slot.end)
    return [_insert_ends(row, rank, m, done, weights) for rank, row in enumerate(timeline.ranks)]


def _insert_ends(row: list[Slot], rank: int, m: int, done: dict, weights: bool) -> list[Action]:
    at: dict[int, list[int]] = {}    # list position -> batches whose end goes before it
    reduced = {slot.action.mb // m: i for i, slot in enumerate(row) if slot.action.kind == REDUCE}
    first_forward = {}
    for i, slot in enumerate(row):
        if slot.action.kind == FORWARD:
            first_forward.setdefault(slot.action.mb // m, i)
    last_batch = max(done)
    for batch, ready in sorted(done.items()):
        i = reduced[batch] + 1
        while i < len(row) and (row[i].start < ready or batch == last_batch
                                or row[i].action.kind == UPDATE):
            i += 1   # the window's last iteration ends after everything (the drain); a
            # PipeDream update stays with its backward (its reduction is that backward's)
        if weights:   # the new version must exist before batch + 2's first forward
            i = min(i, first_forward.get(batch + 2, len(row)))
        at.setdefault(i, []).append(batch)
    out = []
    for i in range(len(row) + 1):
        for batch in at.get(i, []):
            last = batch * m + m - 1
            out += ([Action(WEIGHTS, last, rank)] if weights else []) + [Action(END, last, rank)]
        if i < len(row):
            out.append(row[i].action)
    return out


def _check_action(action: Action, rank: int, p: int, duration: dict, finished: dict) -> None:
    if action.kind not in duration:
        raise ValueError(f"rank {rank}: cannot simulate action kind {action.kind!r} ({action})")
    if stage_rank(action.stage, p) != rank:
        raise ValueError(f"rank {rank}: {action} belongs to rank {stage_rank(action.stage, p)}")
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


# ---------------------------------------------------------------------------- picture


def render_ascii(timeline: Timeline, width: int | None = None) -> str:
    """One row per rank, time to the right, like Figs. 4.3/4.4.

    Each action is a box ``F3   |`` whose length is proportional to its duration; ``.`` is idle
    time (the bubble). With v>1 the label carries the chunk: ``F3.1`` is micro-batch 3, chunk 1.
    ``width`` is the number of columns for the whole makespan; by default it is chosen so that
    the shortest action fits its label.
    """
    slots = [s for row in timeline.ranks for s in row]
    if not slots:
        return ""

    def label(a: Action) -> str:
        chunk = "" if timeline.v == 1 else f".{local_chunk(a.stage, timeline.p)}"
        return f"{a.kind}{a.mb}{chunk}"

    if width is None:
        shortest = min(s.end - s.start for s in slots if s.end > s.start)
        longest_label = max(len(label(s.action)) for s in slots)
        width = int(round(timeline.makespan / shortest)) * (longest_label + 1)
    scale = width / timeline.makespan
    lines = [
        f"{timeline.name}: p={timeline.p} v={timeline.v} m={timeline.m}  "
        f"makespan={float(timeline.makespan):g}  bubble={float(timeline.bubble_fraction):.3f}"
    ]
    for rank, row in enumerate(timeline.ranks):
        cells = ["."] * width
        for slot in row:
            lo, hi = round(slot.start * scale), round(slot.end * scale)
            if hi <= lo:
                continue
            box = label(slot.action)[: hi - lo - 1].ljust(hi - lo - 1) + "|"
            cells[lo:hi] = box[-(hi - lo):]
        lines.append(f"rank {rank:<{len(str(timeline.p - 1))}} |" + "".join(cells))
    return "\n".join(lines)
