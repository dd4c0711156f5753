"""Dynamic loss scaling for fp16: scale the loss up so small gradients survive in fp16, skip
steps whose gradients overflowed and halve the scale, double it after a run of good steps.
bf16 and fp32 use a constant scale of 1 and never skip."""

from __future__ import annotations

import math


class LossScaler:
    def __init__(self, dynamic: bool, initial: float = 2.0 ** 16, growth_interval: int = 1000,
                 min_scale: float = 1.0):
        self.dynamic = dynamic
        self.scale = initial if dynamic else 1.0
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0
        self.skips_at_min_scale = 0   # consecutive overflows with nothing left to halve

    def update(self, grad_norm: float) -> bool:
        """Record one step's (scaled) gradient norm; returns True if the step must be skipped."""
        if not self.dynamic:
            return False
        if not math.isfinite(grad_norm):
            at_min = self.scale <= self.min_scale
            self.skips_at_min_scale = self.skips_at_min_scale + 1 if at_min else 0
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
            return True
        self.skips_at_min_scale = 0
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2
        return False

    def given_up(self, max_skips: int) -> bool:
        """True after `max_skips` consecutive overflows at the minimum scale: the gradients are
        not finite whatever the scale, so skipping on would silently train nothing."""
        return self.dynamic and self.skips_at_min_scale >= max_skips

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        if not state:   # none saved (a converted checkpoint): keep the configured scale
            return
        self.scale, self.good_steps = state["scale"], state["good_steps"]
