"""PipeDream's partitioner (§2.4.1): hierarchical dynamic program with stage
replication, for models whose layers do not all cost the same.

Level k of the machine has m_k components of level k-1 joined by links of bandwidth B_k
(level 0 is one device, m_0 = 1). For each level, bottom up:

    T^k(i->j, m) = (1/m) * max(A^{k-1}(i->j, m_{k-1}), 2(m-1) * sum_{l=i..j} |w_l| / B_k)
    A^k(i->j, m) = min( T^k(i->j, m),                                  # one stage, m replicas
                        min_{i<=s<j} min_{1<=m'<m} max(A^k(i->s, m-m'),  # a sub-pipeline,
                                                        2 a_s / B_k,     # the boundary,
                                                        T^k(s+1->j, m'))) # a last stage

with A^0(i->j, 1) = sum T_l and A^k(i->j, 1) = A^{k-1}(i->j, m_{k-1}). The answer is
A^L(0->N-1, m_L): the time of the slowest stage of the best pipeline. O(N^3 m_k^2) per level.

PTD-P pipelines replicate the whole pipeline instead of single stages (data parallelism) and
fix the number of stages to p*v: `split_stages` is the same program on one level without
replication and with exactly that many stages,

    S(j, k) = min_{s<j} max(S(s, k-1), 2 a_s / B, sum_{l=s+1..j} T_l),   S(j, 1) = sum_{l<=j} T_l,

over the profiles [embedding, layer 1..L, output layer and loss] (`transformer_layer_profiles`),
so the first stage carries the embedding and the last the loss; `stage_layers` turns the answer
into `parallel.stage_layers`. O(N^2 k).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

from ptdp.planner.compute import BYTES, head_times, layer_times
from ptdp.planner.memory import embedding_parameters, layer_parameters
from ptdp.planner.mtp import mtp_stage_parameters
from ptdp.planner.mtp_cost import depth_head_times


@dataclass(frozen=True)
class LayerProfile:
    compute: float      # T_l: forward + backward seconds for one input
    activation: float   # a_l: bytes of the layer's output
    weights: float      # w_l: bytes of the layer's parameters


@dataclass(frozen=True)
class Level:
    workers: int        # m_k: level-(k-1) components inside one level-k component
    bandwidth: float    # B_k: bytes/s of the links joining them


@dataclass(frozen=True)
class Stage:
    first: int          # first layer (inclusive)
    last: int           # last layer (inclusive)
    replicas: int       # devices running this stage (data-parallel within the stage)


@dataclass
class Partition:
    time: float                 # A^L: slowest stage's time per input
    stages: list[Stage]         # leaf stages in pipeline order, replication in devices
    levels: tuple[Level, ...]

    @property
    def devices(self) -> int:
        return sum(s.replicas for s in self.stages)

    @property
    def noam(self) -> int:
        """NUM_OPT_ACTIVE_MINIBATCHES = ceil(# workers / # replicas of the input stage)."""
        return math.ceil(self.devices / self.stages[0].replicas)

    @property
    def config(self) -> str:
        """PipeDream's notation: "2-1-1" (replicas per stage), "straight" for no replication."""
        if len(self.stages) > 1 and all(s.replicas == 1 for s in self.stages):
            return "straight"
        return "-".join(str(s.replicas) for s in self.stages)


class _Level:
    """A^k and its choices for one level, given A^{k-1} as a function of (i, j)."""

    def __init__(self, layers, level: Level, below):
        self.layers, self.level, self.below = layers, level, below
        n = len(layers)
        weights = [0.0] + list(itertools.accumulate(l.weights for l in layers))
        self.weight = lambda i, j: weights[j + 1] - weights[i]
        self.table: dict = {}
        for i in range(n):
            for j in range(i, n):
                for m in range(1, level.workers + 1):
                    self.table[i, j, m] = self._solve(i, j, m)

    def stage_time(self, i: int, j: int, m: int) -> float:
        sync = 2 * (m - 1) * self.weight(i, j) / self.level.bandwidth
        return max(self.below(i, j), sync) / m

    def _solve(self, i: int, j: int, m: int):
        best = (self.stage_time(i, j, m), None)
        for s in range(i, j):
            comm = 2 * self.layers[s].activation / self.level.bandwidth
            for m2 in range(1, m):
                cost = max(self.table[i, s, m - m2][0], comm, self.stage_time(s + 1, j, m2))
                if cost < best[0]:
                    best = (cost, (s, m2))
        return best

    def best(self, i: int, j: int) -> float:
        return self.table[i, j, self.level.workers][0]

    def stages(self, i: int, j: int, m: int) -> list[tuple[int, int, int]]:
        """(first, last, replicas in level-(k-1) components) of A^k(i->j, m)'s pipeline."""
        choice = self.table[i, j, m][1]
        if choice is None:
            return [(i, j, m)]
        s, m2 = choice
        return self.stages(i, s, m - m2) + [(s + 1, j, m2)]


def partition(layers: list[LayerProfile], levels: list[Level]) -> Partition:
    """Best pipeline of `layers` over the hierarchy `levels` (innermost first)."""
    if not layers or not levels:
        raise ValueError("need at least one layer and one level")
    if any(lv.workers < 1 or lv.bandwidth <= 0 for lv in levels):
        raise ValueError("every level needs workers >= 1 and a positive bandwidth")
    prefix = [0.0] + list(itertools.accumulate(l.compute for l in layers))
    solved: list[_Level] = []
    below = lambda i, j: prefix[j + 1] - prefix[i]  # noqa: E731 - A^0: one device, sum T_l
    for level in levels:
        solved.append(_Level(layers, level, below))
        below = solved[-1].best
    n = len(layers)
    stages = _flatten(solved, len(solved) - 1, 0, n - 1, levels[-1].workers, 1)
    return Partition(solved[-1].best(0, n - 1), stages, tuple(levels))


def _flatten(solved, k, i, j, m, multiplier) -> list[Stage]:
    """Expand level k's stages into device-level stages: each level-k stage's layers are
    pipelined inside every one of its replicated level-(k-1) components."""
    out = []
    for first, last, replicas in solved[k].stages(i, j, m):
        if k == 0:
            out.append(Stage(first, last, replicas * multiplier))
        else:
            out += _flatten(solved, k - 1, first, last, solved[k - 1].level.workers,
                            replicas * multiplier)
    return out


# --------------------------------------------------------------------------------------------
# Brute force (for tests and tiny inputs): enumerate every partition explicitly.
# --------------------------------------------------------------------------------------------

def _compositions(total: int, parts: int):
    """Positive integer tuples of length `parts` summing to `total`."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        yield tuple(b - a for a, b in zip((0,) + cuts, cuts + (total,)))


def brute_force_time(layers: list[LayerProfile], levels: list[Level]) -> float:
    """min over all contiguous splits and replica assignments, level by level (the same
    objective as `partition`, without its optimal-substructure recursion)."""

    @lru_cache(maxsize=None)
    def best(k: int, i: int, j: int) -> float:
        if k < 0:
            return sum(l.compute for l in layers[i:j + 1])
        level = levels[k]
        weight = lambda a, b: sum(l.weights for l in layers[a:b + 1])  # noqa: E731
        result = math.inf
        n = j - i + 1
        for num_stages in range(1, min(n, level.workers) + 1):
            for cuts in itertools.combinations(range(i + 1, j + 1), num_stages - 1):
                bounds = list(zip((i,) + cuts, tuple(c - 1 for c in cuts) + (j,)))
                comm = max((2 * layers[c - 1].activation / level.bandwidth for c in cuts),
                           default=0.0)
                for reps in _compositions(level.workers, num_stages):
                    stage = max(max(best(k - 1, a, b), 2 * (r - 1) * weight(a, b) / level.bandwidth) / r
                                for (a, b), r in zip(bounds, reps))
                    result = min(result, max(stage, comm))
        return result

    return best(len(levels) - 1, 0, len(layers) - 1)


# --------------------------------------------------------------------------------------------
# Layer profiles of a transformer from the cost model (measured profile when available)
# --------------------------------------------------------------------------------------------

def transformer_layer_profiles(hw, shape, micro_batch: int, precision: str,
                               attention: str | None = None, t: int = 1) -> list[LayerProfile]:
    """[embedding, layer 1..l, head] for one device of a t-way tensor group, as PipeDream's
    profiler would record them: T_l forward+backward, a_l output bytes, w_l weight bytes. The
    head is the final norm, the output layer and the vocab-parallel loss, and the
    multi-token-prediction depths (a layer each and their heads: mtp_cost.depth_head_times)."""
    from ptdp.config import padded_vocab_size
    attention = attention or hw.attention
    e = BYTES[precision]
    vocab = padded_vocab_size(shape.vocab, t)
    act = shape.seq * micro_batch * shape.hidden * e
    lt = layer_times(hw, precision, shape, micro_batch, t, attention)
    ht = head_times(hw, precision, shape, micro_batch, t, vocab)
    embed = LayerProfile(ht.embed_forward + ht.embed_backward, act,
                         embedding_parameters(shape, t, vocab) * e)
    body = LayerProfile(lt.forward + lt.backward, act, layer_parameters(shape, t) * e)
    depths = shape.mtp_layers * (body.compute + sum(depth_head_times(hw, precision, shape,
                                                                     micro_batch, t, ht)))
    head = LayerProfile(ht.head_forward + ht.head_backward + depths, 4.0 * micro_batch,
                        (vocab * shape.hidden / t + 2 * shape.hidden + mtp_stage_parameters(
                            shape, t, 1, layer_parameters(shape, t), vocab, False)) * e)
    return [embed] + [body] * shape.layers + [head]


# --------------------------------------------------------------------------------------------
# PTD-P stages: exactly p*v of them, no replication
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageSplit:
    time: float                     # the slowest stage's time per input (or boundary transfer)
    bounds: tuple[tuple[int, int], ...]   # (first, last) profile of every stage, inclusive
    times: tuple[float, ...]        # each stage's time per input

    def stage_layers(self) -> list[int]:
        """Transformer layers per stage when the profiles are [embedding, layers.., head]."""
        last = self.bounds[-1][1]
        return [b - a + 1 - (a == 0) - (b == last) for a, b in self.bounds]


def split_stages(layers: list[LayerProfile], stages: int,
                 bandwidth: float = math.inf) -> StageSplit:
    """The best split of `layers` into exactly `stages` contiguous non-empty stages, one
    device each: the slowest stage (compute, or the boundary transfer 2 a_s / B) smallest.
    Ties go to the split whose stages are cut latest, deterministically."""
    n = len(layers)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} profiles into {stages} non-empty stages")
    prefix = [0.0] + list(itertools.accumulate(l.compute for l in layers))
    span = lambda i, j: prefix[j + 1] - prefix[i]  # noqa: E731 - layers i..j on one stage
    # best[k][j]: (time, cut) of layers 0..j over k+1 stages, the last stage starting at cut
    best = [[(span(0, j), 0) for j in range(n)]]
    for k in range(1, stages):
        row = [(math.inf, None)] * n
        for j in range(k, n):
            for s in range(k - 1, j):
                cost = max(best[k - 1][s][0], 2 * layers[s].activation / bandwidth,
                           span(s + 1, j))
                if cost <= row[j][0]:
                    row[j] = (cost, s + 1)
        best.append(row)
    bounds, j = [], n - 1
    for k in range(stages - 1, -1, -1):
        start = best[k][j][1]
        bounds.append((start, j))
        j = start - 1
    bounds.reverse()
    return StageSplit(best[-1][n - 1][0], tuple(bounds), tuple(span(a, b) for a, b in bounds))


def stage_times(layers: list[LayerProfile], counts: list[int]) -> tuple[float, ...]:
    """Each stage's time per input when stage k holds counts[k] transformer layers (the
    first also the embedding, the last also the head): the even split's, or any other's."""
    ends = list(itertools.accumulate(counts))
    bounds = [(0 if k == 0 else 1 + end - c, end + (k == len(counts) - 1))
              for k, (c, end) in enumerate(zip(counts, ends))]
    return tuple(sum(l.compute for l in layers[a:b + 1]) for a, b in bounds)
