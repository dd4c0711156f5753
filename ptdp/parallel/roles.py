"""What a parameter is to the reductions, norms and checkpoints: its role, one declared attribute.

Layers declare a parameter's role where they create it (ptdp/parallel/layers.py,
ptdp/parallel/sequence.py, models/embedding.py, models/bert.py); everything that treats
parameters differently (gradient reductions and norms in ptdp/optim/, sharding and
checkpoints, weight versions) reads it through `role_of`. A master copy of a parameter
carries the same role (`copy_role`).
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
    sequence_parallel: bool = False   # replicated, but applied to 1/t of the tokens (SP): its
    #                                   gradient is summed over the tensor group


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
