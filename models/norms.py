"""The normalisations a block can use: LayerNorm (GPT-2, BERT) and RMSNorm (Llama).

Their weights are replicated across tensor ranks (ones and zeros: layout-free). They run on the
hidden state between tensor regions, which with sequence parallelism is 1/t of the tokens, so
their weights are marked for the tensor-group gradient sum. Under zb-h1 their weight gradients
may wait for the W pass (their `weight_ops`, ptdp/parallel/weight_grad.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ptdp.config import ModelConfig
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.sequence import mark_sequence_parallel
from ptdp.parallel.weight_grad import PLAIN


class RMSNorm(nn.Module):
    """x / RMS(x) * weight, the RMS taken in fp32 whatever the training precision, the gain
    applied in the input's precision: what Hugging Face's `LlamaRMSNorm` computes."""

    weight_ops = PLAIN

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight_ops.scale(normed.to(x.dtype), self.weight)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters, state dict and computation) through its `weight_ops`."""

    weight_ops = PLAIN

    def forward(self, x):
        return self.weight_ops.layer_norm(x, self.normalized_shape, self.weight, self.bias,
                                          self.eps)


def layer_norm(hidden: int, eps: float, tp: TensorParallel | None = None) -> LayerNorm:
    """A LayerNorm; `tp`: marked for sequence parallelism's tensor-group gradient sum."""
    norm = LayerNorm(hidden, eps=eps)
    if tp is not None:
        mark_sequence_parallel(norm.weight, tp)
        mark_sequence_parallel(norm.bias, tp)
    return norm


def norm(cfg: ModelConfig, tp: TensorParallel) -> nn.Module:
    """The block's normalisation (model.normalization) on the hidden state."""
    if cfg.normalization == "layernorm":
        return layer_norm(cfg.hidden_size, cfg.layernorm_eps, tp)
    rms = RMSNorm(cfg.hidden_size, cfg.layernorm_eps)
    mark_sequence_parallel(rms.weight, tp)
    return rms
