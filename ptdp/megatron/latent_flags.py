"""Megatron-LM's multi-head latent attention arguments -> ptdp's latent attention keys
(model.mla_*; models/latent_attention.py): their rows of the table in
ptdp/megatron/arguments.py (LATENT_ARGS), and converters. Torch-free.

Megatron-LM core_v0.16.1 (megatron/training/arguments.py): --q-lora-rank (default none: no
query latent), --kv-lora-rank (32), --qk-head-dim (128), --qk-pos-emb-head-dim (64),
--v-head-dim (128), --rotary-scaling-factor (1.0), --mscale (1.0), --mscale-all-dim (0.0),
--rope-type (none: MLATransformerConfig's yarn); --multi-latent-attention and --qk-layernorm
are TransformerConfig's fields. original_max_position_embeddings (4096), beta_fast (32) and
beta_slow (1) have no flags. What they compute is ptdp/megatron/latent.py's: YaRN with a
factor above 1 is ptdp's rope_scaling_type: yarn; megatron-core's softmax scale multiplier
mscale(factor, mscale_all_dim)^2 applies whatever the rope type, which ptdp's plain rope lacks
(refused). Without --qk-layernorm the latents are not normalised: refused. --kv-channels,
--use-rope-scaling and --rotary-percent do not reach MLA's heads or rotary part: ignored.
"""

from __future__ import annotations

import math

from ptdp.megatron.converters import (EXACT, IGNORED, REFUSED, Unmapped, given_int, ignore)
from ptdp.megatron.rows import Arg

LATENT = "--multi-latent-attention"


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _float(given: dict, flag: str, default: float) -> float:
    value = given.get(flag)
    return float(value) if value is not None else default


def multi_latent_attention(value, given):
    if "--qk-layernorm" not in given:
        raise Unmapped(REFUSED, "without --qk-layernorm megatron-core's latents are not "
                                "normalised (identities); ptdp's always are")
    keys = {"model.mla_kv_lora_rank": given_int(given, "--kv-lora-rank", 32),
            "model.mla_q_lora_rank": given_int(given, "--q-lora-rank", 0),
            "model.head_dim": given_int(given, "--qk-head-dim", 128),
            "model.mla_rope_head_dim": given_int(given, "--qk-pos-emb-head-dim", 64),
            "model.mla_v_head_dim": given_int(given, "--v-head-dim", 128)}
    kind = given.get("--rope-type") or "yarn"
    factor = _float(given, "--rotary-scaling-factor", 1.0)
    mscale, all_dim = _float(given, "--mscale", 1.0), _float(given, "--mscale-all-dim", 0.0)
    if kind != "yarn" or factor == 1.0:
        if _mscale(factor, all_dim) != 1.0:
            raise Unmapped(REFUSED, f"--rope-type {kind} with --rotary-scaling-factor {factor} "
                                    f"and --mscale-all-dim {all_dim}: megatron-core scales the "
                                    f"softmax by mscale^2 without YaRN positions; ptdp does not")
        return keys
    keys.update({"model.rope_scaling_type": "yarn", "model.rope_scaling_factor": factor,
                 "model.rope_original_seq_length": 4096})
    if mscale and all_dim:   # ptdp's (and HF's) DeepSeek factors
        keys.update({"model.rope_yarn_mscale": mscale, "model.rope_yarn_mscale_all_dim": all_dim})
    else:
        if all_dim:
            keys["model.rope_yarn_mscale_all_dim"] = all_dim
        if mscale != 1.0 or all_dim:   # megatron-core's cos/sin factor, given
            keys["model.rope_yarn_attention_factor"] = _mscale(factor, mscale) / _mscale(
                factor, all_dim)
    return keys


def latent_only(value, given):
    """Written by --multi-latent-attention; ignored without it, as Megatron ignores it."""
    if LATENT not in given:
        raise Unmapped(IGNORED, "Megatron uses it only with --multi-latent-attention")
    return {}


def rope_type(value, given):
    if LATENT in given:
        return {}   # written by --multi-latent-attention
    if value != "rope":
        raise Unmapped(REFUSED, "Megatron-LM's usual attention takes --rope-type rope only")
    return {}


def not_with_latent(convert, why: str):
    """A usual-attention converter, ignored with --multi-latent-attention (`why`)."""
    def wrapped(value, given):
        if LATENT in given:
            raise Unmapped(IGNORED, why)
        return convert(value, given)
    return wrapped


def qk_layernorm(value, given):
    """The latent norms with --multi-latent-attention (ptdp's always there); else model.qk_norm."""
    return {} if LATENT in given else True


_WITH = "with --multi-latent-attention"
LATENT_ARGS: tuple[Arg, ...] = (
    Arg(LATENT, "model.mla_kv_lora_rank", EXACT, multi_latent_attention, nargs=0, model=True,
        note="with --qk-layernorm (the latent norms); the sizes below, YaRN positions "
             "(--rope-type yarn, MLA's default) when --rotary-scaling-factor > 1"),
    Arg("--q-lora-rank", "model.mla_q_lora_rank", EXACT, latent_only,
        note=f"{_WITH}; absent: queries from the hidden state (0)"),
    Arg("--kv-lora-rank", "model.mla_kv_lora_rank", EXACT, latent_only,
        note=f"{_WITH} (default 32)"),
    Arg("--qk-head-dim", "model.head_dim", EXACT, latent_only,
        note=f"{_WITH} (default 128): each head's non-rotary part"),
    Arg("--qk-pos-emb-head-dim", "model.mla_rope_head_dim", EXACT, latent_only,
        note=f"{_WITH} (default 64)"),
    Arg("--v-head-dim", "model.mla_v_head_dim", EXACT, latent_only,
        note=f"{_WITH} (default 128)"),
    Arg("--rope-type", "model.rope_scaling_type", EXACT, rope_type,
        note=f"{_WITH}: yarn (its default) or rope; otherwise rope only"),
    Arg("--rotary-scaling-factor", "model.rope_scaling_factor", EXACT, latent_only,
        note=f"{_WITH}: YaRN's factor (original 4096 positions, beta 32 / 1, as megatron-core)"),
    Arg("--mscale", "model.rope_yarn_mscale", EXACT, latent_only, note=f"{_WITH} and YaRN"),
    Arg("--mscale-all-dim", "model.rope_yarn_mscale_all_dim", EXACT, latent_only,
        note=f"{_WITH} and YaRN; the softmax scale's multiplier too"),
    Arg("--cache-mla-latents", None, IGNORED,
        ignore("an inference-cache option of megatron-core's dynamic backend"), nargs=0),
)
