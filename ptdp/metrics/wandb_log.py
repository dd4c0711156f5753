"""Weights & Biases logging (`log.wandb_project`, `log.wandb_name`): the scalars TensorBoard
gets (ptdp/metrics/log.py `scalars`), under the same names and steps, in a W&B run that rank 0
opens with the job's resolved config.

`wandb` is an optional extra (`pip install 'ptdp[wandb]'`); `ptdp check` and `ptdp train`
refuse `log.wandb_project` without it before any process group starts (ptdp/checks.py).
W&B's own environment applies: `WANDB_MODE=offline` writes the run under `WANDB_DIR` (default
./wandb) with no network, for a later `wandb sync`. Each start of a job opens a run of its
own (a restart logs the iterations after its checkpoint again, into a new run).
"""

from __future__ import annotations

from ptdp.config import Config


class WandbRun:
    """One W&B run for this job's metrics (rank 0 only)."""

    def __init__(self, cfg: Config):
        import wandb   # the package check ran at start-up
        self.run = wandb.init(project=cfg.log.wandb_project, name=cfg.log.wandb_name,
                              config=cfg.to_dict())

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
