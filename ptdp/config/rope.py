"""Rotary positions' keys (model.rope_*; models/rotary.py): the base, the scaling (Llama 3's or
YaRN's) and the keys each scaling reads, one line per problem. A key the configured scaling
does not read is refused rather than ignored. Torch-free, like the rest of ptdp/config/;
ptdp/config/validation.py calls it."""

from __future__ import annotations

import dataclasses

from ptdp.config.problems import Problems
from ptdp.config.schema import ModelConfig

SCALING_TYPES = ("llama3", "yarn")
LLAMA3_KEYS = ("rope_low_freq_factor", "rope_high_freq_factor")


def _changed(m: ModelConfig, names) -> list[str]:
    """The keys of `names` that differ from their defaults, as model.KEY."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    return [f"model.{name}" for name in names if getattr(m, name) != defaults[name]]


def _yarn_keys(m: ModelConfig) -> list[str]:
    return [f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith("rope_yarn_")]


def check_rope(m: ModelConfig, out: Problems, sizes_ok: bool) -> None:
    """The rope_* keys of a rotary model."""
    if sizes_ok:
        out.require(m.head_dim % 2 == 0, f"model.position_embedding=rope needs an even head "
                                         f"size, got model.head_dim = {m.head_dim}")
    out.positive(m.rope_theta, "model.rope_theta")
    out.require(m.rope_scaling_factor >= 1.0, f"model.rope_scaling_factor must be >= 1 "
                                              f"(1 = off), got {m.rope_scaling_factor}")
    out.choice(m.rope_scaling_type, SCALING_TYPES, "model.rope_scaling_type")
    if m.rope_scaling_factor == 1.0:   # no scaling: its keys would do nothing
        unused = _changed(m, ["rope_scaling_type", *_yarn_keys(m)])
        out.require(not unused, f"{', '.join(unused)} apply with model.rope_scaling_factor > 1 "
                                f"only (1 = no scaling)")
        return
    out.positive(m.rope_original_seq_length, "model.rope_original_seq_length")
    if m.rope_scaling_type == "yarn":
        _check_yarn(m, out)
        return
    unused = _changed(m, _yarn_keys(m))
    out.require(not unused, f"{', '.join(unused)} apply to model.rope_scaling_type=yarn only "
                            f"(this model's is {m.rope_scaling_type})")
    out.require(m.rope_high_freq_factor > m.rope_low_freq_factor > 0,
                f"model.rope_high_freq_factor ({m.rope_high_freq_factor}) must exceed "
                f"model.rope_low_freq_factor ({m.rope_low_freq_factor}) > 0")


def _check_yarn(m: ModelConfig, out: Problems) -> None:
    unused = _changed(m, LLAMA3_KEYS)
    out.require(not unused, f"{', '.join(unused)} apply to model.rope_scaling_type=llama3 only "
                            f"(YaRN's ramp is set by model.rope_yarn_beta_fast/beta_slow)")
    out.require(m.rope_yarn_beta_fast > m.rope_yarn_beta_slow > 0,
                f"model.rope_yarn_beta_fast ({m.rope_yarn_beta_fast}) must exceed "
                f"model.rope_yarn_beta_slow ({m.rope_yarn_beta_slow}) > 0")
    for key in ("rope_yarn_mscale", "rope_yarn_mscale_all_dim", "rope_yarn_attention_factor"):
        value = getattr(m, key)
        if value is not None:
            out.positive(value, f"model.{key}", hint=" (null = unset)")
    mscale_used = m.rope_yarn_mscale_all_dim is not None and m.rope_yarn_attention_factor is None
    out.require(m.rope_yarn_mscale is None or mscale_used,
                "model.rope_yarn_mscale does nothing without model.rope_yarn_mscale_all_dim or "
                "beside model.rope_yarn_attention_factor (the cos/sin factor is then "
                "0.1 ln(factor) + 1, or the attention factor): remove it")
