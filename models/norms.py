"""The normalisations a block can use: LayerNorm (GPT-2, BERT) and RMSNorm (Llama).

With `model.norm_zero_centered` the gain is 1 + w, w starting at 0 (Gemma's RMSNorm, Megatron's
--apply-layernorm-1p): the same model at initialisation, and a weight decay that pulls the gain
towards 1 rather than 0. Their weights are replicated across tensor ranks (gains of ones or
zeros, biases of zeros: layout-free). They run on the hidden state between tensor regions,
which with sequence parallelism is 1/t of the tokens, so their weights are marked for the
tensor-group gradient sum. Under zb-h1 their weight gradients
may wait for the W pass (their `weight_ops`, ptdp/parallel/weight_grad.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ptdp.config import ModelConfig
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.roles import declare_role
from ptdp.parallel.sequence import mark_sequence_parallel
from ptdp.parallel.weight_grad import PLAIN


class RMSNorm(nn.Module):
    """x / RMS(x) * weight, the RMS taken in fp32 whatever the training precision, the gain
    applied in the input's precision: what Hugging Face's `LlamaRMSNorm` computes. Zero-centred:
    x / RMS(x) * (1 + weight) all in fp32, then cast, as Hugging Face's `GemmaRMSNorm`."""

    weight_ops = PLAIN

    def __init__(self, hidden: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden) if zero_centered else torch.ones(hidden))
        self.eps, self.zero_centered = eps, zero_centered

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:   # x * (1 + w) in fp32 (the op casts w), then cast
            return self.weight_ops.scale(normed, self.weight, 1.0).to(x.dtype)
        return self.weight_ops.scale(normed.to(x.dtype), self.weight)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters, state dict and computation) through its `weight_ops`;
    zero-centred, its gain is 1 + weight (Megatron's --apply-layernorm-1p)."""

    weight_ops = PLAIN

    def __init__(self, hidden: int, eps: float, zero_centered: bool = False):
        super().__init__(hidden, eps=eps)
        self.zero_centered = zero_centered
        if zero_centered:
            nn.init.zeros_(self.weight)

    def forward(self, x):
        # zero-centred: the gain 1 + w in the weight's dtype (the op adds the offset, so that
        # zb-h1's queue gets w itself: ptdp/parallel/weight_grad.py)
        return self.weight_ops.layer_norm(x, self.normalized_shape, self.weight, self.bias,
                                          self.eps, 1.0 if self.zero_centered else 0.0)


def layer_norm(hidden: int, eps: float, tp: TensorParallel | None = None,
               zero_centered: bool = False) -> LayerNorm:
    """A LayerNorm; `tp`: marked for sequence parallelism's tensor-group gradient sum."""
    norm = LayerNorm(hidden, eps, zero_centered)
    if tp is not None:
        mark_sequence_parallel(norm.weight, tp)
        mark_sequence_parallel(norm.bias, tp)
    return norm


def norm(cfg: ModelConfig, tp: TensorParallel) -> nn.Module:
    """The block's normalisation (model.normalization, model.norm_zero_centered) on the hidden
    state."""
    zero = cfg.norm_zero_centered
    if cfg.normalization == "layernorm":
        return layer_norm(cfg.hidden_size, cfg.layernorm_eps, tp, zero)
    rms = RMSNorm(cfg.hidden_size, cfg.layernorm_eps, zero)
    mark_sequence_parallel(rms.weight, tp)
    return rms


def latent_norm(cfg: ModelConfig, size: int, tp: TensorParallel) -> nn.Module:
    """The block's normalisation over a latent of `size` values (latent attention's query and
    key/value latents), applied where the hidden state is: on this rank's tokens, so marked
    for sequence parallelism's tensor-group gradient sum."""
    kind = LayerNorm if cfg.normalization == "layernorm" else RMSNorm
    module = kind(size, cfg.layernorm_eps, cfg.norm_zero_centered)
    for param in module.parameters():
        mark_sequence_parallel(param, tp)
    return module


def head_norm(cfg: ModelConfig, tp: TensorParallel) -> nn.Module:
    """model.qk_norm: the block's normalisation over each query or key head's head_dim values
    (Qwen3, Gemma 3), one weight shared by every head. A tensor rank applies it to its own
    heads only, so its gradient there is partial: like a sequence-parallel weight's (a partial
    sum over the tokens), it is summed over the tensor group before the optimizer step
    (ptdp/optim/grads.py reduce_sequence_parallel_grads, by its role)."""
    kind = LayerNorm if cfg.normalization == "layernorm" else RMSNorm
    module = kind(cfg.head_dim, cfg.layernorm_eps, cfg.norm_zero_centered)
    if tp.size > 1:
        for param in module.parameters():
            declare_role(param, sequence_parallel=True)
    return module
