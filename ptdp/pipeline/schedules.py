"""Pipeline schedules as data (DESIGN.md, principle 1).

A schedule is a pure function ``(name, p, v, m, rank) -> list[Action]``: the compute actions one
pipeline rank runs, in order, for one training iteration (one batch of ``m`` micro-batches). The
same lists drive the executor, the unit tests, the planner's bubble estimate and the timeline
picture (``ptdp.pipeline.timeline``). Nothing here imports torch.

Stages. The layer stack is cut into ``p * v`` *virtual stages*; global virtual stage ``s`` holds
layers ``[s * L/(p*v), (s+1) * L/(p*v))`` and runs on rank ``s % p`` as that rank's chunk
``s // p`` (round-robin by chunk, as in the dissertation §4.2.2: with p=4, v=2, rank 0 holds
stages 0 and 4). With ``v == 1`` a stage is simply a rank.

Dependencies (``dependencies()``). ``F(mb, s)`` needs ``F(mb, s-1)``; ``B(mb, s)`` needs
``F(mb, s)`` (same rank, for the stashed activations) and ``B(mb, s+1)``; the last stage's
backward needs only its own forward. Sends are asynchronous, so a rank only ever waits on the
*inputs* of its next action; a schedule is valid when every rank can run its list strictly in
order under these rules (``timeline.simulate`` checks this and names the stuck rank otherwise).

Schedules. All three are one shape, ``_one_f_one_b(forwards, backwards, warmup)``: ``warmup``
forwards, then alternate one forward and one backward, then drain the remaining backwards. They
differ only in the order of the (micro-batch, chunk) work and in the warm-up length:

===========  =========================  =================================  ================
name         forward order              warm-up forwards on ``rank``       in flight
===========  =========================  =================================  ================
gpipe        chunk-major, mb 0..m-1     all of them (no steady state)      m * v
1f1b (v=1)   mb 0..m-1                  min(p - rank - 1, m)               min(p - rank, m)
interleaved  groups of p mbs per chunk  min(2(p-rank-1) + (v-1)p, m*v)     warm-up + 1
===========  =========================  =================================  ================

"In flight" counts (micro-batch, stage) pairs whose forward ran and backward has not (the
activation stashes a rank holds; ``max_in_flight``). For interleaved each such stash is one
chunk, i.e. 1/v of the rank's layers, so rank 0's bound of ``(v+1)p - 1`` chunk stashes is about
``p + (p-1)/v`` micro-batches' worth: Table 7.1's "(1, p)" up to the warm-up overhang. This is
Megatron-LM's bound for its interleaved schedule.

Bubble (``timeline.simulate``, no communication cost, any t_b/t_f): exactly (p-1)/m for gpipe and
1f1b, and (p-1)/(v*m) for interleaved; gpipe with v>1 (the "all-forward, all-backward" version
of interleaving, §4.2.2) also reaches (p-1)/(v*m) once m >= p.

Backwards always run in ascending micro-batch order (GPipe too, as in Fig. 4.3); for several
chunks they visit the chunks in reverse, since gradients flow from the last stage back.

Extending. PipeDream-2BW and PipeDream (async) will be more entries in ``_BUILDERS`` and more
action kinds (e.g. ``"W"`` where a stage generates its next weight version), with a duration in
the simulator and a rule in ``dependencies()``. Neither flushes, so their lists will cover a
window of consecutive batches (micro-batch indices numbered across the window) rather than one;
for 2BW that is ``_one_f_one_b`` over all the window's micro-batches with a "W" after each batch's
last backward on the stage. The ``Action`` record and the executor's contract stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    """One unit of work on one rank: ``kind`` for micro-batch ``mb`` on global virtual ``stage``."""

    kind: str  # "F" (forward) or "B" (backward); later kinds may be added
    mb: int  # micro-batch index 0..m-1 within the iteration
    stage: int  # GLOBAL virtual stage index 0..p*v-1

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}@s{self.stage}"


# ---------------------------------------------------------------------------- stage placement


def stage_rank(stage: int, p: int) -> int:
    """The pipeline rank that runs global virtual stage ``stage``."""
    return stage % p


def local_chunk(stage: int, p: int) -> int:
    """Which of its rank's ``v`` model chunks global virtual stage ``stage`` is."""
    return stage // p


def rank_stages(rank: int, p: int, v: int) -> list[int]:
    """Global virtual stages held by ``rank``, by chunk: ``[rank, rank+p, ..., rank+(v-1)p]``."""
    return [rank + chunk * p for chunk in range(v)]


def stage_layers(stage: int, p: int, v: int, num_layers: int) -> range:
    """Transformer layers held by global virtual stage ``stage`` (layers split evenly)."""
    if num_layers % (p * v):
        raise ValueError(
            f"num_layers={num_layers} must be divisible by p*v={p}*{v}={p * v} "
            "so that every virtual stage holds the same number of layers"
        )
    per_stage = num_layers // (p * v)
    return range(stage * per_stage, (stage + 1) * per_stage)


def dependencies(action: Action, p: int, v: int) -> list[Action]:
    """Actions (on any rank) that must have finished before ``action`` can start."""
    if action.kind == FORWARD:
        return [] if action.stage == 0 else [Action(FORWARD, action.mb, action.stage - 1)]
    if action.kind == BACKWARD:
        deps = [Action(FORWARD, action.mb, action.stage)]  # its own stashed activations
        if action.stage < p * v - 1:  # the last stage starts backward from the loss
            deps.append(Action(BACKWARD, action.mb, action.stage + 1))
        return deps
    raise ValueError(f"unknown action kind {action.kind!r} in {action}")


