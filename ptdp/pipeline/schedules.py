"""Pipeline schedules as data (pure functions of (p, v, m), checked before anything runs).

A schedule is a pure function ``(name, p, v, m, rank, batches=1) -> list[Action]``: the actions
one pipeline rank runs, in order, for ``batches`` consecutive training iterations of ``m``
micro-batches each (the flushing schedules repeat one iteration's list; the no-flush ones below
are one stream). The same lists drive the executor, the unit tests, the planner's bubble
estimate and the timeline picture (``ptdp.pipeline.timeline``). Nothing here imports torch.

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

Zero bubble (``zb-h1``, Qi et al. 2023, "Zero Bubble Pipeline Parallelism", schedule ZB-H1).
The backward is split in two: ``B`` computes only the input gradient, which the previous stage
waits for, and ``Wg`` the weight gradients, which nothing waits for until the optimizer step
(``ptdp/parallel/weight_grad.py``). The order of ``F`` and ``B`` is 1F1B's; rank ``r`` runs
``Wg(mb - r)`` right after ``B(mb)``, i.e. it keeps ``r`` weight gradients pending through
the steady state, and runs those ``r`` at the end, where 1F1B would wait for the last
backwards to come back from the later stages. The activations of a micro-batch live from its
``F`` to its ``Wg``: at most ``p - r`` (1F1B's) plus ``r`` pending, so every rank holds at most
``p`` micro-batches, 1F1B's peak (rank 0's). With ``t_F = t_B = t_W`` the bubble shrinks from
1F1B's ``(p-1)(t_F + t_B + t_W)`` to ``(p-1)(t_F + t_B - t_W)``, a third of it.

Backwards always run in ascending micro-batch order (GPipe too, as in Fig. 4.3); for several
chunks they visit the chunks in reverse, since gradients flow from the last stage back.

No-flush schedules (PipeDream-2BW and PipeDream async, dissertation chapter 3). Neither flushes, so
their lists cover a *window* of consecutive batches, micro-batch ids numbered across the window
(batch ``t`` holds micro-batches ``t*m .. t*m+m-1``, the ones a flushing schedule would run at
iteration ``t``: ``ptdp/batching.py``). Besides ``F`` and ``B`` they hold *rank actions*, which
run once per rank (``stage`` is the rank's first stage, i.e. the rank) and send nothing:

====  =====================================================================================
R     batch ``mb // m`` is complete on this rank (``mb`` its last micro-batch): its gradients
      are reduced over the data group and set aside, its losses summed; the iteration's
      reduction (gradient norm, loss) is launched to every rank.
W     2BW: this rank's next weight version, from batch ``mb // m``'s gradients; needs every
      rank's ``R`` of that batch (the global norm for clipping, the tied embedding's sum).
U     PipeDream: this rank's next weight version, from input ``mb``'s gradient alone; right
      after ``B(mb)`` (weight stashing keeps the version each in-flight input used).
T     PipeDream, last rank: input ``mb``'s update of its copy of the tied word embedding (the
      sum of both copies' gradients, known once ``U(mb)`` ran on rank 0).
E     end of iteration ``mb // m`` on this rank: the trainer's iteration boundary (losses and
      norm of the batch are known; checkpoints and validation happen here).
====  =====================================================================================

``2bw`` is ``_one_f_one_b`` over the window's micro-batches (interleaved order when v > 1) with
``R`` after each batch's last backward on the rank; micro-batch ``k`` (0-based) runs with weight
version ``max(k // m - 1, 0)`` (the dissertation's ``max(floor((k-1)/m) - 1, 0)`` for
1-based k), so a version generated by ``W`` of batch t is first used by batch t+2 and the rank holds
two versions. ``pipedream`` (v = 1) admits NOAM = ceil(workers / input-stage replicas) = p
inputs at start-up (rank r runs p - r forwards before its first backward), then 1F1B with ``U``
after every backward; the last rank applies ``T(j)`` just before ``F(j + p)``, so its copy of the
tied embedding always has the version rank 0 used for the same input. ``E`` (and 2BW's ``W``,
just before it) are placed by simulated time (``timeline.place_iteration_ends``): on every rank
at the first action boundary no earlier than the moment the last rank finishes the batch, so no
rank waits for the iteration's reduction; for 2BW no later than the rank's first forward of batch
t+2, which needs the new version. ``dependencies()`` holds the rules that tie ranks together
(W and E wait for every rank's R, T for rank 0's U).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

FORWARD = "F"
BACKWARD = "B"    # the whole backward, or with zb-h1 only the input gradient
WEIGHT_GRAD = "Wg"  # zb-h1: the weight gradients of a micro-batch's B on the same stage
REDUCE = "R"      # rank actions of the no-flush schedules (module docstring)
WEIGHTS = "W"
UPDATE = "U"
TIED = "T"
END = "E"
COMPUTE = (FORWARD, BACKWARD, WEIGHT_GRAD)
RANK_ACTIONS = (REDUCE, WEIGHTS, UPDATE, TIED, END)
NO_FLUSH = ("2bw", "pipedream")
SPLIT_BACKWARD = ("zb-h1",)   # schedules with weight-gradient passes (Wg)


@dataclass(frozen=True)
class Action:
    """One unit of work on one rank: ``kind`` for micro-batch ``mb`` on global virtual ``stage``."""

    kind: str  # "F" (forward), "B" (backward), "Wg" (weight gradients) or a rank action
    mb: int  # micro-batch index (0..m-1, or across the window for the no-flush schedules)
    stage: int  # GLOBAL virtual stage index 0..p*v-1 (a rank action: the rank)

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
    if action.kind == WEIGHT_GRAD:  # the B of the same micro-batch and stage left it pending
        return [Action(BACKWARD, action.mb, action.stage)]
    if action.kind in (WEIGHTS, END):  # the iteration's reduction spans every rank
        return [Action(REDUCE, action.mb, rank) for rank in range(p)]
    if action.kind == TIED:  # the other copy's gradient comes from rank 0's update
        return [Action(UPDATE, action.mb, 0)]
    if action.kind in (REDUCE, UPDATE):
        return []
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


def _zb_h1(p: int, v: int, m: int, rank: int) -> list[Action]:
    """1F1B's F and B order; ``Wg(mb - rank)`` after ``B(mb)``, the last ``rank`` at the end."""
    if v != 1:
        raise ValueError(f"schedule 'zb-h1' needs v=1 (got v={v})")
    out = []
    for a in _flush_1f1b(p, 1, m, rank):
        out.append(a)
        if a.kind == BACKWARD and a.mb >= rank:
            out.append(Action(WEIGHT_GRAD, a.mb - rank, rank))
    return out + [Action(WEIGHT_GRAD, mb, rank) for mb in range(max(m - rank, 0), m)]


