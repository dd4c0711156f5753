"""Stage placement: which pipeline rank holds each virtual stage, as which of its chunks.

The layer stack is cut into ``p * v`` virtual stages (``layer_ranges``: evenly, or as
``parallel.stage_layers`` says); each of the ``p`` pipeline ranks holds ``v`` of them, its *chunks*. Where
they go is a trait of the schedule (``ScheduleSpec.placement`` in ptdp/config/catalogue.py),
and ``StageMap`` is the one place that answers it, for the builders and the simulator, the
communication plan, the trainer's chunks, the checkpoint, the metrics, the timeline and the
embedding group. Torch-free and import-free, so every floor can ask.

Placements (p = 4, v = 2, rank: stages by chunk):

* ``LOOPED``, Megatron's interleaving (dissertation §4.2.2): chunk ``c`` of rank ``r`` is stage
  ``c*p + r``; rank 0 holds 0 and 4, rank 3 holds 3 and 7. Every chunk runs down the ranks.
* ``V`` (ZB-V, DualPipe-V): even chunks run down the ranks and odd ones back up, chunk ``c`` of
  rank ``r`` is ``c*p + r`` for even ``c`` and ``c*p + p-1-r`` for odd ``c``; with v = 2 rank
  ``r`` holds ``r`` and ``2p-1-r``, so rank 0 holds the first stage and the last.

With ``v == 1`` both are the identity: stage ``r`` on rank ``r``.

Layers. ``layer_ranges`` is the one place that says which transformer layers each virtual stage
holds: ``L / (p*v)`` each by default, or the counts of ``parallel.stage_layers`` (uneven stages,
PipeDream's partitioning, dissertation §2.4.1; Megatron's first/last-stage layer counts). Layers
keep their global indices whatever the split, so checkpoints reshard between layouts. The first
and the last stage may hold none (embedding-only, loss-only); a middle stage may not, since it
would only pass its input on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate


class Placement(enum.Enum):
    LOOPED = "looped"   # chunk c of rank r: stage c*p + r
    V = "v"             # odd chunks reversed: c*p + p-1-r (v=2: rank r holds r and 2p-1-r)


@dataclass(frozen=True)
class StageMap:
    """The ``p * v`` virtual stages of one pipeline under ``placement``."""

    p: int
    v: int
    placement: Placement = Placement.LOOPED

    def __post_init__(self):
        if self.p < 1 or self.v < 1:
            raise ValueError(f"a pipeline needs p >= 1 and v >= 1 (got p={self.p}, v={self.v})")

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """Global virtual stage held by ``rank`` as its chunk ``chunk``: the placement's one
        formula, which every other question here inverts."""
        if not (0 <= rank < self.p and 0 <= chunk < self.v):
            raise ValueError(f"no chunk {chunk} on rank {rank} with p={self.p}, v={self.v}")
        if self.placement is Placement.V and chunk % 2:
            return chunk * self.p + self.p - 1 - rank
        return chunk * self.p + rank

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Global virtual stages held by ``rank``, in chunk order."""
        return tuple(self.stage(rank, chunk) for chunk in range(self.v))

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that holds global virtual stage ``stage``."""
        return self.ranks[self._checked(stage)]

    def chunk_of(self, stage: int) -> int:
        """Which of its rank's chunks global virtual stage ``stage`` is."""
        return self.chunks[self._checked(stage)]

    def first_and_last_ranks(self) -> tuple[int, ...]:
        """The ranks holding the first and the last stage, ascending and without repeats: the
        word embedding's and the output layer's, whose tied copies sum their gradients. One
        rank when it holds both (p = 1, or a V placement)."""
        return tuple(sorted({self.rank_of(0), self.rank_of(self.num_stages - 1)}))

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """The rank of every stage, indexed by stage, unchecked (the simulator's hot path)."""
        return tuple(rank for rank, _ in self._homes)

    @cached_property
    def chunks(self) -> tuple[int, ...]:
        """The chunk of every stage, indexed by stage."""
        return tuple(chunk for _, chunk in self._homes)

    def _checked(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"no stage {stage} with p={self.p}, v={self.v}")
        return stage

    @cached_property
    def _homes(self) -> tuple[tuple[int, int], ...]:
        """(rank, chunk) of every stage, indexed by stage: ``stage`` inverted."""
        homes = {self.stage(r, c): (r, c) for r in range(self.p) for c in range(self.v)}
        return tuple(homes[s] for s in range(self.num_stages))


def layer_counts(num_layers: int, num_stages: int, stage_layers=None) -> tuple[int, ...]:
    """Transformer layers of each virtual stage, in stage order: ``stage_layers``
    (``parallel.stage_layers``) or, when None, ``num_layers`` split evenly."""
    if stage_layers is not None:
        problem = stage_layers_problem(list(stage_layers), num_layers, num_stages)
        if problem:
            raise ValueError(problem)
        return tuple(stage_layers)
    if num_layers % num_stages:
        raise ValueError(f"num_layers={num_layers} must be divisible by p*v={num_stages} so that "
                         f"every virtual stage holds the same number of layers "
                         f"(or set parallel.stage_layers)")
    return (num_layers // num_stages,) * num_stages


def layer_ranges(num_layers: int, num_stages: int, stage_layers=None) -> tuple[range, ...]:
    """The global layer indices of each virtual stage, in stage order (``layer_counts``)."""
    counts = layer_counts(num_layers, num_stages, stage_layers)
    ends = tuple(accumulate(counts))
    return tuple(range(end - count, end) for count, end in zip(counts, ends))


def stage_layers_problem(counts: list, num_layers: int, num_stages: int) -> str | None:
    """The first thing wrong with ``parallel.stage_layers = counts``, in one line, or None."""
    key = "parallel.stage_layers"
    if len(counts) != num_stages:
        return (f"{key} has {len(counts)} entries; it needs one per virtual stage, "
                f"parallel.pipeline * parallel.chunks = {num_stages}")
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        return f"{key} must be whole numbers of layers, got {counts}"
    negative = [c for c in counts if c < 0]
    if negative:
        return f"{key} has a negative layer count ({negative[0]}): {counts}"
    if sum(counts) != num_layers:
        return (f"{key} sums to {sum(counts)} layers but model.num_layers is {num_layers}: "
                f"{counts}")
    empty = [s for s in range(1, num_stages - 1) if counts[s] == 0]
    if empty:
        return (f"{key}: stage {empty[0]} holds no layers; only the first stage (embedding only) "
                f"and the last (loss only) may be empty: {counts}")
    return None
