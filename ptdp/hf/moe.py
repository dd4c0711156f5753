"""The mixtures of experts <-> ptdp's MoE GPT (models/moe.py, docs/moe.md): `MixtralForCausalLM`
(Mistral's block, every MLP a mixture), `Qwen2MoeForCausalLM` (Qwen2's block, a shared expert
behind a sigmoid gate) and `Qwen3MoeForCausalLM` (Qwen3's block: QK-norm, an explicit head size).

transformers 5 holds each layer's experts stacked (`mlp.experts.gate_up_proj` [E, 2f, h], gate
rows then up rows, and `mlp.experts.down_proj` [E, h, f]) and its save_pretrained writes them
per expert in the released layout (Mixtral's `block_sparse_moe.experts.{j}.w1/w2/w3`, Qwen's
`mlp.experts.{j}.gate_proj/up_proj/down_proj`), which from_pretrained reads back: the mapping
here is between the stacked tensors and ptdp's one parameter per expert
(`mlp.experts.{j}.fc1.weight`, gate and up rows alternating as in the dense SwiGLU MLP;
`fc2.weight`), so both file layouts convert. The router (`mlp.gate.weight`) is ptdp's
`mlp.router.weight`: softmax scores in fp32, the top k, renormalised where the family does
(Mixtral always; Qwen's norm_topk_prob). Qwen2-MoE's shared expert is ptdp's shared MLP
(`mlp.shared.mlp.fc1/fc2`) and its `shared_expert_gate` ptdp's `mlp.shared.gate`.

Which layers are mixtures: Qwen's `(i + 1) % decoder_sparse_step == 0` and not in
`mlp_only_layers` must be ptdp's every `model.moe_layer_freq`-th layer after the first
`model.moe_first_dense_layers`; any other pattern is refused in one line. Training-time extras
of HF's config (router_aux_loss_coef with output_router_logits, router jitter) are not carried:
set model.moe_aux_loss_coeff to balance the load; a jitter above 0 is refused.
"""

from __future__ import annotations

import torch

from ptdp.config import ModelConfig
from ptdp.hf.base import Set, fc1_of_gate_then_up, gate_then_up, require
from ptdp.hf.llama import Llama, Mistral, Qwen2, Qwen3

MOE = dict(num_experts=Set(0), moe_score_function="softmax", moe_routed_scaling_factor=1.0,
           moe_expert_bias_rate=0.0, moe_shared_ffn_hidden_size=0, moe_router_groups=1,
           moe_router_group_top_k=1)


class _Experts:
    """The MLP of a MoE layer both ways (a dense layer: Llama's)."""

    shared = False   # Qwen2-MoE's shared expert and its gate

    def mlp_to_hf(self, cfg, layer: int, full, ours: str, theirs: str, out: dict) -> None:
        if not cfg.is_moe_layer(layer):
            return Llama.mlp_to_hf(cfg, layer, full, ours, theirs, out)
        out[f"{theirs}gate.weight"] = full[f"{ours}router.weight"]
        experts = range(cfg.num_experts)
        out[f"{theirs}experts.gate_up_proj"] = torch.stack(
            [gate_then_up(full[f"{ours}experts.{j}.fc1.weight"]) for j in experts])
        out[f"{theirs}experts.down_proj"] = torch.stack(
            [full[f"{ours}experts.{j}.fc2.weight"] for j in experts])
        if self.shared:
            Llama.mlp_to_hf(cfg, layer, full, f"{ours}shared.mlp.", f"{theirs}shared_expert.", out)
            out[f"{theirs}shared_expert_gate.weight"] = full[f"{ours}shared.gate"]

    def mlp_from_hf(self, cfg, layer: int, get, ours: str, theirs: str, out: dict) -> None:
        if not cfg.is_moe_layer(layer):
            return Llama.mlp_from_hf(cfg, layer, get, ours, theirs, out)
        out[f"{ours}router.weight"] = get(f"{theirs}gate.weight")
        gate_up, down = get(f"{theirs}experts.gate_up_proj"), get(f"{theirs}experts.down_proj")
        for j in range(cfg.num_experts):
            out[f"{ours}experts.{j}.fc1.weight"] = fc1_of_gate_then_up(gate_up[j])
            out[f"{ours}experts.{j}.fc2.weight"] = down[j].contiguous()
        if self.shared:
            Llama.mlp_from_hf(cfg, layer, get, f"{ours}shared.mlp.", f"{theirs}shared_expert.", out)
            out[f"{ours}shared.gate"] = get(f"{theirs}shared_expert_gate.weight")

    @staticmethod
    def refuse_jitter(config) -> None:
        jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
        require(jitter == 0, f"router_jitter_noise={jitter} perturbs the router's input in "
                             f"training; ptdp's router has no jitter")


