"""The global batch size of every iteration, and the samples consumed before it: constant
(`train.global_batch_size`), or ramped up as Megatron-LM's `--rampup-batch-size` does
(`train.rampup_batch_size: [start, increment, ramp_samples]`, the rule of megatron-core's
`RampupBatchsizeNumMicroBatchesCalculator`): the batch starts at `start` and grows by
`increment` every ramp_samples / ((B - start) / increment) consumed samples, reaching B once
`ramp_samples` have been consumed.

Both are pure functions of the iteration, so the data position, the number of micro-batches
and the learning rate (which counts samples, ptdp/optim/lr.py) of any iteration follow from
the configuration and the iterations done: a resumed run continues exactly. The ramp is kept as
a few segments of iterations with one batch size each, so every question costs a bisection.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from ptdp.config.schema import TrainConfig


@dataclass(frozen=True)
class Segment:
    """Iterations from `first` on run `batch` samples each; `consumed` samples came before."""

    first: int
    consumed: int
    batch: int


class BatchSchedule:
    """Per iteration: its global batch size and the samples consumed before it."""

    def __init__(self, global_batch: int, ramp: tuple[int, int, int] | None = None):
        self.final, self.ramp = global_batch, tuple(ramp) if ramp else None
        self.segments = self._segments() if self.ramp else [Segment(0, 0, self.final)]
        self._firsts = [s.first for s in self.segments]
        self._starts = [s.consumed for s in self.segments]

    @classmethod
    def of(cls, train: TrainConfig) -> BatchSchedule:
        """The run's schedule: train.global_batch_size, ramped by train.rampup_batch_size
        (validated: ptdp/config/validation.py)."""
        return cls(train.global_batch_size, train.rampup_batch_size)

    def ramped_batch(self, consumed: int) -> int:
        """Megatron's batch size after `consumed` samples (its calculator's `update`)."""
        start, increment, samples = self.ramp
        if consumed > samples:
            return self.final
        per_increment = samples / ((self.final - start) // increment)
        return start + int(consumed / per_increment) * increment

    def _segments(self) -> list[Segment]:
        segments, first, consumed = [], 0, 0
        while True:
            batch = self.ramped_batch(consumed)
            segments.append(Segment(first, consumed, batch))
            if batch == self.final:   # the batch never shrinks: constant from here on
                return segments
            count = self._iterations_at(consumed, batch)
            first, consumed = first + count, consumed + count * batch

    def _iterations_at(self, consumed: int, batch: int) -> int:
        """How many iterations run at `batch` from `consumed` on: an estimate from the next
        increment's threshold, corrected for the float division Megatron's rule makes."""
        start, increment, samples = self.ramp
        per_increment = samples / ((self.final - start) // increment)
        threshold = ((batch - start) // increment + 1) * per_increment
        count = max(1, math.ceil((threshold - consumed) / batch))
        while self.ramped_batch(consumed + count * batch) == batch:
            count += 1
        while count > 1 and self.ramped_batch(consumed + (count - 1) * batch) != batch:
            count -= 1
        return count

    def _segment(self, iteration: int) -> Segment:
        return self.segments[bisect.bisect_right(self._firsts, iteration) - 1]

    def batch_size(self, iteration: int) -> int:
        """The global batch size of 0-based `iteration`."""
        return self._segment(iteration).batch

    def consumed(self, iteration: int) -> int:
        """Samples consumed by the iterations before `iteration`."""
        segment = self._segment(iteration)
        return segment.consumed + (iteration - segment.first) * segment.batch

    def iteration_of(self, sample: int) -> int:
        """The iteration that consumes global sample number `sample` (0-based)."""
        segment = self.segments[bisect.bisect_right(self._starts, sample) - 1]
        return segment.first + (sample - segment.consumed) // segment.batch

    def batch_sizes(self) -> list[int]:
        """Every batch size the run goes through, smallest first."""
        return [s.batch for s in self.segments]

    def iterations_for(self, train_samples: int) -> int:
        """Megatron's iteration count of a sample-based run (`update_train_iters`): the ramp's
        iterations until more than ramp_samples are consumed, then whole global batches of what
        is left (a partial last batch is dropped)."""
        if not self.ramp:
            return train_samples // self.final
        past = self.iteration_of(self.ramp[2]) + 1   # the first iteration starting past the ramp
        return past + (train_samples - self.consumed(past)) // self.final
