"""Single-process simulations of the no-flush update rules: the oracles of the 2BW and PipeDream
tests (DESIGN principle 3). Each runs a plain one-process trainer (schedule 1f1b, p = 1) and
feeds its optimizer gradients computed at the weight version the rule names, with the same data
order as the pipelined runs; nothing of the no-flush machinery is used.
"""

from __future__ import annotations

import torch

from tests.equivalence import TINY


def _trainer(overrides: list[str], iters: int):
    from ptdp.config import load_config
    from ptdp.training import Trainer
    kept = [o for o in overrides if o.split("=")[0] in ("model.arch", "train.precision",
                                                          "train.clip_grad", "train.lr")]
    cfg = load_config(None, TINY + kept + [f"train.iters={iters}", "schedule.name=1f1b"],
                      world_size=1)
    return Trainer(cfg)


def _snapshot(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.params]


@torch.no_grad()
def _load(trainer, values: list[torch.Tensor]) -> None:
    for p, value in zip(trainer.params, values):
        p.copy_(value)


def simulate_two_bw(overrides: list[str], iters: int) -> dict:
    """W(t+1) = W(t) - lr * AdamW(clip(grad f_t(W(max(t-1, 0))))): batch t's gradient (and loss)
    at the version before the newest, applied to the newest (L2306, L2353-2390)."""
    trainer = _trainer(overrides, iters)
    history, losses, norms = [_snapshot(trainer)], [], []
    for t in range(iters):
        current = _snapshot(trainer)
        _load(trainer, history[max(t - 1, 0)])
        step = trainer.forward_backward(t)
        norm = trainer.reduce_gradients()
        _load(trainer, current)              # the gradients stay where they are
        trainer.optimizer_step(t, norm)
        history.append(_snapshot(trainer))
        step.grad_norm = norm
        step.resolve()
        losses.append(step.loss)
        norms.append(step.grad_norm)
    return {"losses": losses, "grad_norms": norms, "weights": trainer.full_state()}
