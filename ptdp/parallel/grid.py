"""The rank grid: named axes, and every process group asked for by axis names.

The world's ranks are laid out over named axes, outermost first (Megatron's order):

    pipeline, data, context, tensor      rank = ((p_idx * d + d_idx) * c + c_idx) * t + t_idx

so the t ranks of a tensor group are adjacent (on a cluster they share a node and NVLink), the
c ranks of a context ring come next (their ring traffic is per layer, so they too should share
a node where possible), and a pipeline stage's d*c*t ranks are contiguous. With c = 1 (the
default) the layout and the groups are exactly those of the (p, d, t) grid.

A group is a set of axes: `grid.group("data", "context")` holds the ranks that differ from
this one only along data and context (every rank holding the same weights: gradients are
summed over it, each data rank having seen other sequences, each context rank other tokens of
the same ones). `grid.ranks(...)` lists them, ordered along the named axes outermost first;
`grid.size(...)` counts them; `grid.index(...)` is this rank's place among them and
`grid.coordinate(axis)` along one axis. Which axes are named, and in what order, does not
matter: a set is a set. `axis_rows` computes every group of a set from the layout alone, with
no process group, for placement checks and tests (ptdp/parallel/placement.py).

The groups the trainer uses (`GROUPS`) are created once, eagerly, in `RankGrid.__init__`, in
that fixed order on every rank (a torch.distributed requirement: every rank takes part in
creating every group, in the same order). Asking for a set that is not in `GROUPS` is an error
rather than a lazy creation, which one rank could reach without the others. Each set gets its
own process group even where two sets have the same members (tensor and pipeline x tensor with
p = 1): a communicator orders its work by issue order, and keeping sets apart keeps the
asynchronous gradient buckets of one from queueing behind the other's traffic. Sets of one
rank are real groups too; callers skip communication on them by `size()`.
A later grid in the same process (a second trainer) reuses the groups an earlier one made
for the same set, members and timeout, rather than leaving the earlier ones open for the rest
of the process (`new_groups`); a trainer's collectives all run on its training thread, so two
trainers taking turns use a shared group in one order on every rank.

Beside the axes is the one group that is not a slice of them: the embedding group, the
pipeline stages holding a copy of the tied word embedding (first and last stage by default,
`embedding_pipeline_ranks`), same data, context and tensor coordinates.

Expert parallelism (e > 1) adds an axis the way any axis is added: a second layout over the
same rank order, the data x context ranks of a stage (data-major, as the first layout
flattens them) cut into expert_data x expert, expert innermost,

    (("pipeline", p), ("expert_data", d * c // e), ("expert", e), ("tensor", t))

so an expert group is e consecutive data x context ranks (context ranks first: near each
other), as Megatron's expert groups sit inside its data-parallel ranks; its sets
(`EXPERT_GROUPS`: ("expert",), the all-to-all's, and ("expert_data",), the ranks holding the
same experts, over which their gradients are summed) are created after `GROUPS`, only when
e > 1. `group()`, `ranks()`, `size()` and `coordinate()` answer for any names from the first
layout holding all the names asked; a parameter's role (ptdp/parallel/roles.py) names the
axes its gradient is reduced over. torch's DeviceMesh is not used: a group over several axes
(data x context, pipeline x tensor) needs its private `_flatten`, a timeout goes through
backend-specific options per dimension, and the embedding group would still sit beside it;
a layout plus one permute per set is all the grid needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

Layout = tuple[tuple[str, int], ...]   # (axis name, size), outermost first

# The axis sets the trainer communicates over, created in this order on every rank:
# tensor-parallel layers, the gradient sum and norm over the replicas, the pipeline's
# point-to-point and its loss/norm sums, the whole model (pipeline x tensor), the context ring.
GROUPS = (("tensor",), ("data",), ("pipeline",), ("pipeline", "tensor"), ("context",),
          ("data", "context"))
# With expert parallelism (e > 1), after those: the all-to-all's group, the experts' replicas.
EXPERT_GROUPS = (("expert",), ("expert_data",))


@dataclass(frozen=True)
class Coordinates:
    pipeline: int
    data: int
    tensor: int
    context: int = 0
    context_size: int = field(default=1, compare=False, repr=False)

    def __str__(self) -> str:
        c = f", c={self.context}" if self.context_size > 1 else ""
        return f"(p={self.pipeline}, d={self.data}{c}, t={self.tensor})"


def grid_layout(p: int, d: int, t: int, c: int = 1) -> Layout:
    """The four axes of a (p, t, c, d) job, outermost first."""
    return (("pipeline", p), ("data", d), ("context", c), ("tensor", t))


def expert_layout(p: int, d: int, t: int, c: int, e: int) -> Layout:
    """The expert layout of a (p, t, c, d) job with e expert ranks (module docstring)."""
    return (("pipeline", p), ("expert_data", d * c // e), ("expert", e), ("tensor", t))


def axis_rows(layout: Layout, names: Iterable[str]) -> list[list[int]]:
    """Every group of the axes `names`: the ranks differing only along those axes, each group
    ordered along them (outermost first), the groups ordered along the other axes."""
    order = [name for name, _ in layout]
    names = set(names)
    if not names <= set(order):
        raise ValueError(f"no axis {sorted(names - set(order))} in {order}")
    asked = [i for i, name in enumerate(order) if name in names]
    others = [i for i in range(len(order)) if i not in asked]
    sizes = [size for _, size in layout]
    ranks = torch.arange(math.prod(sizes)).reshape(sizes).permute(others + asked)
    return ranks.reshape(-1, math.prod(sizes[i] for i in asked)).tolist()


def group_rows(p: int, d: int, t: int, c: int = 1) -> dict[str, list[list[int]]]:
    """Every tensor, data and pipeline group (and context and replica group when c > 1) as a
    list of world ranks, in creation order."""
    layout = grid_layout(p, d, t, c)
    kinds = {"tensor": ("tensor",), "data": ("data",), "pipeline": ("pipeline",)}
    if c > 1:
        kinds |= {"context": ("context",), "replica": ("data", "context")}
    return {kind: axis_rows(layout, names) for kind, names in kinds.items()}


def coordinates_of(rank: int, p: int, d: int, t: int, c: int = 1) -> Coordinates:
    pi, rest = divmod(rank, d * c * t)
    di, rest = divmod(rest, c * t)
    ci, ti = divmod(rest, t)
    return Coordinates(pi, di, ti, ci, c)


def embedding_rows(p: int, d: int, t: int, c: int = 1,
                   stages: Sequence[int] | None = None) -> list[list[int]]:
    """The embedding groups: for each (data, context, tensor) coordinate, the ranks of the
    pipeline stages `stages` (default: first and last)."""
    stages = tuple(dict.fromkeys((0, p - 1) if stages is None else stages))
    if not stages or any(not 0 <= s < p for s in stages):
        raise ValueError(f"embedding pipeline ranks {stages} are not stages of {p}")
    chosen = torch.arange(p * d * c * t).reshape(p, d * c * t)[list(stages)]
    return chosen.t().tolist()


# The groups earlier grids of this process made, by (set, rows, timeout), and the world they
# belong to. A process that builds several trainers (tests, benchmarks, tools, a notebook)
# would otherwise keep every group of every one of them: each is a communicator with its own
# threads and sockets, and each of gloo's I/O threads wakes every 10 ms, idle or not.
_MADE: dict = {"world": None, "groups": {}}


def new_groups(rows: list[list[int]], timeout: timedelta | None = None,
               reuse_as: str | None = None) -> list:
    """One process group per row, created in order (every rank must call this with the same
    rows): the only place ptdp creates process groups (tests/test_architecture.py).

    `reuse_as` names the set the rows are for: a later call with the same name, rows and
    timeout in the same world returns the groups made the first time. Every rank makes the
    same calls in the same order, so every rank reuses the same groups, and a set keeps a
    group of its own as before (`RankGrid`)."""
    if _MADE["world"] is not dist.group.WORLD:   # a new world: the old groups died with it
        _MADE["world"], _MADE["groups"] = dist.group.WORLD, {}
    key = (reuse_as, tuple(map(tuple, rows)), timeout)
    if reuse_as is not None and key in _MADE["groups"]:
        return _MADE["groups"][key]
    kwargs = {} if timeout is None else {"timeout": timeout}
    groups = [dist.new_group(row, **kwargs) for row in rows]
    if reuse_as is not None:
        _MADE["groups"][key] = groups
    return groups


class RankGrid:
    """This rank's place in the grid of a (p, t, c, d) job, and its process groups.

    Every rank creates every group of `GROUPS` and the embedding groups, in the same order,
    and keeps the ones it belongs to (module docstring).
    """

    def __init__(self, pipeline: int, tensor: int, data: int, timeout_s: float = 600.0,
                 context: int = 1, embedding_pipeline_ranks: tuple[int, ...] | None = None,
                 expert: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("RankGrid needs torch.distributed to be initialised first")
        world = dist.get_world_size()
        if pipeline * tensor * context * data != world:
            raise ValueError(f"p*t*c*d = {pipeline}*{tensor}*{context}*{data} != world size "
                             f"{world}")
        if (data * context) % expert:
            raise ValueError(f"e = {expert} does not divide d*c = {data}*{context}")
        self.p, self.t, self.d, self.c, self.e = pipeline, tensor, data, context, expert
        self.rank = dist.get_rank()
        self.coords = coordinates_of(self.rank, pipeline, data, tensor, context)
        self.layouts: list[Layout] = [grid_layout(pipeline, data, tensor, context)]
        timeout = timedelta(seconds=timeout_s)
        self._groups: dict[tuple[str, ...], tuple[object, list[int]]] = {}
        if expert > 1:
            self.layouts.append(expert_layout(pipeline, data, tensor, context, expert))
        for names in GROUPS + (EXPERT_GROUPS if expert > 1 else ()):
            key = self._key(names)
            self._groups[key] = self._build(axis_rows(self._layout_of(key), key), timeout,
                                            "+".join(key))
        # the only groups that leave ranks out: the middle pipeline stages hold no embedding
        self.embedding_group, self.embedding_ranks = self._build(
            embedding_rows(pipeline, data, tensor, context, embedding_pipeline_ranks), timeout,
            "embedding")

    def _build(self, rows: list[list[int]], timeout: timedelta, name: str):
        """One group per row (an earlier grid's where it made the same, `new_groups`); return
        (group, ranks) of mine, (None, []) if none is."""
        mine = (None, [])
        for row, group in zip(rows, new_groups(rows, timeout, reuse_as=name)):
            if self.rank in row:
                mine = (group, row)
        return mine

    # Asked by names -----------------------------------------------------------------------
    def _layout_of(self, names: Iterable[str]) -> Layout:
        names = set(names)
        for layout in self.layouts:
            if names <= {name for name, _ in layout}:
                return layout
        raise ValueError(f"no layout of the grid has the axes {sorted(names)}")

    def _key(self, names: Iterable[str]) -> tuple[str, ...]:
        """`names` in their layout's order (outermost first): one key per set."""
        names = set(names)
        return tuple(name for name, _ in self._layout_of(names) if name in names)

    def group(self, *names: str):
        """The process group over the axes `names` holding this rank."""
        key = self._key(names)
        if key not in self._groups:
            raise ValueError(f"no group over {key}: the grid creates the sets of GROUPS "
                             f"(ptdp/parallel/grid.py) at construction; add it there")
        return self._groups[key][0]

    def ranks(self, *names: str) -> list[int]:
        """World ranks of the group over `names` holding this rank, outermost axis first."""
        key = self._key(names)
        if key in self._groups:
            return list(self._groups[key][1])
        return next(row for row in axis_rows(self._layout_of(key), key) if self.rank in row)

    def size(self, *names: str) -> int:
        sizes = dict(self._layout_of(names))
        return math.prod(sizes[name] for name in set(names))

    def index(self, *names: str) -> int:
        """This rank's place in its group over `names` (0 .. size - 1)."""
        return self.ranks(*names).index(self.rank)

    def coordinate(self, name: str) -> int:
        """This rank's index along the axis `name`."""
        return self.index(name)

    # The four axes' coordinates, as most callers want them --------------------------------
    @property
    def tp_rank(self) -> int:
        return self.coords.tensor

    @property
    def dp_rank(self) -> int:
        return self.coords.data

    @property
    def pp_rank(self) -> int:
        return self.coords.pipeline

    @property
    def cp_rank(self) -> int:
        return self.coords.context
