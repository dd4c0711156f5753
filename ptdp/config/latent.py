"""Multi-head latent attention's keys (model.mla_*; models/latent_attention.py): checks of the
keys on their own, against the rest of the block and against the layout, one line each.
Torch-free, like the rest of ptdp/config/; ptdp/config/validation.py calls them."""

from __future__ import annotations

import dataclasses

from ptdp.config.models import MODEL_FAMILIES, family_names
from ptdp.config.problems import Problems
from ptdp.config.schema import Config, ModelConfig


def _mla_keys_set(m: ModelConfig) -> list[str]:
    """The model.mla_* keys that differ from their defaults (mla_v_head_dim: from head_dim)."""
    changed = [f"model.{f.name}" for f in dataclasses.fields(m)
               if f.name.startswith("mla_") and f.name != "mla_v_head_dim"
               and getattr(m, f.name) != f.default]
    return changed + (["model.mla_v_head_dim"] if m.mla_v_head_dim != m.head_dim else [])


def check_latent_attention(m: ModelConfig, out: Problems) -> None:
    """The MLA keys, and the block options MLA replaces or lacks."""
    if not out.positive(m.mla_kv_lora_rank, "model.mla_kv_lora_rank", strict=False,
                        hint=" (0: the usual QKV projection)"):
        return
    if not m.latent_attention:
        unused = _mla_keys_set(m)
        out.require(not unused, f"{', '.join(unused)} set while model.mla_kv_lora_rank = 0 (no "
                                f"latent attention): set model.mla_kv_lora_rank or remove them")
        return
    family = MODEL_FAMILIES.get(m.arch)
    out.require(family is None or (family.block_options and family.causal),
                f"model.mla_kv_lora_rank > 0 (latent attention) applies to model.arch="
                f"{family_names(lambda f: f.block_options and f.causal)} only")
    out.positive(m.mla_q_lora_rank, "model.mla_q_lora_rank", strict=False,
                 hint=" (0: queries from the hidden state directly)")
    if out.positive(m.mla_rope_head_dim, "model.mla_rope_head_dim"):
        out.require(m.mla_rope_head_dim % 2 == 0, f"model.mla_rope_head_dim must be even (the "
                                                  f"rotary pairs), got {m.mla_rope_head_dim}")
    out.positive(m.mla_v_head_dim, "model.mla_v_head_dim", hint=" (null = model.head_dim)")
    out.require(m.position_embedding == "rope", "model.mla_kv_lora_rank > 0 needs "
                                                "model.position_embedding=rope (the rotary key "
                                                "part is what latent attention keeps apart)")
    out.require(m.num_kv_heads == m.num_heads,
                f"model.num_kv_heads ({m.num_kv_heads}) must equal model.num_heads "
                f"({m.num_heads}) with latent attention: every head has its own keys and values "
                f"from the latent")
    replaced = [key for key, off in (("qk_norm", False), ("qkv_bias", False))
                if getattr(m, key) != off]
    out.require(not replaced, f"{', '.join('model.' + k for k in replaced)}: not with latent "
                              f"attention (its latents have their own norms and no biases)")


def check_latent_layout(cfg: Config, out: Problems) -> None:
    """Latent attention against the layout: the context ring's kernels take one head size, so
    there the value heads are zero-padded up to the query/key heads' (models/latent_attention.py)
    and must not be larger."""
    m, c = cfg.model, cfg.parallel.context
    if m.latent_attention and c > 1:
        qk = m.head_dim + m.mla_rope_head_dim
        out.require(m.mla_v_head_dim <= qk,
                    f"model.mla_v_head_dim ({m.mla_v_head_dim}) must be at most model.head_dim + "
                    f"model.mla_rope_head_dim = {qk} with parallel.context={c}: the context "
                    f"ring pads the value heads up to the query/key heads' size")
