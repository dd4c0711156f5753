"""Rotary position embeddings (RoPE, Su et al. 2021), as Llama and Hugging Face apply them.

Each head's query and key vectors are rotated by an angle proportional to the token's position:
the pair (x_i, x_{i+d/2}) by position * inv_freq_i, inv_freq_i = theta^(-2i/d) (the two halves
of the head are paired, Hugging Face's and Megatron's default, not adjacent elements). The
product q.k then depends only on the distance between positions. Nothing here is learned.

Llama 3.1 stretches long wavelengths for longer contexts (`rope_scaling_factor` > 1): the
frequencies whose wavelength exceeds original_seq_length / low_freq_factor are divided by the
factor, those shorter than original_seq_length / high_freq_factor are kept, and the band between
is interpolated smoothly (Hugging Face's "llama3" rope type).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ptdp.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig, dim: int | None = None) -> torch.Tensor:
    """[dim / 2] fp32 angular frequencies (dim: the rotated size, default head_dim), with the
    Llama-3 scaling when configured."""
    d = cfg.head_dim if dim is None else dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_scaling_factor == 1.0:
        return inv_freq
    factor, old = cfg.rope_scaling_factor, cfg.rope_original_seq_length
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= old / high) & (wavelength <= old / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos and sin tables for given positions; the frequencies are a (non-saved) fp32 buffer.

    The buffer stays fp32 whatever the module is cast to: training casts each chunk with
    `nn.Module.to(device, bf16)`, which casts float buffers too, and bf16 frequencies put the
    angles off by more than a radian at position 1,024 (cos and sin then mean nothing). So
    every cast or move recomputes them from the config in fp32 on the buffer's new device."""

    def __init__(self, cfg: ModelConfig, dim: int | None = None):
        super().__init__()
        self.cfg, self.dim = cfg, dim   # dim: the rotated size (latent attention's rotary part)
        self.register_buffer("inv_freq", inverse_frequencies(cfg, dim), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = inverse_frequencies(self.cfg, self.dim).to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [s] or [b, s] (integers) -> cos, sin [..., dim] in fp32."""
        angles = positions.float()[..., None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d] rotated by the tables [s, d] (cast to x's precision, as HF does)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    # chunk, not two slices: its backward concatenates the halves' gradients, where each
    # slice's would zero-fill a full-size gradient for autograd to sum (bit-identical, faster)
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return x * cos + rotated_half * sin
