"""The schedule catalogue: every pipeline schedule `schedule.name` can name, with its traits.

One table, read by config validation, `ptdp check`, the planner, the pipeline builders and the
trainer; code asks a spec what a schedule does (`spec.flushing`, `spec.split_backward`,
`spec.allows_fp16`, ...) instead of comparing its name. Torch-free, importing only its
sibling ptdp/config/stages.py, so every floor of the house can read it. The schedules themselves
(the per-rank action lists) are built in ptdp/pipeline/schedules.py; the dissertation's
chapters 3-4 and docs/architecture.md describe them.

Placement (`spec.placement`, ptdp/config/stages.py): which pipeline rank holds each virtual
stage. Every schedule here is `LOOPED` (Megatron's round-robin); `spec.stage_map(p, v)` answers
for the trainer, the checkpoint, the metrics, the timeline and the pipeline's builders, and
`embedding_pipeline_ranks` names the ranks whose tied embedding copies sum gradients.

Families (`Family`): how a schedule updates the weights, which decides the trainer's step type
(ptdp/training/):

* FLUSH: every iteration ends with a pipeline flush and one optimizer step over the whole
  batch (GPipe, 1F1B, interleaved 1F1B, zero bubble): the single-process update, exactly.
* DOUBLE_BUFFERED: PipeDream-2BW, no flush; two weight versions per rank and delay-1 updates.
* ASYNC: PipeDream with weight stashing, no flush; each stage updates after every input.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

from ptdp.config.hints import suggest
from ptdp.config.stages import Placement, StageMap


class Family(enum.Enum):
    FLUSH = "flush"
    DOUBLE_BUFFERED = "double-buffered"
    ASYNC = "async"


class Chunks(enum.Enum):
    """Model chunks per pipeline rank (v) a schedule runs with."""
    ONE = "one"              # v = 1
    ALLOWED = "allowed"      # any v (interleaved order when v > 1)
    REQUIRED = "required"    # v > 1


class Planner(enum.Enum):
    """How `ptdp plan` treats a schedule."""
    SEARCHED = "searched"          # searched by default
    OPT_IN = "opt-in"              # searched with --allow-2bw (or a fixed schedule)
    NOT_MODELLED = "not modelled"  # the cost model has no formula for it


def _one(p: int, v: int) -> int:
    return 1


def two_bw_min_micro_batches(p: int, v: int) -> int:
    """The fewest micro-batches per batch 2BW runs with: m >= p, and with v > 1 also
    m*v >= rank 0's interleaved warm-up 2(p-1) + (v-1)p (a multiple of p): otherwise rank 0
    would start batch t+2, which needs the version made from batch t, before finishing batch t.
    """
    if v == 1:
        return p
    need = -(-(2 * (p - 1) + (v - 1) * p) // v)
    return max(p, -(-need // p) * p)


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    family: Family = Family.FLUSH
    chunks: Chunks = Chunks.ONE
    split_backward: bool = False      # B computes input gradients only, Wg the weights' later
    # Only the cooldown's backwards are split (those after a rank's last forward, on every
    # stage but the first), each Wg right after its B: the input gradient leaves a W sooner
    # at every step of the drain, where the earlier stages wait for it.
    split_cooldown: bool = False
    all_forwards_first: bool = False  # GPipe: every forward of the batch before any backward
    planner: Planner = Planner.SEARCHED
    min_micro_batches: Callable[[int, int], int] = _one   # (p, v) -> fewest m per batch
    placement: Placement = Placement.LOOPED   # which rank holds each virtual stage

    def stage_map(self, p: int, v: int) -> StageMap:
        """Where this schedule puts the p*v virtual stages (ptdp/config/stages.py)."""
        return StageMap(p, v, self.placement)

    # What the family implies -------------------------------------------------------------
    @property
    def flushing(self) -> bool:
        return self.family is Family.FLUSH

    @property
    def weight_versions(self) -> bool:
        """Keeps versions of the weights (no flush): one storage per tensor, no flat buffers."""
        return not self.flushing

    @property
    def update_per_input(self) -> bool:
        """Each stage steps after every input's backward (no global step, no global norm)."""
        return self.family is Family.ASYNC

    @property
    def allows_clipping(self) -> bool:
        return not self.update_per_input

    @property
    def allows_fp16(self) -> bool:
        """A dynamic loss scale needs every stage to agree on skipping a step."""
        return not self.update_per_input

    @property
    def allows_vertical_sync(self) -> bool:
        return self.update_per_input

    @property
    def allows_distributed_optimizer(self) -> bool:
        return self.flushing

    @property
    def allows_sequence_parallel(self) -> bool:
        return self.flushing

    def interleaves(self, v: int) -> bool:
        """Runs micro-batches through several chunks per rank in Megatron's interleaved order."""
        return self.chunks is Chunks.REQUIRED or (self.chunks is Chunks.ALLOWED and v > 1)

    # Memory, as the planner and `ptdp check` count it --------------------------------------
    def in_flight(self, p: int, v: int, m: int, rank: int) -> float:
        """Micro-batches' worth of activation stashes `rank` holds at its peak (chunk stashes
        / v); ptdp.pipeline.schedules.max_in_flight counts the same from the action lists.
        GPipe keeps all m; ZB-H1 min(p, m) (1F1B's p - rank plus rank pending weight
        gradients); 1F1B, 2BW and PipeDream min(p - rank, m); interleaved
        min(2(p-rank-1) + (v-1)p, m*v) + 1 chunk stashes (2BW with v > 1 the same without the
        cap: it never drains)."""
        if self.all_forwards_first:
            return m
        if self.split_backward:
            return min(p, m)
        if self.interleaves(v):
            chunks = 2 * (p - rank - 1) + (v - 1) * p
            if self.flushing:
                chunks = min(chunks, m * v)
            return (chunks + 1) / v
        return min(p - rank, m)

    def weight_copies(self, p: int, rank: int, vertical_sync: bool = False) -> int:
        """Copies of a rank's weights: 1 when flushing, 2 for 2BW; PipeDream's weight stashing
        keeps one per in-flight input, max(p - rank, 2) with the one being made, p with
        vertical sync."""
        if self.flushing:
            return 1
        if self.update_per_input:
            return p if vertical_sync else max(p - rank, 2)
        return 2

    def gradient_copies(self, rank: int) -> int:
        """2BW holds batch t's gradients until every rank finished it while batch t+1
        accumulates; the first rank finishes last and updates at once."""
        return 2 if self.family is Family.DOUBLE_BUFFERED and rank > 0 else 1



