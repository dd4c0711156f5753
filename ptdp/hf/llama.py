"""ptdp's Llama-style GPT (model.preset=llama) <-> `LlamaForCausalLM`, and the families that
reduce to the same block: `MistralForCausalLM` without a sliding window and
`Qwen2ForCausalLM` (Llama's block plus biases on Q, K and V: model.qkv_bias=true).

The block: pre-RMSNorm layers, rotary positions (HF's rotate_half convention, which ptdp's
models/rotary.py uses too, so no q/k permutation), SwiGLU MLP, bias-free linears, grouped-query
attention, an output layer tied or not. Mapped:
  * QKV: ptdp's fused rows are grouped by K/V head, `w.view(g, r + 2, d, h)` with r = n/g
    query heads then one k and one v head per group; HF's q_proj, k_proj, v_proj are those
    slices in head order (ptdp/hf/base.py `split_qkv`). Same for Qwen2's biases.
  * MLP: ptdp's fc1 rows alternate gate and up (`fc1.view(f, 2, h)`, so any tensor split holds
    whole pairs); HF's gate_proj and up_proj are the two halves, fc2 is down_proj.
  * Rotary frequencies: the default or Llama 3's "llama3" scaling (factor, low/high frequency
    factors, original context); other rope types (linear, dynamic, yarn, ...) are refused.
Refused, naming the setting: hidden_act other than silu, attention_bias / mlp_bias, a head_dim
that is not hidden_size / num_attention_heads, a sliding window (Mistral's sliding_window,
Qwen2's use_sliding_window), a partial rotary factor.
"""

from __future__ import annotations

from ptdp.config import ModelConfig
from ptdp.config.models import GPT, LLAMA_BLOCK
from ptdp.data.tokenizer import BOS, EOD, PAD
from ptdp.hf.base import Family, fuse_qkv, require, rotary_lengths, split_qkv
from ptdp.models.transformer import fuse_gate_up, split_gate_up

_QKV = ("q_proj", "k_proj", "v_proj")


