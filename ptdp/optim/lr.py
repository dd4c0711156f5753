"""Learning-rate schedule, on Megatron-LM's convention: linear warm-up from
`train.lr_warmup_init`, then cosine, linear, constant, inverse-square-root or WSD
(warmup-stable-decay) decay to `train.min_lr`.

The schedule is a function of *samples*, as Megatron's (its `num_steps` counts samples: every
iteration adds the global batch). Iteration i (0-based) runs at the rate of the samples consumed
*before* it (i * B, or with a batch ramp-up the sum of the ramp's batches,
ptdp/config/batches.py): the first warm-up iteration runs at `lr_warmup_init` (0 by default)
and the last iteration of a decay runs just above `min_lr`, not at it. A run resumed after N
iterations (a ptdp checkpoint, or a Megatron checkpoint converted at iteration N) therefore
continues at the rate of N * B samples, where the run it continues left off. Like Megatron's
scheduler, the schedule does not advance on an iteration whose update fp16 skipped for
overflow: the training progress counts those samples (ptdp/training/state.py,
`Progress.skipped_samples`).

Lengths in samples (`schedule_lengths`, ptdp/config/schema.py): iteration-based runs
(train.iters) give them in iterations, times B; sample-based runs (train.train_samples) in
samples. Warm-up is `lr_warmup_fraction` of the decay length when that is set.
"""

from __future__ import annotations

import math

from ptdp.config import TrainConfig
from ptdp.config.batches import BatchSchedule
from ptdp.config.schema import ScheduleLengths, schedule_lengths


def learning_rate(iteration: int, train: TrainConfig, batches: BatchSchedule | None = None,
                  skipped_samples: int = 0) -> float:
    """The rate 0-based `iteration` runs at: the schedule after the samples consumed before it
    (i * B, or the ramp's sum: `batches`, built from `train` when not given), less the samples
    of the earlier iterations whose update fp16 skipped (Megatron's scheduler stands still
    then)."""
    consumed = (batches or BatchSchedule.of(train)).consumed(iteration)
    return learning_rate_at(consumed - skipped_samples, train)


def learning_rate_at(samples: float, train: TrainConfig) -> float:
    """The schedule after `samples` consumed samples."""
    span = schedule_lengths(train)
    top, low = train.lr, train.min_lr
    if span.warmup > 0 and samples <= span.warmup:
        return train.lr_warmup_init + (top - train.lr_warmup_init) * samples / span.warmup
    style = train.lr_decay_style
    if style == "constant":
        return top
    if samples > span.decay:
        return low
    if style == "inverse-square-root":
        return max(low, top * max(span.warmup, 1) ** 0.5 / max(samples, 1) ** 0.5)
    # here warmup < samples <= decay, so the decay is longer than the warm-up
    ratio = (samples - span.warmup) / (span.decay - span.warmup)
    return low + (top - low) * _decay_coefficient(style, ratio, samples, span, train)


def _decay_coefficient(style: str, ratio: float, samples: float, span: ScheduleLengths,
                       train: TrainConfig) -> float:
    """1 at the start of the decay, 0 at its end."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return _cosine(ratio)
    # wsd: stable at the top until the last `wsd_decay` samples of the decay, then anneal
    anneal_start = span.decay - span.wsd_decay
    if samples <= anneal_start:
        return 1.0
    x = (samples - anneal_start) / span.wsd_decay
    return {"linear": lambda: 1.0 - x, "cosine": lambda: _cosine(x),
            "exponential": lambda: 2.0 * 0.5 ** x - 1.0,
            "minus_sqrt": lambda: 1.0 - math.sqrt(x)}[train.lr_wsd_decay_style]()


def _cosine(ratio: float) -> float:
    return 0.5 * (math.cos(math.pi * ratio) + 1.0)
