"""Learning-rate schedule: linear warm-up, then cosine, linear or constant decay to min_lr."""

from __future__ import annotations

import math

from ptdp.config import TrainConfig


def learning_rate(iteration: int, train: TrainConfig) -> float:
    """LR for 0-based `iteration` (the step that produces weights iteration+1)."""
    step = iteration + 1
    if train.lr_warmup_iters and step <= train.lr_warmup_iters:
        return train.lr * step / train.lr_warmup_iters
    if train.lr_decay_style == "constant":
        return train.lr
    decay_iters = train.lr_decay_iters or train.iters
    span = max(1, decay_iters - train.lr_warmup_iters)
    progress = min(1.0, max(0.0, (step - train.lr_warmup_iters) / span))
    if train.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return train.min_lr + (train.lr - train.min_lr) * factor
