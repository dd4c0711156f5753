"""Training: the trainer and one step type per schedule family (ptdp/training/trainer.py)."""

from ptdp.training.trainer import DivergenceError, StepResult, Trainer

__all__ = ["DivergenceError", "StepResult", "Trainer"]