class Mixtral(_Experts, Mistral):
    model_type, hf_class, config_class = "mixtral", "MixtralForCausalLM", "MixtralConfig"
    block = {**Mistral.block, **MOE, "moe_renormalize": True, "moe_layer_freq": 1,
             "moe_first_dense_layers": 0}

    def model_keys(self, config) -> dict:
        self.refuse_jitter(config)
        return dict(super().model_keys(config), num_experts=config.num_local_experts,
                    moe_top_k=config.num_experts_per_tok,
                    moe_ffn_hidden_size=config.intermediate_size, moe_renormalize=True)

    def hf_extra(self, cfg: ModelConfig) -> dict:
        return dict(super().hf_extra(cfg), num_local_experts=cfg.num_experts,
                    num_experts_per_tok=cfg.moe_top_k, intermediate_size=cfg.moe_ffn_hidden_size,
                    router_jitter_noise=0.0)


def qwen_moe_layers(config) -> dict:
    """model.moe_first_dense_layers and moe_layer_freq of a Qwen MoE config, or a refusal."""
    layers = config.num_hidden_layers
    step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or ())
    moe = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    require(moe, f"mlp_only_layers={sorted(dense)} and decoder_sparse_step={step} leave no "
                 f"mixture of experts: convert it as a dense model")
    first, freq = moe[0], (moe[1] - moe[0] if len(moe) > 1 else 1)
    ours = [i for i in range(layers) if i >= first and (i - first) % freq == 0]
    require(ours == moe, f"mlp_only_layers={sorted(dense)} with decoder_sparse_step={step} puts "
                         f"experts in layers {moe}; ptdp's are every model.moe_layer_freq-th "
                         f"layer after the first model.moe_first_dense_layers")
    return dict(moe_first_dense_layers=first, moe_layer_freq=freq)


def qwen_moe_config(cfg: ModelConfig) -> dict:
    """Qwen MoE's config keys of ptdp's model (the inverse of qwen_moe_layers)."""
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    step = cfg.moe_layer_freq if cfg.moe_first_dense_layers == cfg.moe_layer_freq - 1 else 1
    dense = [i for i in range(cfg.num_layers) if i not in moe and (i + 1) % step == 0]
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_top_k,
                moe_intermediate_size=cfg.moe_ffn_hidden_size, norm_topk_prob=cfg.moe_renormalize,
                decoder_sparse_step=step, mlp_only_layers=dense)


class Qwen2Moe(_Experts, Qwen2):
    model_type, hf_class, config_class = "qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig"
    block = {**Qwen2.block, **MOE, "moe_shared_ffn_hidden_size": Set(0),
             "moe_shared_expert_gate": True}
    shared = True

    def model_keys(self, config) -> dict:
        shared = config.shared_expert_intermediate_size
        require(shared > 0, "shared_expert_intermediate_size=0: a Qwen2-MoE without its shared "
                            "expert; ptdp's gated shared expert needs a size")
        return dict(super().model_keys(config), num_experts=config.num_experts,
                    moe_top_k=config.num_experts_per_tok,
                    moe_ffn_hidden_size=config.moe_intermediate_size,
                    moe_renormalize=bool(config.norm_topk_prob),
                    moe_shared_ffn_hidden_size=shared, moe_shared_expert_gate=True,
                    **qwen_moe_layers(config))

    def hf_extra(self, cfg: ModelConfig) -> dict:
        return dict(super().hf_extra(cfg), **qwen_moe_config(cfg),
                    shared_expert_intermediate_size=cfg.moe_shared_ffn_hidden_size)


class Qwen3Moe(_Experts, Qwen3):
    """Qwen3's block (QK-norm, head_dim) with experts and no shared expert; its window, when
    use_sliding_window, is in every layer."""
    model_type, hf_class, config_class = "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig"
    block = {**Qwen3.block, **MOE, "sliding_window_layers": None}

    def model_keys(self, config) -> dict:
        return dict(super().model_keys(config), num_experts=config.num_experts,
                    moe_top_k=config.num_experts_per_tok,
                    moe_ffn_hidden_size=config.moe_intermediate_size,
                    moe_renormalize=bool(config.norm_topk_prob), **qwen_moe_layers(config))

    def hf_extra(self, cfg: ModelConfig) -> dict:
        return dict(head_dim=cfg.head_dim, attention_bias=False, **qwen_moe_config(cfg),
                    use_sliding_window=cfg.sliding_window is not None,
                    sliding_window=cfg.sliding_window)
