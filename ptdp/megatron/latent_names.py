"""Latent attention's weight names and rows between megatron-core's MLASelfAttention and ptdp's
(ptdp/megatron/latent.py says what they compute; ptdp/megatron/names.py maps the rest): the
names of a layer's latent attention, the rotary rows megatron-core keeps in DeepSeek's
interleaved pairs, and TransformerEngine's fused norm names."""

from __future__ import annotations

from ptdp.megatron.mtp_names import layer_index
from ptdp.models.rotary import interleaved_rows

_ROTARY_ROWS = ("self_attention.linear_q_up_proj.weight", "self_attention.linear_q_proj.weight",
                "self_attention.linear_kv_down_proj.weight")


def latent_pairs(cfg, ours: str, theirs: str, norm_kinds, proj_kinds):
    """(ptdp, Megatron) names of layer's latent attention (`ours`/`theirs`: the layer's
    prefixes)."""
    a, m = f"{ours}attention.", f"{theirs}self_attention."
    if cfg.mla_q_lora_rank:
        yield f"{a}q_down.weight", f"{m}linear_q_down_proj.weight"
        for kind in norm_kinds:
            yield f"{a}q_norm.{kind}", f"{m}q_layernorm.{kind}"
        yield f"{a}q_up.weight", f"{m}linear_q_up_proj.weight"
    else:
        yield f"{a}q.weight", f"{m}linear_q_proj.weight"
    yield f"{a}kv_down.weight", f"{m}linear_kv_down_proj.weight"
    for kind in norm_kinds:
        yield f"{a}kv_norm.{kind}", f"{m}kv_layernorm.{kind}"
    yield f"{a}kv_up.weight", f"{m}linear_kv_up_proj.weight"
    for kind in proj_kinds:
        yield f"{a}proj.{kind}", f"{m}linear_proj.{kind}"


def rotary_rows(cfg, theirs: str, value, to_pairs: bool):
    """A Megatron weight with its rotary rows in ptdp's halves (to_pairs=False) or Megatron's
    pairs; other weights unchanged."""
    if not cfg.latent_attention or not theirs.endswith(_ROTARY_ROWS):
        return value
    heads = 1 if theirs.endswith("linear_kv_down_proj.weight") else cfg.num_heads
    return interleaved_rows(value, cfg.mla_rope_head_dim, heads, to_pairs=to_pairs)


def fused_latent_names(state: dict, cfg) -> dict:
    """The local spec's names -> TransformerEngine's MLA spec's: the latent norms into the
    up-projections, a dense layer's pre-MLP norm into fc1 (megatron-core's MoE layers keep
    theirs; a prediction depth's layer is of global index num_layers + j), input_layernorm
    kept."""
    out = {}
    for name, value in state.items():
        name = name.replace(".self_attention.q_layernorm.",
                            ".self_attention.linear_q_up_proj.layer_norm_")
        name = name.replace(".self_attention.kv_layernorm.",
                            ".self_attention.linear_kv_up_proj.layer_norm_")
        if ".pre_mlp_layernorm." in name and not cfg.is_moe_layer(layer_index(cfg, name)):
            name = name.replace(".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")
        out[name] = value
    return out
