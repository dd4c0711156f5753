"""The flushing schedules' action lists: GPipe, 1F1B (PipeDream-Flush, its cooldown split),
interleaved 1F1B and zero bubble (ZB-H1). Pure functions of ``(stages, m, rank)``, ``stages`` the schedule's
``StageMap`` (its ``p``, ``v`` and which stages each rank holds: ptdp/config/stages.py); no torch.

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

Bubble (``ptdp.pipeline.timeline.simulate``, no communication cost, any t_b/t_f): exactly (p-1)/m for gpipe and
1f1b with whole backwards, and (p-1)/(v*m) for interleaved; gpipe with v>1 (the "all-forward,
all-backward" version of interleaving, §4.2.2) also reaches (p-1)/(v*m) once m >= p.

The cooldown split (1f1b and interleaved, the catalogue's ``split_cooldown``). After a rank's
last forward nothing but backwards is left to it, and the earlier stages wait for each of their
input gradients in turn: the drain is a chain of p - 1 hops, each a whole backward long.
``_split_cooldown`` makes each of those backwards (on any stage but stage 0, whose input
gradient nobody waits for) ``B`` then ``Wg`` at once: the input gradient is sent a weight-
gradient pass t_w sooner, and the weight gradients are computed while the next stage works.
The order of forwards and backwards, the memory (Wg right after B: the same in-flight counts)
and the arithmetic (a split backward equals a whole one to the bit,
ptdp/parallel/weight_grad.py) are PipeDream-Flush's; the bubble becomes
(p-1)(t_f + t_b - t_w)/(v*m*(t_f + t_b)) as long as t_w <= t_f (the sender must be free when
the next gradient arrives; beyond it each hop saves t_f), never more than without the split.
Only the cooldown is split: in the steady state the receiving rank is busy with a forward when
the gradient arrives, so a split there would only add its cost (docs/performance.md).

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
"""

from __future__ import annotations

from ptdp.config.stages import StageMap
from ptdp.pipeline.actions import Action, BACKWARD, FORWARD, WEIGHT_GRAD


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


def _gpipe(stages: StageMap, m: int, rank: int) -> list[Action]:
    # Chunk-major forwards keep each chunk busy on m micro-batches before the next chunk needs
    # the first of them back from the other ranks; backwards mirror that, last chunk first.
    held = stages.stages_of(rank)
    forwards = [Action(FORWARD, mb, s) for s in held for mb in range(m)]
    backwards = [Action(BACKWARD, mb, s) for s in reversed(held) for mb in range(m)]
    return _one_f_one_b(forwards, backwards, warmup=len(forwards))


def _flush_1f1b(stages: StageMap, m: int, rank: int) -> list[Action]:
    # PipeDream-Flush: rank r runs p-r-1 forwards before its first backward can arrive, which
    # caps its activation stashes at p - r (§3.2.2, Fig. 4.4 top).
    if stages.v != 1:
        raise ValueError(f"schedule '1f1b' needs v=1 (got v={stages.v}); use 'interleaved' "
                         f"for v > 1")
    stage = stages.stage(rank, 0)
    forwards = [Action(FORWARD, mb, stage) for mb in range(m)]
    backwards = [Action(BACKWARD, mb, stage) for mb in range(m)]
    return _one_f_one_b(forwards, backwards, warmup=stages.p - rank - 1)


def _split_cooldown(actions: list[Action]) -> list[Action]:
    """The cooldown sends input gradients first: each backward after the rank's last forward,
    on any stage but the first (nothing waits for stage 0's input gradient), becomes ``B``
    then ``Wg`` (module doc)."""
    last_forward = max(i for i, a in enumerate(actions) if a.kind == FORWARD)
    out = actions[:last_forward + 1]
    for a in actions[last_forward + 1:]:
        out += [a, Action(WEIGHT_GRAD, a.mb, a.stage)] if a.stage > 0 else [a]
    return out


def _interleaved(stages: StageMap, m: int, rank: int) -> list[Action]:
    p, v = stages.p, stages.v
    if v == 1:  # one chunk per rank: nothing to interleave, and no m % p constraint
        return _flush_1f1b(stages, m, rank)
    if m % p:
        raise ValueError(
            f"schedule 'interleaved' needs the number of micro-batches m to be a multiple of "
            f"the pipeline size p (got m={m}, p={p}); micro-batches go through in groups of p"
        )
    order = _megatron_order(p, v, m)
    forwards = [Action(FORWARD, mb, stages.stage(rank, chunk)) for mb, chunk in order]
    backwards = [Action(BACKWARD, mb, stages.stage(rank, v - 1 - chunk)) for mb, chunk in order]
    # Megatron's warm-up: the first backward reaches rank r only after the first p micro-batches
    # went through all (v-1) earlier chunks of every rank, plus the round trip to the last rank.
    warmup = 2 * (p - rank - 1) + (v - 1) * p
    return _one_f_one_b(forwards, backwards, warmup)


def _zb_h1(stages: StageMap, m: int, rank: int) -> list[Action]:
    """1F1B's F and B order; ``Wg(mb - rank)`` after ``B(mb)``, the last ``rank`` at the end."""
    if stages.v != 1:
        raise ValueError(f"schedule 'zb-h1' needs v=1 (got v={stages.v})")
    stage = stages.stage(rank, 0)
    out = []
    for a in _flush_1f1b(stages, m, rank):
        out.append(a)
        if a.kind == BACKWARD and a.mb >= rank:
            out.append(Action(WEIGHT_GRAD, a.mb - rank, stage))
    return out + [Action(WEIGHT_GRAD, mb, stage) for mb in range(max(m - rank, 0), m)]
