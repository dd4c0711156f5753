"""ptdp's GPT with latent attention and DeepSeek's mixture of experts <-> `DeepseekV3ForCausalLM`
(DeepSeek-V3, and the models built on its class: Kimi-K2, Moonlight).

The block is Llama's (pre-RMSNorm, rotary positions, SwiGLU, no biases, untied output layer)
with latent attention (models/latent_attention.py) and, from `first_k_dense_replace` on, a
mixture of experts: sigmoid scores, each token's k experts chosen by score plus the router's
`e_score_correction_bias` from its best `topk_group` of `n_group` groups, the k scores
renormalised (`norm_topk_prob`) and scaled (`routed_scaling_factor`), plus
`n_shared_experts` shared experts as one MLP. Mapped:
  * attention: q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj are ptdp's q_down, q_norm, q_up (q), kv_down, kv_norm,
    kv_up, proj. DeepSeek's checkpoints lay each rotary part out in interleaved pairs
    (`rope_interleave`, x0 y0 x1 y1 ..); ptdp pairs the halves (x0 x1 .. y0 y1 ..), so those rows
    are reordered on the way in, and ptdp writes `rope_interleave: false` (no reordering).
  * experts: transformers 5's stacked `mlp.experts.gate_up_proj` / `down_proj` as Mixtral's
    (ptdp/hf/moe.py); `mlp.gate.weight` is ptdp's router; `mlp.shared_experts` its shared MLP.
  * the router's `e_score_correction_bias` buffers are ptdp's selection biases, which a
    checkpoint keeps in its metadata ("moe"): ptdp applies them while
    model.moe_expert_bias_rate > 0, so a converted model gets DeepSeek-V3's rate, 0.001 (the
    rate is training's, not in HF's config; set another with `model.moe_expert_bias_rate=`).
Refused, naming the setting: rms_norm_eps other than 1e-6 (HF's latent norms keep 1e-6 whatever
it says; ptdp's use model.layernorm_eps), n_group > 1 with num_experts_per_tok / topk_group
other than 2 (HF scores a group by its best 2 experts; ptdp, as Megatron, by its best k / G'),
no mixture-of-experts layer, and what Llama's refusals name. The multi-token-prediction layers
(`num_nextn_predict_layers`, `model.layers.{num_hidden_layers + j}`), which transformers' class
does not hold, are ptdp's `mtp.{j}.*` (model.mtp_layers), read from and written to the
safetensors beside it (ptdp/hf/mtp.py).
HF masks the groups a token may not use with 0 rather than -inf: where the groups it may use
hold fewer than k experts whose score plus bias is positive, its choice can differ from ptdp's
(and Megatron's).
"""

from __future__ import annotations

import copy

import torch

from ptdp.config import ModelConfig
from ptdp.hf.base import require
from ptdp.hf.llama import Llama
from ptdp.hf.moe import _Experts
from ptdp.hf.mtp import PredictionLayers
from ptdp.models.rotary import interleaved_rows

