"""What a parameter is to the reductions, norms and checkpoints: its role, one declared attribute.

Layers declare a parameter's role where they create it (ptdp/parallel/layers.py,
ptdp/parallel/sequence.py, models/embedding.py, models/bert.py); everything that treats
parameters differently (gradient reductions and norms in ptdp/optim/, sharding and
checkpoints, weight versions) reads it through `role_of`. A master copy of a parameter
carries the same role (`copy_role`).

A role also says where the parameter lives on the grid (ptdp/parallel/grid.py): the axes its
gradient is summed over (`reduce_axes`: the ranks holding the same tensor and seeing other
data), which the distributed optimizer shards it over too. The ranks of one such group hold
one copy; the first of them (index 0 in the group) writes it in a checkpoint and counts it in
the gradient norm (`writes`). A dense parameter is the same on every data and context rank;
an expert's is reduced over fewer axes, the others telling experts apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamRole:
    tp_split_dim: int | None = None   # split over the tensor group along this dim; None: replicated
    vocab_padded: bool = False        # rows padded to the padded vocabulary (trimmed when whole)
    shared_embedding: bool = False    # the word embedding, tied between first and last stage
    duplicate: bool = False           # the last stage's copy of it: counted and saved once
    sequence_parallel: bool = False   # replicated, but applied to 1/t of the tokens (SP) or of
    #                                   the heads (QK-norm): its gradient is summed over the
    #                                   tensor group
    reduce_axes: tuple[str, ...] = ("data", "context")   # grid axes its gradient is summed over


REPLICATED = ParamRole()
ROLE_ATTRIBUTE = "role"


def role_of(param) -> ParamRole:
    """The declared role of `param` (replicated, nothing special, if none was declared)."""
    return getattr(param, ROLE_ATTRIBUTE, REPLICATED)


def declare_role(param, **traits):
    """Add `traits` (ParamRole fields) to `param`'s role; returns `param`."""
    setattr(param, ROLE_ATTRIBUTE, dataclasses.replace(role_of(param), **traits))
    return param


def copy_role(source, target):
    """`target` (a master copy, a version's parameter) takes `source`'s role; returns it."""
    setattr(target, ROLE_ATTRIBUTE, role_of(source))
    return target


def writes(param, grid) -> bool:
    """Whether this rank holds the copy of `param` that is written and counted once: the first
    rank of its reduce group (every rank of which holds the same tensor)."""
    return grid.index(*role_of(param).reduce_axes) == 0


def reduce_sets(params) -> dict[tuple[str, ...], list]:
    """`params` grouped by the axes their gradients are summed over, in order of first
    appearance (each group keeping the parameters' order)."""
    sets: dict[tuple[str, ...], list] = {}
    for param in params:
        sets.setdefault(role_of(param).reduce_axes, []).append(param)
    return sets
