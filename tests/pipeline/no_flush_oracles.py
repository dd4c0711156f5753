"""Single-process simulations of the no-flush update rules: the oracles of the 2BW and PipeDream
tests (the project's test oracle). Each runs a plain one-process trainer (schedule 1f1b, p = 1) and
feeds its optimizer gradients computed at the weight version the rule names, with the same data
order as the pipelined runs; nothing of the no-flush machinery is used.
"""

from __future__ import annotations

import torch

from tests.equivalence import TINY


def oracle_overrides(overrides: list[str]) -> list[str]:
    """What a simulation reads of a run's overrides: the model and the optimizer settings, not
    the layout, the schedule or recomputation (runs that differ only there share one oracle)."""
    return [o for o in overrides if o.startswith(("model.", "train.")) and
            not o.startswith(("train.iters", "train.recompute"))]


def _trainer(overrides: list[str], iters: int):
    from ptdp.config import load_config
    from ptdp.training import Trainer
    cfg = load_config(None, TINY + oracle_overrides(overrides)
                      + [f"train.iters={iters}", "schedule.name=1f1b"], world_size=1)
    return Trainer(cfg)


def _snapshot(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.state.params]


@torch.no_grad()
def _load(trainer, values: list[torch.Tensor]) -> None:
    for p, value in zip(trainer.state.params, values):
        p.copy_(value)


def simulate_two_bw(overrides: list[str], iters: int) -> dict:
    """W(t+1) = W(t) - lr * AdamW(clip(grad f_t(W(max(t-1, 0))))): batch t's gradient (and loss)
    at the version before the newest, applied to the newest."""
    trainer = _trainer(overrides, iters)
    history, losses, norms = [_snapshot(trainer)], [], []
    for t in range(iters):
        current = _snapshot(trainer)
        _load(trainer, history[max(t - 1, 0)])
        step = trainer.step.forward_backward(t)
        norm = trainer.step.reduce_gradients()
        _load(trainer, current)              # the gradients stay where they are
        trainer.step.optimizer_step(t, norm)
        history.append(_snapshot(trainer))
        step.grad_norm = norm
        step.resolve()
        losses.append(step.loss)
        norms.append(step.grad_norm)
    return {"losses": losses, "grad_norms": norms, "weights": trainer.full_state()}


def pipedream_versions(j: int, p: int, stage: int, vertical_sync: bool) -> int:
    """The version (updates applied) stage ``stage`` of ``p`` runs input j with: the newest it
    has at j's forward, j - p + 1 + stage (weight stashing), or the version j was
    tagged with at the input stage, j - p + 1, everywhere (vertical sync, item 9); at least 0."""
    return max(j - p + 1 + (0 if vertical_sync else stage), 0)


def simulate_pipedream(overrides: list[str], iters: int, p: int, d: int, stage_of: dict,
                       vertical_sync: bool) -> dict:
    """One update per input j: W(j+1) = W(j) - lr * AdamW(grad f_j(mixed versions)), where
    input j is the j-th micro-batch of every data rank (their gradients averaged: 1F1B-RR keeps
    data rank i's inputs on data rank i) and each parameter of stage s (``stage_of``: global
    name -> stage; the tied embedding is stage 0's) is taken at ``pipedream_versions``."""
    from ptdp.data.batching import MicroBatches
    from ptdp.training import build_datasets
    trainer = _trainer(overrides, iters)
    cfg, (chunk,) = trainer.cfg, trainer.state.chunks.values()
    tr = cfg.train
    per_rank = [MicroBatches(build_datasets(cfg)["train"], global_batch=tr.global_batch_size,
                             micro_batch_size=tr.micro_batch_size, data_rank=i, data_size=d,
                             device=torch.device("cpu")) for i in range(d)]
    m = tr.global_batch_size // (tr.micro_batch_size * d)
    stages = [stage_of[name] for name, _ in trainer.named_parameters()]
    history, losses = [_snapshot(trainer)], []
    for t in range(iters):
        total = 0.0
        for c in range(m):
            j = t * m + c
            current = _snapshot(trainer)
            _load(trainer, [history[pipedream_versions(j, p, s, vertical_sync)][i]
                            for i, s in enumerate(stages)])
            trainer.state.weights.zero_grads()
            for batches in per_rank:
                loss, _ = chunk(None, batches.get(t, c))
                (loss / d).backward()
                total += loss.item()
            _load(trainer, current)
            trainer.step.optimizer_step(t, torch.zeros((), dtype=torch.float64))
            history.append(_snapshot(trainer))
        losses.append(total / (m * d))
    return {"losses": losses, "weights": trainer.full_state()}