def noam(workers: int, input_replicas: int) -> int:
    """NUM_OPT_ACTIVE_MINIBATCHES = ceil(workers / replicas of the input stage) (PipeDream's NOAM).

    Our grid replicates every stage d times, so p*d workers over d input replicas give p.
    """
    return -(-workers // input_replicas)


def _rank_action(kind: str, mb: int, rank: int) -> Action:
    return Action(kind, mb, rank)


def two_bw_min_micro_batches(p: int, v: int) -> int:
    """The fewest micro-batches per batch 2BW runs with: m >= p, and with v > 1 also
    m*v >= rank 0's interleaved warm-up 2(p-1) + (v-1)p (a multiple of p): otherwise rank 0
    would start batch t+2, which needs the version made from batch t, before finishing batch t.
    """
    if v == 1:
        return p
    need = -(-(2 * (p - 1) + (v - 1) * p) // v)
    return max(p, -(-need // p) * p)


def _two_bw_skeleton(p: int, v: int, m: int, rank: int, batches: int) -> list[Action]:
    """1F1B (interleaved when v > 1) over the window, ``R`` after each batch's last backward."""
    least = two_bw_min_micro_batches(p, v)
    if m < least:
        why = ("m >= p" if v == 1 else
               f"m >= p and m*v >= rank 0's interleaved warm-up 2(p-1)+(v-1)p = "
               f"{2 * (p - 1) + (v - 1) * p}")
        raise ValueError(f"schedule '2bw' needs at least {least} micro-batches per batch with "
                         f"p={p}, v={v} (got m={m}): the version made from batch t must be ready "
                         f"before batch t+2's first forward on every rank, which needs {why}")
    n = m * batches
    if v == 1:
        actions = _flush_1f1b(p, 1, n, rank)
    else:
        actions = _interleaved(p, v, n, rank)
    return _insert_rank_actions(actions, m, rank, after_kind=BACKWARD, kind=REDUCE)


def _pipedream_skeleton(p: int, v: int, m: int, rank: int, batches: int) -> list[Action]:
    """NOAM start-up, then 1F1B with ``U`` after every backward; ``R`` after each batch's last
    ``U``; on the last rank ``T(j)`` right before ``F(j + NOAM)`` (the rest at the end)."""
    if v != 1:
        raise ValueError(f"schedule 'pipedream' needs v=1 (got v={v}): PipeDream gives each "
                         f"worker one stage; interleaving is supported with '2bw'")
    n, admitted = m * batches, noam(p, 1)
    forwards = [Action(FORWARD, mb, rank) for mb in range(n)]
    backwards = [Action(BACKWARD, mb, rank) for mb in range(n)]
    actions = []
    for a in _one_f_one_b(forwards, backwards, warmup=admitted - rank - 1):
        actions.append(a)
        if a.kind == BACKWARD:
            actions.append(_rank_action(UPDATE, a.mb, rank))
    actions = _insert_rank_actions(actions, m, rank, after_kind=UPDATE, kind=REDUCE)
    if rank == p - 1 and p > 1:
        actions = _place_tied_updates(actions, n, admitted, rank)
    return actions


def _place_tied_updates(actions: list[Action], n: int, admitted: int, rank: int) -> list[Action]:
    out, applied = [], 0
    for a in actions:
        if a.kind == FORWARD:
            while applied <= a.mb - admitted:  # F(k) needs the tied copy at version k - p + 1
                out.append(_rank_action(TIED, applied, rank))
                applied += 1
        out.append(a)
    out += [_rank_action(TIED, j, rank) for j in range(applied, n)]
    return out


def _insert_rank_actions(actions: list[Action], m: int, rank: int, *, after_kind: str,
                         kind: str) -> list[Action]:
    """``kind`` (mb = the batch's last micro-batch) after the rank's last ``after_kind`` of each
    batch."""
    last = {}
    for i, a in enumerate(actions):
        if a.kind == after_kind:
            last[a.mb // m] = i
    after = {i: batch for batch, i in last.items()}
    out = []
    for i, a in enumerate(actions):
        out.append(a)
        if i in after:
            out.append(_rank_action(kind, after[i] * m + m - 1, rank))
    return out


def _repeat(builder: Callable[[int, int, int, int], list[Action]]):
    """A flushing schedule over ``batches`` consecutive iterations: one after the other."""
    def window(p: int, v: int, m: int, rank: int, batches: int) -> list[Action]:
        one = builder(p, v, m, rank)
        return [Action(a.kind, a.mb + t * m, a.stage) for t in range(batches) for a in one]
    return window


_BUILDERS: dict[str, Callable[[int, int, int, int, int], list[Action]]] = {
    "gpipe": _repeat(_gpipe),
    "1f1b": _repeat(_flush_1f1b),
    "interleaved": _repeat(_interleaved),
    "zb-h1": _repeat(_zb_h1),
    "2bw": _two_bw_skeleton,
    "pipedream": _pipedream_skeleton,
}
SCHEDULES: tuple[str, ...] = tuple(_BUILDERS)
FLUSHING: tuple[str, ...] = tuple(name for name in SCHEDULES if name not in NO_FLUSH)


def build_schedule(name: str, p: int, v: int, m: int, rank: int, batches: int = 1) -> list[Action]:
    """The actions of pipeline ``rank``, in execution order, for ``batches`` iterations.

    The no-flush schedules place their ``E`` (and 2BW's ``W``) by simulating every rank
    (``timeline.place_iteration_ends``), so they are built for all ranks at once and cached.
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
    if name not in _BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    for key, value in (("p", p), ("v", v), ("m", m), ("batches", batches)):
        if value < 1:
            raise ValueError(f"schedule {name!r}: {key} must be >= 1 (got {key}={value})")
    rows = [_BUILDERS[name](p, v, m, rank, batches) for rank in range(p)]
    if name in NO_FLUSH:
        from ptdp.pipeline.timeline import place_iteration_ends  # timeline imports this module
        rows = place_iteration_ends(rows, p, v, m, weights=name == "2bw")
    return tuple(tuple(row) for row in rows)


def weight_updates_before_forwards(actions: list[Action]) -> dict[int, int]:
    """{micro-batch: number of ``U`` before its first forward} over one rank's list.

    On rank 0 of ``pipedream`` this is the version each input is tagged with at the input
    stage, which vertical sync makes every stage use.
    """
    tags, updates = {}, 0
    for a in actions:
        if a.kind == UPDATE:
            updates += 1
        elif a.kind == FORWARD and a.mb not in tags:
            tags[a.mb] = updates
    return tags


# ---------------------------------------------------------------------------- inspection


def max_in_flight(actions: list[Action]) -> int:
    """Most (mb, stage) pairs whose forward ran and backward has not yet, over the list (with
    split backwards: whose weight-gradient pass has not, since it needs the activations)."""
    release = WEIGHT_GRAD if any(a.kind == WEIGHT_GRAD for a in actions) else BACKWARD
    live: set[tuple[int, int]] = set()
    peak = 0
    for a in actions:
        if a.kind == FORWARD:
            live.add((a.mb, a.stage))
            peak = max(peak, len(live))
        elif a.kind == release:
            live.discard((a.mb, a.stage))
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
