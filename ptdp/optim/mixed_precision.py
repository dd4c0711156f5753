"""fp32 master weights and fp32 gradient accumulation for bf16/fp16 models.

The model computes in bf16 or fp16. Each micro-batch's half-precision gradient is added into
an fp32 `main_grad` as soon as autograd produces it (accumulating m micro-batches in half
precision would lose the small contributions), and AdamW updates fp32 master copies that are
cast back into the model after each step. In fp32 training the master weights are the model's
own parameters and `main_grad` is simply `.grad`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Attributes that tell reductions, norms and checkpoints how a weight is laid out.
LAYOUT_ATTRIBUTES = ("tp_split_dim", "vocab_padded", "duplicate", "shared_embedding")


def grad_of(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient to reduce: fp32 `main_grad` for half-precision params, else `.grad`."""
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def set_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    if hasattr(param, "main_grad"):
        param.main_grad = value
    else:
        param.grad = value


class MasterWeights:
    """Pairs each model parameter with the fp32 tensor the optimizer updates."""

    def __init__(self, params: list[nn.Parameter], precision: str):
        self.params = params
        self.half = precision != "fp32"
        if not self.half:
            self.masters = params
            return
        self.masters = []
        for p in params:
            master = nn.Parameter(p.detach().float().clone())
            for attr in LAYOUT_ATTRIBUTES:
                if hasattr(p, attr):
                    setattr(master, attr, getattr(p, attr))
            self.masters.append(master)
            p.main_grad = None
            p.register_post_accumulate_grad_hook(_accumulate_fp32)

    def zero_grads(self) -> None:
        for p in self.params:
            p.grad = None
            if self.half:
                p.main_grad = None

    def grads_to_masters(self) -> None:
        """Hand the reduced fp32 gradients to the master weights."""
        if self.half:
            for p, master in zip(self.params, self.masters):
                master.grad = p.main_grad if p.main_grad is not None else torch.zeros_like(master)

    @torch.no_grad()
    def masters_to_model(self) -> None:
        if self.half:
            for p, master in zip(self.params, self.masters):
                p.copy_(master)


def _accumulate_fp32(param: nn.Parameter) -> None:
    # Runs before the data-parallel hook (registered first), so that hook sees main_grad.
    grad = param.grad.float()
    param.main_grad = grad if param.main_grad is None else param.main_grad.add_(grad)
    param.grad = None
