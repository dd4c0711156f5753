"""Training: the trainer (trainer.py), the state it trains (state.py) and one step type per
schedule family (flushing.py, two_bw.py, pipedream.py)."""

from ptdp.training.results import DivergenceError, StepResult
from ptdp.training.trainer import Trainer, build_datasets

__all__ = ["DivergenceError", "StepResult", "Trainer", "build_datasets"]
