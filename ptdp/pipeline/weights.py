"""Weight versions: the copies of a rank's parameters that forward and backward passes run with.

PipeDream-2BW keeps two per rank (current and shadow); PipeDream with weight
stashing keeps one per in-flight input. A *version* is one tensor per parameter
holding what the optimizer's fp32 masters were cast into after some number of updates (its id).
Before every forward and backward the executor points the model's parameters at the version
that micro-batch uses (``param.data = tensor``), so a backward, and any recomputation of the
forward inside it, sees exactly the tensors its forward saw:

* autograd saves a parameter as the parameter object, whose data is switched back before the
  backward; views saved in the forward (a transposed weight) refer to the version's storage,
  which is never written while any micro-batch uses it;
* the optimizer steps separate master objects (`MasterWeights(versioned=True)`,
  ptdp/optim/mixed_precision.py), so the parameters' version counters never move and
  autograd's in-place checks stay quiet.

Writing a new version never touches one in use. In fp32 the masters *are* the newest version
(no third copy): a step copies the newest into a free buffer, points the masters at it and
updates it in place. With bf16/fp16 the fp32 masters are separate; a step updates them and casts
them into a free buffer.

A version is released when no in-flight micro-batch uses it, it is older than the lowest version
a future forward may ask for, and it is not the newest; its buffers are reused by the next
version. ``peak`` is the most versions alive at once (what the tests assert).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
import torch.nn as nn

from ptdp.optim.mixed_precision import grad_of


def take_gradients(params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    """This rank's accumulated fp32 gradients (``main_grad`` or ``grad``), leaving every
    parameter without one, so the next batch accumulates afresh while these wait."""
    grads = [grad_of(p) for p in params]
    for p in params:
        p.grad = None
        if hasattr(p, "main_grad"):
            p.main_grad = None
    return grads


class WeightVersions:
    """The versions of one group of parameters (a rank's chunks, or a tied copy)."""

    def __init__(self, params: list[nn.Parameter], masters: list[nn.Parameter], first: int = 0):
        self.params, self.masters = list(params), list(masters)
        # fp32: masters share the newest version's storage (see the module docstring)
        self.aliased = all(m.data_ptr() == p.data_ptr() for m, p in zip(self.masters, self.params))
        self.buffers: dict[int, list[torch.Tensor]] = {first: [p.data for p in self.params]}
        self.refs: Counter = Counter()
        self.newest = self.active = first
        self.pool: list[list[torch.Tensor]] = []
        self.peak = 1

    @property
    def live(self) -> int:
        return len(self.buffers)

    def activate(self, version: int) -> None:
        """Point the parameters at ``version``'s tensors (nothing to do if they already are)."""
        if version == self.active:
            return
        if version not in self.buffers:
            raise RuntimeError(f"weight version {version} was released or never made "
                               f"(live: {sorted(self.buffers)})")
        for param, tensor in zip(self.params, self.buffers[version]):
            param.data = tensor
        self.active = version

    def acquire(self, version: int) -> None:
        self.refs[version] += 1

    def release(self, version: int) -> None:
        self.refs[version] -= 1
        if not self.refs[version]:
            del self.refs[version]

    def release_unneeded(self, lowest_needed: int) -> None:
        """Free versions below ``lowest_needed`` that no in-flight micro-batch uses."""
        for version in sorted(self.buffers):
            if version < lowest_needed and version != self.newest and not self.refs[version]:
                self.pool.append(self.buffers.pop(version))

    def publish(self, step: Callable[[], None], lowest_needed: int) -> int:
        """Run the optimizer ``step`` so that its result becomes version ``newest + 1``."""
        self.release_unneeded(lowest_needed)
        fresh = self.pool.pop() if self.pool else [torch.empty_like(t)
                                                   for t in self.buffers[self.newest]]
        with torch.no_grad():
            if self.aliased:
                for buffer, current, master in zip(fresh, self.buffers[self.newest], self.masters):
                    buffer.copy_(current)
                    master.data = buffer
                step()
            else:
                step()
                for buffer, master in zip(fresh, self.masters):
                    buffer.copy_(master)
        self.newest += 1
        self.buffers[self.newest] = fresh
        self.peak = max(self.peak, self.live)
        return self.newest

    def install(self, version: int, values: list[torch.Tensor]) -> None:
        """Add ``version`` (older than the newest) from saved values: a resumed 2BW shadow."""
        if version >= self.newest:
            raise ValueError(f"version {version} must be older than the newest ({self.newest})")
        buffers = [torch.empty_like(t) for t in self.buffers[self.newest]]
        with torch.no_grad():
            for buffer, value in zip(buffers, values):
                buffer.copy_(value)
        self.buffers[version] = buffers
        self.peak = max(self.peak, self.live)

    def renumber(self, newest: int) -> None:
        """Call the (only) version ``newest``: a run resumed after ``newest`` updates."""
        if self.live != 1:
            raise RuntimeError("renumber a version store only before it made versions")
        self.buffers = {newest: self.buffers.pop(self.newest)}
        self.newest = self.active = newest

    def values(self, version: int) -> list[torch.Tensor]:
        return self.buffers[version]


class StashedVersions:
    """What the executor sees: the version groups of one rank, and which version a forward of
    micro-batch ``mb`` uses in each (``policies``). A forward's version ids are stashed with
    its activations and used again by its backward; ``log`` records (kind, mb, stage, ids)."""

    def __init__(self, groups: list[WeightVersions], policies: list[Callable[[int], int]]):
        self.groups, self.policies = groups, policies
        self.log: list[tuple[str, int, int, tuple[int, ...]]] = []
        self.last_forward = -1

    @property
    def peak(self) -> int:
        return max(group.peak for group in self.groups)

    def forward(self, mb: int) -> tuple[int, ...]:
        ids = tuple(policy(mb) for policy in self.policies)
        for group, version in zip(self.groups, ids):
            group.activate(version)
            group.acquire(version)
        self.last_forward = max(self.last_forward, mb)
        return ids

    def backward(self, ids: tuple[int, ...]) -> None:
        for group, version in zip(self.groups, ids):
            group.activate(version)

    def done(self, ids: tuple[int, ...]) -> None:
        for group, version in zip(self.groups, ids):
            group.release(version)

    def activate_newest(self) -> None:
        """Point every parameter at the newest weights (validation, saving, reports)."""
        for group in self.groups:
            group.activate(group.newest)