# ---------------------------------------------------------------------------- schedules


def _one_f_one_b(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then one-forward-one-backward pairs, then the remaining backwards.

    With ``warmup >= len(forwards)`` this is all-forward-all-backward (GPipe).
    """
    warmup = min(warmup, len(forwards))
    steady = [a for pair in zip(forwards[warmup:], backwards) for a in pair]
    cooldown = backwards[len(forwards) - warmup :]
    return forwards[:warmup] + steady + cooldown


def _megatron_order(p: int, v: int, m: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) in Megatron's interleaved order: p micro-batches per chunk in turn.

    For p=2, v=2, m=4: (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1). With v=1 it is just
    micro-batches 0..m-1 (and then ``m`` need not be a multiple of ``p``).
    """
    order = []
    for k in range(m * v):
        group, in_group = divmod(k, p * v)
        chunk, offset = divmod(in_group, p)
        order.append((group * p + offset, chunk))
    return order


def _gpipe(p: int, v: int, m: int, rank: int) -> list[Action]:
    # Chunk-major forwards keep each chunk busy on m micro-batches before the next chunk needs
    # the first of them back from the other ranks; backwards mirror that, last chunk first.
    stages = rank_stages(rank, p, v)
    forwards = [Action(FORWARD, mb, s) for s in stages for mb in range(m)]
    backwards = [Action(BACKWARD, mb, s) for s in reversed(stages) for mb in range(m)]
    return _one_f_one_b(forwards, backwards, warmup=len(forwards))


def _flush_1f1b(p: int, v: int, m: int, rank: int) -> list[Action]:
    # PipeDream-Flush: rank r runs p-r-1 forwards before its first backward can arrive, which
    # caps its activation stashes at p - r (§3.2.2, Fig. 4.4 top).
    if v != 1:
        raise ValueError(f"schedule '1f1b' needs v=1 (got v={v}); use 'interleaved' for v > 1")
    forwards = [Action(FORWARD, mb, rank) for mb in range(m)]
    backwards = [Action(BACKWARD, mb, rank) for mb in range(m)]
    return _one_f_one_b(forwards, backwards, warmup=p - rank - 1)


def _interleaved(p: int, v: int, m: int, rank: int) -> list[Action]:
    if v == 1:  # one chunk per rank: nothing to interleave, and no m % p constraint
        return _flush_1f1b(p, v, m, rank)
    if m % p:
        raise ValueError(
            f"schedule 'interleaved' needs the number of micro-batches m to be a multiple of "
            f"the pipeline size p (got m={m}, p={p}); micro-batches go through in groups of p"
        )
    order = _megatron_order(p, v, m)
    forwards = [Action(FORWARD, mb, rank + chunk * p) for mb, chunk in order]
    backwards = [Action(BACKWARD, mb, rank + (v - 1 - chunk) * p) for mb, chunk in order]
    # Megatron's warm-up: the first backward reaches rank r only after the first p micro-batches
    # went through all (v-1) earlier chunks of every rank, plus the round trip to the last rank.
    warmup = 2 * (p - rank - 1) + (v - 1) * p
    return _one_f_one_b(forwards, backwards, warmup)


_BUILDERS: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "gpipe": _gpipe,
    "1f1b": _flush_1f1b,
    "interleaved": _interleaved,
}
SCHEDULES: tuple[str, ...] = tuple(_BUILDERS)


def build_schedule(name: str, p: int, v: int, m: int, rank: int) -> list[Action]:
    """The compute actions of pipeline ``rank``, in execution order, for one iteration."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    for key, value in (("p", p), ("v", v), ("m", m)):
        if value < 1:
            raise ValueError(f"schedule {name!r}: {key} must be >= 1 (got {key}={value})")
    if not 0 <= rank < p:
        raise ValueError(f"schedule {name!r}: rank must be in [0, {p}) (got rank={rank})")
    return _BUILDERS[name](p, v, m, rank)


def build_all(name: str, p: int, v: int, m: int) -> list[list[Action]]:
    """Every rank's action list, indexed by rank."""
    return [build_schedule(name, p, v, m, rank) for rank in range(p)]


# ---------------------------------------------------------------------------- inspection


def max_in_flight(actions: list[Action]) -> int:
    """Most (mb, stage) pairs whose forward ran and backward has not yet, over the list."""
    live: set[tuple[int, int]] = set()
    peak = 0
    for a in actions:
        if a.kind == FORWARD:
            live.add((a.mb, a.stage))
            peak = max(peak, len(live))
        elif a.kind == BACKWARD:
            live.discard((a.mb, a.stage))
    return peak


def format_schedule(name: str, p: int, v: int, m: int) -> str:
    """One row per rank listing its actions in order, columns aligned by position.

    With v=1 a token is ``F3`` (the stage is the rank); with v>1 it is ``F3@s5`` (global stage).
    """
    rows = build_all(name, p, v, m)
    tokens = [[f"{a.kind}{a.mb}" if v == 1 else str(a) for a in row] for row in rows]
    width = max(len(t) for row in tokens for t in row)
    label = len(str(p - 1))
    lines = [
        f"rank {r:<{label}}: " + " ".join(t.ljust(width) for t in row).rstrip()
        for r, row in enumerate(tokens)
    ]
    return "\n".join(lines)
