"""Pipeline schedules as data (pure functions of (p, v, m), checked before anything runs).

A schedule is a pure function ``(name, p, v, m, rank, batches=1) -> list[Action]``: the actions
one pipeline rank runs, in order, for ``batches`` consecutive training iterations of ``m``
micro-batches each (the flushing schedules repeat one iteration's list; the no-flush ones below
are one stream). The same lists drive the executor, the unit tests, the planner's bubble
estimate and the timeline picture (``ptdp.pipeline.timeline``). Nothing here imports torch.

The catalogue (ptdp/config/catalogue.py) names the schedules and their traits; this module
binds each name to its builder: the flushing ones (ptdp/pipeline/flushing.py) repeat one
iteration's list, the no-flush ones (ptdp/pipeline/no_flush.py) are one stream whose iteration
ends are placed by simulating every rank. Each builder gets the schedule's ``StageMap``
(``spec.stage_map(p, v)``: which stages each rank holds, ptdp/config/stages.py). The vocabulary
of actions and stages is ptdp/pipeline/actions.py.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

from ptdp.config.catalogue import (GPIPE, INTERLEAVED, NAMES, ONE_F_ONE_B, PIPEDREAM, TWO_BW,
                                   ZERO_BUBBLE_H1, schedule_spec)
from ptdp.config.stages import StageMap
from ptdp.pipeline.actions import (Action, BACKWARD, FORWARD, RANK_ACTIONS, WEIGHT_GRAD,
                                   split_units)
from ptdp.pipeline.flushing import _flush_1f1b, _gpipe, _interleaved, _split_cooldown, _zb_h1
from ptdp.pipeline.no_flush import _pipedream_skeleton, _two_bw_skeleton, place_iteration_ends


def _repeat(builder: Callable[[StageMap, int, int], list[Action]], split_cooldown=False):
    """A flushing schedule over ``batches`` consecutive iterations: one after the other (each
    with its cooldown's backwards split where the catalogue says so)."""
    def window(stages: StageMap, m: int, rank: int, batches: int) -> list[Action]:
        one = builder(stages, m, rank)
        one = _split_cooldown(one) if split_cooldown else one
        return [Action(a.kind, a.mb + t * m, a.stage) for t in range(batches) for a in one]
    return window


_BUILDERS: dict[str, Callable[[StageMap, int, int, int], list[Action]]] = {
    GPIPE.name: _repeat(_gpipe, GPIPE.split_cooldown),
    ONE_F_ONE_B.name: _repeat(_flush_1f1b, ONE_F_ONE_B.split_cooldown),
    INTERLEAVED.name: _repeat(_interleaved, INTERLEAVED.split_cooldown),
    ZERO_BUBBLE_H1.name: _repeat(_zb_h1, ZERO_BUBBLE_H1.split_cooldown),
    TWO_BW.name: _two_bw_skeleton,
    PIPEDREAM.name: _pipedream_skeleton,
}
assert tuple(_BUILDERS) == NAMES, "every schedule of the catalogue has a builder, and only those"


def build_schedule(name: str, p: int, v: int, m: int, rank: int, batches: int = 1) -> list[Action]:
    """The actions of pipeline ``rank``, in execution order, for ``batches`` iterations.

    The no-flush schedules place their ``E`` (and 2BW's ``W``) by simulating every rank
    (``ptdp.pipeline.no_flush.place_iteration_ends``), so they are built for all ranks at once and cached.
    """
    return list(_build_all_cached(name, p, v, m, batches)[_checked_rank(name, p, rank)])


def build_all(name: str, p: int, v: int, m: int, batches: int = 1) -> list[list[Action]]:
    """Every rank's action list, indexed by rank."""
    return [list(row) for row in _build_all_cached(name, p, v, m, batches)]


def _checked_rank(name: str, p: int, rank: int) -> int:
    if not 0 <= rank < p:
        raise ValueError(f"schedule {name!r}: rank must be in [0, {p}) (got rank={rank})")
    return rank


@lru_cache(maxsize=64)
def _build_all_cached(name: str, p: int, v: int, m: int, batches: int) -> tuple:
    spec = schedule_spec(name)   # ValueError naming the choices for an unknown name
    for key, value in (("p", p), ("v", v), ("m", m), ("batches", batches)):
        if value < 1:
            raise ValueError(f"schedule {name!r}: {key} must be >= 1 (got {key}={value})")
    stages = spec.stage_map(p, v)
    rows = [_BUILDERS[name](stages, m, rank, batches) for rank in range(p)]
    if not spec.flushing:
        rows = place_iteration_ends(rows, stages, m, weights=not spec.update_per_input)
    return tuple(tuple(row) for row in rows)


def max_in_flight(actions: list[Action]) -> int:
    """Most (mb, stage) pairs whose forward ran and backward has not yet, over the list (with
    split backwards: whose weight-gradient pass has not, since it needs the activations)."""
    split = split_units(actions)
    live: set[tuple[int, int]] = set()
    peak = 0
    for a in actions:
        unit = (a.mb, a.stage)
        if a.kind == FORWARD:
            live.add(unit)
            peak = max(peak, len(live))
        elif a.kind == (WEIGHT_GRAD if unit in split else BACKWARD):
            live.discard(unit)
    return peak


def format_schedule(name: str, p: int, v: int, m: int, batches: int = 1) -> str:
    """One row per rank listing its actions in order, columns aligned by position.

    With v=1 a token is ``F3`` (the stage is the rank); with v>1 it is ``F3@s5`` (global
    stage). Rank actions print as ``R7`` (kind and micro-batch).
    """
    rows = build_all(name, p, v, m, batches)
    tokens = [[f"{a.kind}{a.mb}" if v == 1 or a.kind in RANK_ACTIONS else str(a) for a in row]
              for row in rows]
    width = max(len(t) for row in tokens for t in row)
    label = len(str(p - 1))
    lines = [
        f"rank {r:<{label}}: " + " ".join(t.ljust(width) for t in row).rstrip()
        for r, row in enumerate(tokens)
    ]
    return "\n".join(lines)
