"""Multi-head latent attention (`--multi-latent-attention`, DeepSeek-V2/V3) between megatron-core
0.16's MLASelfAttention and ptdp's (models/latent_attention.py).

Weights: linear_q_down_proj, q_layernorm, linear_q_up_proj (or linear_q_proj without a query
latent), linear_kv_down_proj, kv_layernorm, linear_kv_up_proj, linear_proj are ptdp's q_down,
q_norm, q_up (q), kv_down, kv_norm, kv_up, proj; the rows are head-major in both, each head's
[non-rotary, rotary] or [key, value]. megatron-core's rotary input is in DeepSeek's interleaved
pairs (rope_utils.py `_apply_rotary_pos_emb_bshd` with multi_latent_attention takes
`t[..., 0::2]`, `t[..., 1::2]` before rotating halves), so the rotary rows of q_up / q and
kv_down are reordered as ptdp/hf/deepseek.py does for Hugging Face's. The latent norms exist
only with --qk-layernorm (the specs' q_layernorm / kv_layernorm are IdentityOp otherwise):
without it the latents are not normalised, which ptdp's always are, so that is refused.
TransformerEngine's spec fuses the latent norms into the up-projections
(`linear_q_up_proj.layer_norm_weight`) and, in a dense layer, the pre-MLP norm into fc1; its
input_layernorm stays a module of its own.

Rotary: --rope-type rope (plain frequencies of qk_pos_emb_head_dim, --rotary-base; Megatron's
--use-rope-scaling does not reach MLA) or yarn (megatron-core's default for MLA:
YarnRotaryEmbedding with --rotary-scaling-factor, original_max_position_embeddings, beta_fast,
beta_slow, --mscale, --mscale-all-dim), ptdp's rope_scaling_type: yarn. The softmax scale is
mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)
whatever the rope type; ptdp's (models/rotary.py `softmax_scale_multiplier`, `attention_factor`)
is checked equal to megatron-core's, and a setting where they differ is refused in one line.
The names and rows are ptdp/megatron/latent_names.py's; `ptdp config from-megatron`'s flags
ptdp/megatron/latent_flags.py's.
"""

from __future__ import annotations

import math

from ptdp.megatron.errors import argument, require

