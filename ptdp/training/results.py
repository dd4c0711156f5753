"""What one training iteration reports, and the error that stops a diverged run."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class StepResult:
    """One iteration's statistics. The steps leave them as device tensors (no host sync inside
    the step); `resolve()` reads them all at once. `aux` holds the loss's parts (BERT's
    `lm_loss`, `sop_loss`); `aux_losses` the auxiliary losses the stages added to the objective
    (ptdp/pipeline/executor.py), each averaged like the loss and summed over the stages."""

    loss: torch.Tensor | float
    aux: dict
    grad_norm: torch.Tensor | float = float("nan")
    skipped: bool = False
    aux_losses: dict = field(default_factory=dict)

    def resolve(self) -> "StepResult":
        """Floats instead of tensors, with a single device-to-host copy."""
        names, extra = list(self.aux), list(self.aux_losses)
        values = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=self.loss.device)
                              for x in [self.loss, self.grad_norm, *self.aux.values(),
                                        *self.aux_losses.values()]]).tolist()
        self.loss, self.grad_norm = values[0], values[1]
        self.aux = dict(zip(names, values[2:2 + len(names)]))
        self.aux_losses = dict(zip(extra, values[2 + len(names):]))
        return self


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss or gradient; the message says where."""


def sum_losses(losses: list, parts: list, names: tuple, device, extra: int = 0) -> torch.Tensor:
    """[*extra zeros, loss sum, *part sums] over this rank's micro-batches, float64 on device."""
    values = torch.zeros(extra + 1 + len(names), dtype=torch.float64, device=device)
    if losses:
        values[extra:] += torch.stack([torch.stack([loss, *(a[n] for n in names)]).double()
                                       for loss, a in zip(losses, parts)]).sum(0)
    return values


def mean_losses(values: torch.Tensor, names: tuple, count: int) -> tuple[torch.Tensor, dict]:
    """(mean loss, {aux name: mean}) from `sum_losses`' totals over `count` micro-batches."""
    values = values / count
    return values[0], {n: values[1 + i] for i, n in enumerate(names)}


def average_losses(state, result, m: int | None = None) -> StepResult:
    """Mean loss (with its parts and the aux losses) over the micro-batches of every data rank,
    known on every rank afterwards, on the device. Only the last stage holds losses; the others
    add zeros. With context parallelism each context rank's loss is its share of the
    micro-batch's: they add up over the replica group (data x context). `result`: the
    executor's IterationResult; `m`: the iteration's micro-batches per data rank (default
    `state.m`; a batch ramp-up changes it)."""
    grid = state.grid
    return average_over(result, state.cfg.model.family.losses,
                        [(grid.group(*axes), grid.size(*axes))
                         for axes in (("pipeline",), ("data", "context"))],
                        (m or state.m) * grid.d, state.device)


def average_over(result, names: tuple, groups, count: int, device) -> StepResult:
    """`result`'s losses summed over its micro-batches and over each (group, size) of `groups`
    (size 1: nothing to sum), then divided by `count` micro-batches. An aux loss is summed over
    the pipeline stages that produce it (the others hold zeros), as the loss is."""
    values = sum_losses(result.losses, result.parts, names, device)
    extra = list(result.aux_losses)
    if extra:
        values = torch.cat([values, torch.stack([result.aux_losses[n] for n in extra])])
    for group, size in groups:
        if size > 1:
            dist.all_reduce(values, group=group)
    loss, parts = mean_losses(values[:1 + len(names)], names, count)
    return StepResult(loss, parts, aux_losses=dict(zip(extra, values[1 + len(names):] / count)))
