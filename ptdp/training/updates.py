"""The pieces of an optimizer update that every schedule family shares: the learning rate,
removing the loss scale, clipping and stepping, and the tied embedding's gradient sum."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ptdp.config import TrainConfig
from ptdp.config.batches import BatchSchedule
from ptdp.optim.grads import clip_gradients
from ptdp.optim.lr import learning_rate
from ptdp.parallel.roles import role_of


def set_learning_rate(optimizer: torch.optim.Optimizer, iteration: int, train: TrainConfig,
                      batches: BatchSchedule | None = None, skipped_samples: int = 0) -> float:
    """The schedule's LR for 0-based `iteration` (`batches`: the run's batch sizes, when they
    ramp up; `skipped_samples`: those of earlier fp16-skipped updates), put into every
    parameter group."""
    lr = learning_rate(iteration, train, batches, skipped_samples)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def unscale_(grads: list, scale: float) -> None:
    """Divide the gradients (None entries skipped) by the loss scale they were made with."""
    present = [g for g in grads if g is not None]
    if scale != 1.0 and present:
        torch._foreach_div_(present, scale)


def step_optimizer(optimizer: torch.optim.Optimizer, masters: list, iteration: int,
                   train: TrainConfig, clip_norm: torch.Tensor | None = None,
                   batches: BatchSchedule | None = None, skipped_samples: int = 0) -> None:
    """Clip `masters`' gradients by the global `clip_norm` (if given), set the LR of
    `iteration`, step. The caller puts the gradients in place and copies the masters out."""
    if clip_norm is not None:
        clip_gradients(masters, train.clip_grad, clip_norm)
    set_learning_rate(optimizer, iteration, train, batches, skipped_samples)
    optimizer.step()


def start_tied_embedding_sum(params: list, grads: list, group) -> list[tuple[int, object]]:
    """All-reduce the tied word embedding's gradients between its two copies (first and last
    pipeline stage), in place. The first stage's original waits here: every caller reaches
    this point after its partner did, so the wait costs nothing. The last stage's copy is
    needed only later: its (index, work) pairs are returned for the caller to wait on."""
    pending = []
    for i, (param, grad) in enumerate(zip(params, grads)):
        role = role_of(param)
        if not role.shared_embedding or grad is None:
            continue
        work = dist.all_reduce(grad, group=group, async_op=True)
        if role.duplicate:
            pending.append((i, work))
        else:
            work.wait()
    return pending
