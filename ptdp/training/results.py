"""What one training iteration reports, and the error that stops a diverged run."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# The losses a model reports besides the total, by architecture (the chunks' `aux` dicts).
AUX_LOSSES = {"gpt": ("lm_loss",), "bert": ("lm_loss", "sop_loss")}


def aux_loss_names(arch: str) -> tuple[str, ...]:
    return AUX_LOSSES[arch]


@dataclass
class StepResult:
    """One iteration's statistics. The steps leave them as device tensors (no host sync inside
    the step); `resolve()` reads them all at once."""

    loss: torch.Tensor | float
    aux: dict
    grad_norm: torch.Tensor | float = float("nan")
    skipped: bool = False

    def resolve(self) -> "StepResult":
        """Floats instead of tensors, with a single device-to-host copy."""
        names = list(self.aux)
        values = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=self.loss.device)
                              for x in [self.loss, self.grad_norm, *self.aux.values()]]).tolist()
        self.loss, self.grad_norm = values[0], values[1]
        self.aux = dict(zip(names, values[2:]))
        return self


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss or gradient; the message says where."""


def sum_losses(losses: list, aux: list, names: tuple, device, extra: int = 0) -> torch.Tensor:
    """[*extra zeros, loss sum, *aux sums] over this rank's micro-batches, float64 on device."""
    values = torch.zeros(extra + 1 + len(names), dtype=torch.float64, device=device)
    if losses:
        values[extra:] += torch.stack([torch.stack([loss, *(a[n] for n in names)]).double()
                                       for loss, a in zip(losses, aux)]).sum(0)
    return values


def mean_losses(values: torch.Tensor, names: tuple, count: int) -> tuple[torch.Tensor, dict]:
    """(mean loss, {aux name: mean}) from `sum_losses`' totals over `count` micro-batches."""
    values = values / count
    return values[0], {n: values[1 + i] for i, n in enumerate(names)}


def average_losses(state, losses: list, aux: list,
                   m: int | None = None) -> tuple[torch.Tensor, dict]:
    """Mean loss (and aux losses) over the micro-batches of every data rank, known on every rank
    afterwards, on the device. Only the last stage holds losses; the others add zeros. With
    context parallelism each context rank's loss is its share of the micro-batch's: they add up
    over the replica group (data x context). `m`: the iteration's micro-batches per data rank
    (default `state.m`; a batch ramp-up changes it)."""
    grid, names = state.grid, aux_loss_names(state.cfg.model.arch)
    values = sum_losses(losses, aux, names, state.device)
    for axes in (("pipeline",), ("data", "context")):
        if grid.size(*axes) > 1:
            dist.all_reduce(values, group=grid.group(*axes))
    return mean_losses(values, names, (m or state.m) * grid.d)
