"""AdamW over this rank's parameters, with decoupled weight decay skipped for biases and norms."""

from __future__ import annotations

import torch
import torch.nn as nn

from ptdp.config import TrainConfig


def build_optimizer(params: list[nn.Parameter], train: TrainConfig) -> torch.optim.Optimizer:
    # The distributed optimizer's 1-D pieces decay as the tensors they are parts of.
    decay = [p for p in params if getattr(p, "source_ndim", p.ndim) >= 2]
    no_decay = [p for p in params if getattr(p, "source_ndim", p.ndim) < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # One kernel per tensor on CUDA (fused). Elsewhere torch would loop over the tensors in
    # Python with several ops each; foreach runs the same arithmetic per tensor in C++
    # (bit-identical results, ~1.7x faster at a small GPT's ~60 tensors on CPU).
    fused = all(p.is_cuda for p in params) and len(params) > 0
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2),
                             eps=train.adam_eps, fused=fused or None, foreach=not fused or None)


def optimizer_moment_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-element state (Adam's two moments; not the step count)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v) and v.ndim > 0)
