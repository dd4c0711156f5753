"""Rotary position embeddings (RoPE, Su et al. 2021), as Llama and Hugging Face apply them.

Each head's query and key vectors are rotated by an angle proportional to the token's position:
the pair (x_i, x_{i+d/2}) by position * inv_freq_i, inv_freq_i = theta^(-2i/d) (the two halves
of the head are paired, Hugging Face's and Megatron's default, not adjacent elements). The
product q.k then depends only on the distance between positions. Nothing here is learned.

Llama 3.1 stretches long wavelengths for longer contexts (`rope_scaling_factor` > 1 with
`rope_scaling_type: llama3`, the default): the frequencies whose wavelength exceeds
original_seq_length / low_freq_factor are divided by the factor, those shorter than
original_seq_length / high_freq_factor are kept, and the band between is interpolated smoothly
(Hugging Face's "llama3" rope type).

YaRN (Peng et al. 2023; `rope_scaling_type: yarn`, Hugging Face's "yarn" rope type: DeepSeek-V2/V3,
Qwen2.5's long contexts, Kimi-K2) blends, per frequency, the interpolated theta^(-2i/d) / factor
and the extrapolated theta^(-2i/d) by a linear ramp over the dimensions whose number of
rotations within original_seq_length falls between beta_fast (kept) and beta_slow (divided),
and multiplies cos and sin by an attention factor: 0.1 ln(factor) + 1, or with mscale and
mscale_all_dim mscale(factor, mscale) / mscale(factor, mscale_all_dim), or the one given.
DeepSeek's attention also multiplies its softmax scale by mscale(factor, mscale_all_dim)^2
(`softmax_scale_multiplier`; models/latent_attention.py). All as transformers 5 computes it
(modeling_rope_utils.py `_compute_yarn_parameters`, modeling_deepseek_v3.py
`yarn_apply_mscale`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ptdp.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig, dim: int | None = None) -> torch.Tensor:
    """[dim / 2] fp32 angular frequencies (dim: the rotated size, default head_dim), with the
    Llama-3 or YaRN scaling when configured."""
    d = cfg.head_dim if dim is None else dim
    if _yarn(cfg):
        return _yarn_frequencies(cfg, d)
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


def _yarn(cfg: ModelConfig) -> bool:
    return cfg.rope_scaling_factor != 1.0 and cfg.rope_scaling_type == "yarn"


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_dimension(cfg: ModelConfig, rotations: float, d: int) -> float:
    """The (fractional) rotary pair index whose wavelength fits `rotations` times in the
    original context (HF's find_correction_dim; the same float arithmetic)."""
    old = cfg.rope_original_seq_length
    return (d * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(cfg.rope_theta))


def _yarn_frequencies(cfg: ModelConfig, d: int) -> torch.Tensor:
    """YaRN's blend of interpolated and extrapolated frequencies, op for op as HF's."""
    low = _yarn_dimension(cfg, cfg.rope_yarn_beta_fast, d)
    high = _yarn_dimension(cfg, cfg.rope_yarn_beta_slow, d)
    if cfg.rope_yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high   # (no zero-width ramp)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp   # the weight of the unscaled frequency
    base = cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    interpolated = 1.0 / (cfg.rope_scaling_factor * base)
    return interpolated * (1 - extrapolated) + 1.0 / base * extrapolated


def attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: 1, or YaRN's attention factor."""
    if not _yarn(cfg):
        return 1.0
    if cfg.rope_yarn_attention_factor is not None:
        return cfg.rope_yarn_attention_factor
    factor, mscale, all_dim = (cfg.rope_scaling_factor, cfg.rope_yarn_mscale,
                               cfg.rope_yarn_mscale_all_dim)
    if mscale and all_dim:
        return float(_mscale(factor, mscale) / _mscale(factor, all_dim))
    return _mscale(factor)


def softmax_scale_multiplier(cfg: ModelConfig) -> float:
    """DeepSeek's attention's softmax scale is 1/sqrt(d) times this: mscale(factor,
    mscale_all_dim)^2 with YaRN and mscale_all_dim, else 1 (latent attention only; HF's
    Llama, Qwen2 and Qwen3 keep 1/sqrt(d))."""
    if not _yarn(cfg) or not cfg.rope_yarn_mscale_all_dim:
        return 1.0
    mscale = _mscale(cfg.rope_scaling_factor, cfg.rope_yarn_mscale_all_dim)
    return mscale * mscale


class RotaryEmbedding(nn.Module):
    """cos and sin tables for given positions; the frequencies are a (non-saved) fp32 buffer.

    The buffer stays fp32 whatever the module is cast to: training casts each chunk with
    `nn.Module.to(device, bf16)`, which casts float buffers too, and bf16 frequencies put the
    angles off by more than a radian at position 1,024 (cos and sin then mean nothing). So
    every cast or move recomputes them from the config in fp32 on the buffer's new device."""

    def __init__(self, cfg: ModelConfig, dim: int | None = None):
        super().__init__()
        self.cfg, self.dim = cfg, dim   # dim: the rotated size (latent attention's rotary part)
        self.attention_factor = attention_factor(cfg)   # a float: no cast reaches it
        self.register_buffer("inv_freq", inverse_frequencies(cfg, dim), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = inverse_frequencies(self.cfg, self.dim).to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [s] or [b, s] (integers) -> cos, sin [..., dim] in fp32 (times YaRN's
        attention factor)."""
        angles = positions.float()[..., None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        if self.attention_factor == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d] rotated by the tables [s, d] (cast to x's precision, as HF does)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    # chunk, not two slices: its backward concatenates the halves' gradients, where each
    # slice's would zero-fill a full-size gradient for autograd to sum (bit-identical, faster)
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return x * cos + rotated_half * sin


def rotary_tables(rotary: RotaryEmbedding, positions: torch.Tensor):
    """cos, sin of `positions`: [s, d] for [s], or [b, 1, s, d] for per-sample [b, s] (one row
    per sample, broadcast over the heads)."""
    cos, sin = rotary(positions)
    return (cos[:, None], sin[:, None]) if positions.dim() == 2 else (cos, sin)


def interleaved_rows(rows: torch.Tensor, rope: int, heads: int = 1,
                     to_pairs: bool = True) -> torch.Tensor:
    """A weight's rows [heads * (n + rope), ..] with each head's last `rope` (rotary) rows
    reordered from ptdp's halves (x0 x1 .. y0 y1 ..) to DeepSeek's interleaved pairs (x0 y0 x1
    y1 ..), as its and Megatron's latent-attention checkpoints hold them, or back with
    to_pairs=False. The rotation is the same; only the rows' order differs."""
    per_head = rows.unflatten(0, (heads, -1))
    order = (2, rope // 2) if to_pairs else (rope // 2, 2)
    rotary = per_head[:, -rope:].unflatten(1, order).transpose(1, 2).flatten(1, 2)
    return torch.cat([per_head[:, :-rope], rotary], dim=1).flatten(0, 1).contiguous()