# Megatron-LM's and MLATransformerConfig's defaults (megatron-core 0.16.1)
YARN_DEFAULTS = dict(original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """megatron-core's `_yarn_get_mscale`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def megatron_scales(rope_type: str, factor: float, mscale, all_dim) -> tuple[float, float]:
    """(the cos/sin factor, the softmax scale's multiplier of 1/sqrt(d)) megatron-core's MLA
    computes (multi_latent_attention.py, yarn_rotary_pos_embedding.py
    `_yarn_get_concentration_factor`)."""
    multiplier = _mscale(factor, all_dim or 0.0) ** 2
    if rope_type != "yarn":
        return 1.0, multiplier
    if mscale is None or all_dim is None:
        return _mscale(factor), multiplier
    return float(_mscale(factor, mscale) / _mscale(factor, all_dim)), multiplier


def _ptdp_scales(keys: dict) -> tuple[float, float]:
    from ptdp.config import ModelConfig
    from ptdp.models.rotary import attention_factor, softmax_scale_multiplier
    cfg = ModelConfig(**keys)
    return attention_factor(cfg), softmax_scale_multiplier(cfg)


def latent_config(args, base: dict) -> dict:
    """ModelConfig keys of a checkpoint's MLA args (`base`: the other keys, for the check that
    ptdp's scales are megatron-core's)."""
    require(argument(args, "qk_layernorm", False),
            "--multi-latent-attention without --qk-layernorm: megatron-core's latents are then "
            "not normalised (its q_layernorm / kv_layernorm are identities); ptdp's always are")
    require(argument(args, "rotary_percent", 1.0) == 1.0,
            "--rotary-percent with --multi-latent-attention: ptdp rotates the whole rotary part")
    rope_type = argument(args, "rope_type", "yarn")
    require(rope_type in ("rope", "yarn"), f"--rope-type={rope_type}: megatron-core's MLA has "
                                           f"rope and yarn")
    factor = float(argument(args, "rotary_scaling_factor", 1.0))
    mscale, all_dim = getattr(args, "mscale", 1.0), getattr(args, "mscale_all_dim", 0.0)
    keys = dict(num_kv_heads=base["num_heads"], qkv_bias=False, qk_norm=False,
                head_dim=argument(args, "qk_head_dim", 128),
                mla_kv_lora_rank=argument(args, "kv_lora_rank", 512),
                mla_q_lora_rank=argument(args, "q_lora_rank", 0),
                mla_rope_head_dim=argument(args, "qk_pos_emb_head_dim", 64),
                mla_v_head_dim=argument(args, "v_head_dim", 128))
    if rope_type == "yarn" and factor != 1.0:
        keys.update(rope_scaling_type="yarn", rope_scaling_factor=factor, rope_yarn_truncate=True,
                    rope_original_seq_length=int(argument(
                        args, "original_max_position_embeddings",
                        YARN_DEFAULTS["original_max_position_embeddings"])),
                    rope_yarn_beta_fast=float(argument(args, "beta_fast", 32.0)),
                    rope_yarn_beta_slow=float(argument(args, "beta_slow", 1.0)),
                    rope_yarn_mscale=mscale if mscale and all_dim else None,
                    rope_yarn_mscale_all_dim=all_dim or None)
        want = megatron_scales("yarn", factor, mscale, all_dim)
        if _ptdp_scales({**base, **keys})[0] != want[0]:   # the cos/sin factor, given
            keys["rope_yarn_attention_factor"] = want[0]
    else:   # plain frequencies (YaRN with factor 1 is too)
        keys.update(rope_scaling_factor=1.0)
        want = megatron_scales(rope_type, factor, mscale, all_dim)
    got = _ptdp_scales({**base, **keys})
    require(got == want, f"--rope-type={rope_type} --rotary-scaling-factor={factor} --mscale="
                         f"{mscale} --mscale-all-dim={all_dim}: megatron-core scales cos/sin by "
                         f"{want[0]} and the softmax by {want[1]} / sqrt(d); ptdp would by "
                         f"{got[0]} and {got[1]}")
    return keys


def refuse_latent_for_megatron(cfg) -> None:
    """What of ptdp's latent attention megatron-core's would compute otherwise."""
    yarn = cfg.rope_scaling_factor != 1.0
    require(not yarn or cfg.rope_scaling_type == "yarn",
            f"model.rope_scaling_type={cfg.rope_scaling_type} with latent attention: "
            f"megatron-core's MLA scales rotary positions by YaRN only (--rope-type yarn)")
    if not yarn:
        return
    for key, theirs in (("rope_original_seq_length", "original_max_position_embeddings"),
                        ("rope_yarn_beta_fast", "beta_fast"), ("rope_yarn_beta_slow", "beta_slow")):
        require(getattr(cfg, key) == YARN_DEFAULTS[theirs],
                f"model.{key}={getattr(cfg, key)}: Megatron-LM has no flag for MLA's {theirs}; "
                f"megatron-core fixes it at {YARN_DEFAULTS[theirs]}")
    require(cfg.rope_yarn_truncate, "model.rope_yarn_truncate=false: megatron-core's YaRN rounds "
                                    "the ramp's ends to whole dimensions")
    theirs = megatron_scales("yarn", cfg.rope_scaling_factor, *_mscales(cfg))
    ours = _ptdp_scales(_keys(cfg))
    require(all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(theirs, ours)),
            f"model.rope_yarn_*: megatron-core would scale cos/sin by "
                            f"{theirs[0]} and the softmax by {theirs[1]} / sqrt(d), ptdp scales "
                            f"them by {ours[0]} and {ours[1]}")


def _keys(cfg) -> dict:
    import dataclasses
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}


def _mscales(cfg) -> tuple[float, float]:
    """(--mscale, --mscale-all-dim) giving ptdp's YaRN factors (Megatron-LM's defaults 1 and
    0): a given cos/sin factor (rope_yarn_attention_factor) is mscale(f, m) / mscale(f, a) for
    the m solved here."""
    factor, all_dim = cfg.rope_scaling_factor, cfg.rope_yarn_mscale_all_dim or 0.0
    if cfg.rope_yarn_attention_factor is not None:
        given = cfg.rope_yarn_attention_factor
        solved = (given * _mscale(factor, all_dim) - 1.0) / (0.1 * math.log(factor))
        return float(f"{solved:.12g}"), all_dim   # (the flag's value, as it was typed)
    if cfg.rope_yarn_mscale and all_dim:
        return cfg.rope_yarn_mscale, all_dim
    return 1.0, all_dim


def latent_megatron_args(cfg) -> dict:
    """Megatron-LM's MLA arguments of ptdp's model (every layer the MLA ones when latent)."""
    if not cfg.latent_attention:
        return dict(multi_latent_attention=False, qk_layernorm=False)
    yarn = cfg.rope_scaling_factor != 1.0
    mscale, all_dim = _mscales(cfg) if yarn else (1.0, 0.0)
    return dict(multi_latent_attention=True, qk_layernorm=True,
                q_lora_rank=cfg.mla_q_lora_rank or None, kv_lora_rank=cfg.mla_kv_lora_rank,
                qk_head_dim=cfg.head_dim, qk_pos_emb_head_dim=cfg.mla_rope_head_dim,
                v_head_dim=cfg.mla_v_head_dim, rope_type="yarn" if yarn else "rope",
                rotary_scaling_factor=cfg.rope_scaling_factor if yarn else 1.0,
                mscale=mscale, mscale_all_dim=all_dim)