DEEPSEEK_BIAS_RATE = 1e-3   # DeepSeek-V3's bias update speed (its paper's gamma)
LATENT_NORM_EPS = 1e-6      # transformers' DeepseekV3Attention's q_a/kv_a_layernorm
_ATTENTION = [("q_down", "q_a_proj"), ("q_norm", "q_a_layernorm"), ("q_up", "q_b_proj"),
              ("q", "q_proj"), ("kv_down", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"),
              ("kv_up", "kv_b_proj")]


class DeepseekV3(PredictionLayers, _Experts, Llama):
    model_type, hf_class, config_class = "deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config"
    latent_attention = True
    block = {**{k: v for k, v in Llama.block.items() if k != "num_experts"},   # any, or dense
             "layernorm_eps": LATENT_NORM_EPS}
    moe_block = dict(moe_score_function="sigmoid", moe_layer_freq=1, moe_shared_expert_gate=False)
    interleaved = False   # the HF weights' rotary rows in DeepSeek's pairs (`for_config`)

    def for_config(self, config) -> "DeepseekV3":
        """This family reading the weights of `config` (whose rotary rows may be in pairs)."""
        bound = copy.copy(self)
        bound.interleaved = bool(getattr(config, "rope_interleave", False))
        return bound

    def mismatches(self, cfg: ModelConfig) -> list[str]:
        out = super().mismatches(cfg)
        if not cfg.num_experts:
            return out
        out += [f"model.{key}={want} (not {getattr(cfg, key)})"
                for key, want in self.moe_block.items() if getattr(cfg, key) != want]
        if cfg.moe_router_groups > 1 and cfg.moe_top_k // cfg.moe_router_group_top_k != 2:
            out.append(f"model.moe_top_k / model.moe_router_group_top_k = 2 (not "
                       f"{cfg.moe_top_k} / {cfg.moe_router_group_top_k}: HF scores a group by "
                       f"its best 2 experts)")
        if cfg.moe_shared_ffn_hidden_size % max(cfg.moe_ffn_hidden_size, 1):
            out.append(f"model.moe_shared_ffn_hidden_size a multiple of model.moe_ffn_hidden_size "
                       f"(not {cfg.moe_shared_ffn_hidden_size}: HF's shared experts are "
                       f"n_shared_experts of that size)")
        return out

    def model_keys(self, config) -> dict:
        require(config.rms_norm_eps == LATENT_NORM_EPS,
                f"rms_norm_eps={config.rms_norm_eps}: HF's latent norms use {LATENT_NORM_EPS} "
                f"whatever it says, ptdp's use model.layernorm_eps like the others")
        keys = dict(super().model_keys(config), num_kv_heads=config.num_attention_heads,
                    head_dim=config.qk_nope_head_dim, mla_kv_lora_rank=config.kv_lora_rank,
                    mla_q_lora_rank=config.q_lora_rank or 0,
                    mla_rope_head_dim=config.qk_rope_head_dim, mla_v_head_dim=config.v_head_dim)
        if config.first_k_dense_replace >= config.num_hidden_layers:
            return keys   # every layer dense
        return dict(keys, **self._moe_keys(config))

    def _moe_keys(self, config) -> dict:
        k, groups, best = config.num_experts_per_tok, config.n_group or 1, config.topk_group or 1
        require(groups == 1 or k // best == 2,
                f"n_group={groups}, topk_group={best}, num_experts_per_tok={k}: HF scores a group "
                f"by its best 2 experts, ptdp by its best k / topk_group = {k // best}")
        return dict(num_experts=config.n_routed_experts, moe_top_k=k,
                    moe_ffn_hidden_size=config.moe_intermediate_size,
                    moe_shared_ffn_hidden_size=(config.n_shared_experts or 0)
                    * config.moe_intermediate_size,
                    moe_first_dense_layers=config.first_k_dense_replace,
                    moe_score_function="sigmoid",
                    moe_renormalize=bool(config.norm_topk_prob),
                    moe_routed_scaling_factor=float(config.routed_scaling_factor),
                    moe_expert_bias_rate=DEEPSEEK_BIAS_RATE,
                    **(dict(moe_router_groups=groups, moe_router_group_top_k=best)
                       if groups > 1 else {}))

    def hf_extra(self, cfg: ModelConfig) -> dict:
        attention = dict(attention_bias=False, num_key_value_heads=cfg.num_heads,
                         qk_nope_head_dim=cfg.head_dim, qk_rope_head_dim=cfg.mla_rope_head_dim,
                         head_dim=cfg.mla_rope_head_dim, v_head_dim=cfg.mla_v_head_dim,
                         kv_lora_rank=cfg.mla_kv_lora_rank,
                         q_lora_rank=cfg.mla_q_lora_rank or None, rope_interleave=False,
                         num_nextn_predict_layers=cfg.mtp_layers)
        if not cfg.num_experts:   # every layer dense (HF's expert sizes then build nothing)
            return dict(attention, first_k_dense_replace=cfg.num_layers)
        return dict(attention, n_routed_experts=cfg.num_experts,
                    num_experts_per_tok=cfg.moe_top_k,
                    moe_intermediate_size=cfg.moe_ffn_hidden_size,
                    n_shared_experts=cfg.moe_shared_ffn_hidden_size // cfg.moe_ffn_hidden_size,
                    first_k_dense_replace=cfg.moe_first_dense_layers,
                    norm_topk_prob=cfg.moe_renormalize,
                    routed_scaling_factor=cfg.moe_routed_scaling_factor,
                    n_group=cfg.moe_router_groups, topk_group=cfg.moe_router_group_top_k)

    def attention_to_hf(self, cfg, full, ours: str, theirs: str, out: dict) -> None:
        for mine, hf_name in _ATTENTION:
            if f"{ours}{mine}.weight" in full:
                out[f"{theirs}{hf_name}.weight"] = full[f"{ours}{mine}.weight"]

    def attention_from_hf(self, cfg, get, ours: str, theirs: str, out: dict) -> None:
        skip = ("q",) if cfg.mla_q_lora_rank else ("q_down", "q_norm", "q_up")
        names = [(mine, hf_name) for mine, hf_name in _ATTENTION if mine not in skip]
        rope, heads = cfg.mla_rope_head_dim, cfg.num_heads
        for mine, hf_name in names:
            value = get(f"{theirs}{hf_name}.weight")
            if self.interleaved and mine in ("q_up", "q", "kv_down"):
                value = interleaved_rows(value, rope, heads if mine != "kv_down" else 1,
                                         to_pairs=False)
            out[f"{ours}{mine}.weight"] = value.contiguous()

    def mlp_to_hf(self, cfg, layer: int, full, ours: str, theirs: str, out: dict) -> None:
        super().mlp_to_hf(cfg, layer, full, ours, theirs, out)
        if cfg.is_moe_layer(layer) and cfg.moe_shared_ffn_hidden_size:
            Llama.mlp_to_hf(cfg, layer, full, f"{ours}shared.mlp.", f"{theirs}shared_experts.",
                            out)

    def mlp_from_hf(self, cfg, layer: int, get, ours: str, theirs: str, out: dict) -> None:
        super().mlp_from_hf(cfg, layer, get, ours, theirs, out)
        if cfg.is_moe_layer(layer) and cfg.moe_shared_ffn_hidden_size:
            Llama.mlp_from_hf(cfg, layer, get, f"{ours}shared.mlp.", f"{theirs}shared_experts.",
                              out)

    def meta_from_hf(self, cfg: ModelConfig, hf: dict) -> dict | None:
        """The routers' selection biases as a ptdp checkpoint's metadata keeps them (the
        prediction depths' under num_layers + j)."""
        if not cfg.num_experts:
            return None
        biases = {str(i): hf[f"model.layers.{i}.mlp.gate.e_score_correction_bias"].float().tolist()
                  for i in range(cfg.num_layers + cfg.mtp_layers) if cfg.is_moe_layer(i)}
        return {"moe": {"expert_bias": biases}}

    def meta_to_hf(self, cfg: ModelConfig, meta: dict, out: dict) -> None:
        """Each MoE layer's `e_score_correction_bias` (the depths' too): the checkpoint's
        biases (0 without)."""
        biases = meta.get("moe", {}).get("expert_bias", {})
        for i in range(cfg.num_layers + cfg.mtp_layers):
            if cfg.is_moe_layer(i):
                out[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = torch.tensor(
                    biases.get(str(i), [0.0] * cfg.num_experts), dtype=torch.float32)