# GPipe: all forwards, then all backwards, then a flush.
GPIPE = ScheduleSpec("gpipe", all_forwards_first=True)
# PipeDream-Flush: one forward, one backward in the steady state, then a flush; the drain's
# backwards send their input gradients before computing their weight gradients.
ONE_F_ONE_B = ScheduleSpec("1f1b", split_cooldown=True)
# 1F1B over v model chunks per rank: the bubble shrinks by v (the cooldown split as 1F1B's).
INTERLEAVED = ScheduleSpec("interleaved", chunks=Chunks.REQUIRED, split_cooldown=True)
# 1F1B with the backward split into input and weight gradients (zero bubble, ZB-H1).
ZERO_BUBBLE_H1 = ScheduleSpec("zb-h1", split_backward=True)
# PipeDream-2BW: no flush, two weight versions, delay-1 updates.
TWO_BW = ScheduleSpec("2bw", family=Family.DOUBLE_BUFFERED, chunks=Chunks.ALLOWED,
                      planner=Planner.OPT_IN, min_micro_batches=two_bw_min_micro_batches)
# PipeDream async: no flush, weight stashing, one update per input.
PIPEDREAM = ScheduleSpec("pipedream", family=Family.ASYNC, planner=Planner.NOT_MODELLED)

SCHEDULES: dict[str, ScheduleSpec] = {s.name: s for s in (
    GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE_H1, TWO_BW, PIPEDREAM)}
NAMES: tuple[str, ...] = tuple(SCHEDULES)
DEFAULT = ONE_F_ONE_B
# Validation runs GPipe's forwards: all of them, nothing to backward, no weights to version.
FORWARD_ONLY = GPIPE


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of schedule `name`; ValueError naming the choices for an unknown one."""
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(NAMES)}"
                         f"{suggest(name, NAMES)}")
    return spec


def embedding_pipeline_ranks(spec: ScheduleSpec, p: int, v: int) -> tuple[int, ...]:
    """The pipeline ranks holding the first and the last virtual stage under `spec`: the
    embedding group's (its tied word-embedding copies sum their gradients). (0, p-1) for every
    schedule in the catalogue when p > 1; one rank when it holds both."""
    return spec.stage_map(p, v).first_and_last_ranks()


def names_where(predicate: Callable[[ScheduleSpec], bool]) -> tuple[str, ...]:
    """The names of the schedules whose spec satisfies `predicate`, in catalogue order."""
    return tuple(name for name, spec in SCHEDULES.items() if predicate(spec))