def rope_settings(config) -> dict:
    """ptdp's rope_* model keys of a transformers config (rope_parameters in transformers 5,
    rope_scaling + rope_theta before)."""
    params = dict(getattr(config, "rope_parameters", None) or
                  getattr(config, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    require(partial in (None, 1, 1.0), f"partial_rotary_factor={partial} rotates only part of "
                                       f"each head; ptdp's rotary positions rotate all of it")
    if kind == "default":
        return dict(rope_theta=theta, rope_scaling_factor=1.0)
    require(kind == "llama3", f"rope_parameters.rope_type={kind!r}: ptdp's rotary positions are "
                              f"unscaled ('default') or Llama 3's ('llama3'), so the logits "
                              f"would differ")
    return dict(rope_theta=theta, rope_scaling_factor=float(params["factor"]),
                rope_low_freq_factor=float(params["low_freq_factor"]),
                rope_high_freq_factor=float(params["high_freq_factor"]),
                rope_original_seq_length=int(params["original_max_position_embeddings"]))


def rope_parameters(cfg: ModelConfig) -> dict:
    if cfg.rope_scaling_factor == 1.0:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta,
            "factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_seq_length}


class Llama(Family):
    model_type, hf_class, config_class = "llama", "LlamaForCausalLM", "LlamaConfig"
    model_family = GPT
    block = dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu",
                 bias=False, qkv_bias=False)

    def refuse(self, config) -> None:
        """What this family's config can set that ptdp's block cannot compute."""
        require(not getattr(config, "attention_bias", False),
                "attention_bias=True puts biases on q_proj, k_proj, v_proj and o_proj; ptdp's "
                "Llama block has none (Qwen2's q/k/v biases convert as model_type qwen2)")
        require(not getattr(config, "mlp_bias", False),
                "mlp_bias=True puts biases on the MLP; ptdp's Llama block has none")
        require((getattr(config, "pretraining_tp", 1) or 1) == 1,
                f"pretraining_tp={config.pretraining_tp} splits the linears' arithmetic; set it "
                f"to 1")

    def model_config(self, config) -> ModelConfig:
        require(config.hidden_act == "silu", f"hidden_act is {config.hidden_act!r}; ptdp's "
                                             f"SwiGLU uses 'silu', so the logits would differ")
        self.refuse(config)
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        require(layer_types == {"full_attention"},
                f"layer_types has {sorted(layer_types - {'full_attention'})}: ptdp's attention "
                f"is full attention in every layer")
        heads, hidden = config.num_attention_heads, config.hidden_size
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        require(head_dim * heads == hidden,
                f"head_dim={head_dim} is not hidden_size/num_attention_heads ({hidden}/{heads}); "
                f"ptdp's heads split the hidden size")
        return ModelConfig(
            arch=GPT.name, preset=LLAMA_BLOCK, num_layers=config.num_hidden_layers,
            hidden_size=hidden,
            num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size, dropout=0.0,   # transformers' Llama: attention only
            attention_dropout=float(getattr(config, "attention_dropout", 0.0)),
            layernorm_eps=config.rms_norm_eps, init_std=config.initializer_range,
            tie_embeddings=bool(config.tie_word_embeddings), bias=False,
            qkv_bias=self.block["qkv_bias"], **rope_settings(config),
            **rotary_lengths(config.max_position_embeddings))

    def hf_extra(self, cfg: ModelConfig) -> dict:
        return dict(attention_bias=False, mlp_bias=False, head_dim=cfg.head_dim)

    def hf_config(self, cfg: ModelConfig, special: dict[str, int]):
        import transformers
        return getattr(transformers, self.config_class)(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
            hidden_act="silu", max_position_embeddings=cfg.max_positions,
            initializer_range=cfg.init_std, rms_norm_eps=cfg.layernorm_eps,
            attention_dropout=cfg.attention_dropout_rate, rope_parameters=rope_parameters(cfg),
            tie_word_embeddings=cfg.tie_embeddings, architectures=[self.hf_class],
            bos_token_id=special.get(BOS), eos_token_id=special.get(EOD),
            pad_token_id=special.get(PAD), **self.hf_extra(cfg))

    @staticmethod
    def _pairs(cfg: ModelConfig):
        """(ptdp name, HF name, transposed) of every weight but the QKV and the gate/up pair."""
        yield "embedding.word.weight", "model.embed_tokens.weight", False
        for i in range(cfg.num_layers):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            for a, b in [("ln1", "input_layernorm"), ("attention.proj", "self_attn.o_proj"),
                         ("ln2", "post_attention_layernorm"), ("mlp.fc2", "mlp.down_proj")]:
                yield f"{ours}{a}.weight", f"{theirs}{b}.weight", False
        yield "final_ln.weight", "model.norm.weight", False
        if not cfg.tie_embeddings:
            yield "output_layer.weight", "lm_head.weight", False

    def to_hf(self, cfg, full):
        out = self.renamed_to_hf(cfg, full)
        n, g = cfg.num_heads, cfg.num_kv_heads
        for i in range(cfg.num_layers):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)
            for kind in kinds:
                parts = split_qkv(full[f"{ours}attention.qkv.{kind}"], n, g)
                for proj, value in zip(_QKV, parts):
                    out[f"{theirs}self_attn.{proj}.{kind}"] = value
            gate, up = split_gate_up(full[f"{ours}mlp.fc1.weight"])
            out[f"{theirs}mlp.gate_proj.weight"], out[f"{theirs}mlp.up_proj.weight"] = gate, up
        if cfg.tie_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def from_hf(self, cfg, hf):
        out, get = self.renamed_from_hf(cfg, hf)
        n, g = cfg.num_heads, cfg.num_kv_heads
        for i in range(cfg.num_layers):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)
            for kind in kinds:
                parts = [get(f"{theirs}self_attn.{p}.{kind}") for p in _QKV]
                out[f"{ours}attention.qkv.{kind}"] = fuse_qkv(*parts, n, g)
            out[f"{ours}mlp.fc1.weight"] = fuse_gate_up(get(f"{theirs}mlp.gate_proj.weight"),
                                                        get(f"{theirs}mlp.up_proj.weight"))
        return out


class Mistral(Llama):
    """Llama's block; only a model without a sliding window converts (ptdp -> HF writes Llama)."""
    model_type, hf_class, config_class = "mistral", "MistralForCausalLM", "MistralConfig"

    def refuse(self, config) -> None:
        window = getattr(config, "sliding_window", None)
        require(window is None, f"sliding_window={window}: a window changes attention (each "
                                f"token sees only the last {window} positions) and ptdp's "
                                f"attention sees the whole sequence; only sliding_window=null "
                                f"converts")


class Qwen2(Llama):
    """Llama's block with biases on Q, K and V (model.qkv_bias=true, model.bias=false)."""
    model_type, hf_class, config_class = "qwen2", "Qwen2ForCausalLM", "Qwen2Config"
    block = dict(Llama.block, qkv_bias=True)

    def refuse(self, config) -> None:
        require(not (getattr(config, "use_sliding_window", False)
                     and getattr(config, "sliding_window", None) is not None),
                f"use_sliding_window=True: a window changes attention (layers from "
                f"max_window_layers on see only the last {getattr(config, 'sliding_window', None)} "
                f"positions) and ptdp's attention sees the whole sequence")

    def hf_extra(self, cfg: ModelConfig) -> dict:
        return dict(use_sliding_window=False, sliding_window=None)
