"""ptdp's Llama-style GPT (model.preset=llama) <-> `LlamaForCausalLM`, and the families that
reduce to the same block: `MistralForCausalLM` (its sliding window in every layer:
model.sliding_window) and `Qwen2ForCausalLM` (Llama's block plus biases on Q, K and V:
model.qkv_bias=true; its window on the layers from max_window_layers on:
model.sliding_window_layers). Qwen3 (here too: Llama's block plus
QK-norm and a head size), Phi-3 (phi3.py), Gemma (gemma.py) and the mixtures of experts
(moe.py) build on `Llama`'s hooks: `model_keys`, `attention_*`, `mlp_*`.

The block: pre-RMSNorm layers, rotary positions (HF's rotate_half convention, which ptdp's
models/rotary.py uses too, so no q/k permutation), SwiGLU MLP, bias-free linears, grouped-query
attention, an output layer tied or not. Mapped:
  * QKV: ptdp's fused rows are grouped by K/V head, `w.view(g, r + 2, d, h)` with r = n/g
    query heads then one k and one v head per group; HF's q_proj, k_proj, v_proj are those
    slices in head order (ptdp/hf/base.py `split_qkv`). Same for Qwen2's biases.
  * MLP: ptdp's fc1 rows alternate gate and up (`fc1.view(f, 2, h)`, so any tensor split holds
    whole pairs); HF's gate_proj and up_proj are the two halves, fc2 is down_proj.
  * Rotary frequencies: the default, Llama 3's "llama3" scaling (factor, low/high frequency
    factors, original context) or "yarn" (factor, beta_fast/slow, mscale, mscale_all_dim,
    attention_factor, truncate, original context); other rope types (linear, dynamic,
    longrope, ...) are refused.
  * Windows: HF's `layer_types` ("sliding_attention" / "full_attention") and sliding_window;
    its window counts the query itself, as ptdp's does (ptdp/config/windows.py).
  * head_dim: model.head_dim (heads x head_dim need not be the hidden size).
Refused, naming the setting: hidden_act other than silu, attention_bias / mlp_bias, another
layer type, a partial rotary factor.
"""

from __future__ import annotations

from ptdp.config import ModelConfig
from ptdp.config.models import GPT, LLAMA_BLOCK
from ptdp.data.tokenizer import BOS, EOD, PAD
from ptdp.hf.base import PLAIN, Family, fuse_qkv, require, rotary_lengths, split_qkv
from ptdp.models.transformer import fuse_gate_up, split_gate_up

_QKV = ("q_proj", "k_proj", "v_proj")
_QK_NORMS = ("q_norm", "k_norm")


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
    require(kind in ("llama3", "yarn"), f"rope_parameters.rope_type={kind!r}: ptdp's rotary "
                                        f"positions are unscaled ('default'), Llama 3's "
                                        f"('llama3') or YaRN ('yarn'), so the logits would differ")
    if kind == "yarn":
        return dict(rope_theta=theta, **_yarn_settings(config, params))
    return dict(rope_theta=theta, rope_scaling_factor=float(params["factor"]),
                rope_low_freq_factor=float(params["low_freq_factor"]),
                rope_high_freq_factor=float(params["high_freq_factor"]),
                rope_original_seq_length=int(params["original_max_position_embeddings"]))


def _yarn_settings(config, params: dict) -> dict:
    """The YaRN keys as transformers reads them (modeling_rope_utils.py
    `_compute_yarn_parameters`): a missing factor is max / original positions, a missing (or
    0) beta 32 and 1, mscale counts only beside mscale_all_dim and without attention_factor;
    factor 1 is no scaling."""
    original = int(params.get("original_max_position_embeddings")
                   or config.max_position_embeddings)
    factor = params.get("factor")
    factor = float(config.max_position_embeddings / original if factor is None else factor)
    if factor == 1.0:   # no scaling (transformers' blend of equal frequencies, factor 1)
        return dict(rope_scaling_factor=1.0)
    optional = {key: None if params.get(key) in (None, 0) else float(params[key])
                for key in ("mscale", "mscale_all_dim")}   # (0: unset, as transformers reads)
    given = params.get("attention_factor")
    optional["attention_factor"] = None if given is None else float(given)
    if optional["mscale_all_dim"] is None or given is not None:
        optional["mscale"] = None   # (transformers ignores it then; ptdp refuses it)
    return dict(rope_scaling_factor=factor, rope_scaling_type="yarn",
                rope_original_seq_length=original,
                rope_yarn_beta_fast=float(params.get("beta_fast") or 32.0),
                rope_yarn_beta_slow=float(params.get("beta_slow") or 1.0),
                rope_yarn_truncate=bool(params.get("truncate", True)),
                **{f"rope_yarn_{key}": value for key, value in optional.items()})


def rope_parameters(cfg: ModelConfig) -> dict:
    if cfg.rope_scaling_factor == 1.0:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_type == "yarn":
        optional = {key: getattr(cfg, f"rope_yarn_{key}")
                    for key in ("mscale", "mscale_all_dim", "attention_factor")}
        return {"rope_type": "yarn", "rope_theta": cfg.rope_theta,
                "factor": cfg.rope_scaling_factor,
                "original_max_position_embeddings": cfg.rope_original_seq_length,
                "beta_fast": cfg.rope_yarn_beta_fast, "beta_slow": cfg.rope_yarn_beta_slow,
                **{key: value for key, value in optional.items() if value is not None},
                **({} if cfg.rope_yarn_truncate else {"truncate": False})}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta,
            "factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_seq_length}


class Llama(Family):
    model_type, hf_class, config_class = "llama", "LlamaForCausalLM", "LlamaConfig"
    model_family = GPT
    block = dict(PLAIN, position_embedding="rope", normalization="rmsnorm", activation="swiglu",
                 bias=False, qkv_bias=False)
    activation = "silu"   # the hidden_act of the block's SwiGLU

    def refuse(self, config) -> None:
        """What this family's config can set that ptdp's block cannot compute."""
        require(not getattr(config, "attention_bias", False),
                "attention_bias=True puts biases on q_proj, k_proj, v_proj and o_proj; ptdp's "
                "Llama block has none (Qwen2's q/k/v biases convert as model_type qwen2)")
        require(not getattr(config, "mlp_bias", False),
                "mlp_bias=True puts biases on the MLP; ptdp's Llama block has none")
        tp = getattr(config, "pretraining_tp", 1) or 1
        require(tp == 1, f"pretraining_tp={tp} splits the linears' arithmetic; set it to 1")

    def model_keys(self, config) -> dict:
        """ptdp's model keys of this family's transformers config."""
        act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
        require(act == self.activation, f"hidden_act is {act!r}; ptdp's block uses "
                                        f"{self.activation!r} there, so the logits would differ")
        self.refuse(config)
        heads, hidden = config.num_attention_heads, config.hidden_size
        return dict(head_dim=getattr(config, "head_dim", None) or hidden // heads,
            arch=GPT.name, preset=LLAMA_BLOCK, num_layers=config.num_hidden_layers,
            hidden_size=hidden,
            num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size, dropout=0.0,   # transformers' Llama: attention only
            attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
            layernorm_eps=config.rms_norm_eps, init_std=config.initializer_range,
            tie_embeddings=bool(config.tie_word_embeddings), bias=False,
            qkv_bias=self.block["qkv_bias"], **rope_settings(config),
            **rotary_lengths(config.max_position_embeddings), **window_settings(config))

    def model_config(self, config) -> ModelConfig:
        return ModelConfig(**self.model_keys(config))

    def hf_extra(self, cfg: ModelConfig) -> dict:
        return dict(attention_bias=False, mlp_bias=False, head_dim=cfg.head_dim)

    def hf_config(self, cfg: ModelConfig, special: dict[str, int]):
        import transformers
        keys = dict(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
            hidden_act=self.activation, max_position_embeddings=cfg.max_positions,
            initializer_range=cfg.init_std, rms_norm_eps=cfg.layernorm_eps,
            attention_dropout=cfg.attention_dropout_rate, rope_parameters=rope_parameters(cfg),
            tie_word_embeddings=cfg.tie_embeddings, architectures=[self.hf_class],
            bos_token_id=special.get(BOS), eos_token_id=special.get(EOD),
            pad_token_id=special.get(PAD))
        return getattr(transformers, self.config_class)(**{**keys, **self.hf_extra(cfg)})

    def _pairs(self, cfg: ModelConfig):
        """(ptdp name, HF name, transposed) of the weights that only change name."""
        yield "embedding.word.weight", "model.embed_tokens.weight", False
        for i in range(cfg.num_layers):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            for a, b in [("ln1", "input_layernorm"), ("attention.proj", "self_attn.o_proj"),
                         ("ln2", "post_attention_layernorm")]:
                yield f"{ours}{a}.weight", f"{theirs}{b}.weight", False
        yield "final_ln.weight", "model.norm.weight", False
        if not cfg.tie_embeddings:
            yield "output_layer.weight", "lm_head.weight", False

    def to_hf(self, cfg, full):
        out = self.renamed_to_hf(cfg, full)
        for i in range(cfg.num_layers):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            self.attention_to_hf(cfg, full, ours + "attention.", theirs + "self_attn.", out)
            self.mlp_to_hf(cfg, i, full, ours + "mlp.", theirs + "mlp.", out)
        if cfg.tie_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def from_hf(self, cfg, hf):
        out, get = self.renamed_from_hf(cfg, hf)
        for i in range(cfg.num_layers):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            self.attention_from_hf(cfg, get, ours + "attention.", theirs + "self_attn.", out)
            self.mlp_from_hf(cfg, i, get, ours + "mlp.", theirs + "mlp.", out)
        return out

    @staticmethod
    def attention_to_hf(cfg, full, ours: str, theirs: str, out: dict) -> None:
        """ptdp's fused QKV (weight, and biases with model.qkv_bias) -> q_proj, k_proj, v_proj."""
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            parts = split_qkv(full[f"{ours}qkv.{kind}"], cfg.num_heads, cfg.num_kv_heads)
            for proj, value in zip(_QKV, parts):
                out[f"{theirs}{proj}.{kind}"] = value
        for name in _QK_NORMS if cfg.qk_norm else ():   # Qwen3's per-head norms: same names
            out[f"{theirs}{name}.weight"] = full[f"{ours}{name}.weight"]

    @staticmethod
    def attention_from_hf(cfg, get, ours: str, theirs: str, out: dict) -> None:
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            parts = [get(f"{theirs}{p}.{kind}") for p in _QKV]
            out[f"{ours}qkv.{kind}"] = fuse_qkv(*parts, cfg.num_heads, cfg.num_kv_heads)
        for name in _QK_NORMS if cfg.qk_norm else ():
            out[f"{ours}{name}.weight"] = get(f"{theirs}{name}.weight")

    @staticmethod
    def mlp_to_hf(cfg, layer: int, full, ours: str, theirs: str, out: dict) -> None:
        """ptdp's fc1 (gate and up rows alternating) and fc2 -> gate_proj, up_proj, down_proj."""
        out[f"{theirs}gate_proj.weight"], out[f"{theirs}up_proj.weight"] = \
            split_gate_up(full[f"{ours}fc1.weight"])
        out[f"{theirs}down_proj.weight"] = full[f"{ours}fc2.weight"]

    @staticmethod
    def mlp_from_hf(cfg, layer: int, get, ours: str, theirs: str, out: dict) -> None:
        out[f"{ours}fc1.weight"] = fuse_gate_up(get(f"{theirs}gate_proj.weight"),
                                                get(f"{theirs}up_proj.weight"))
        out[f"{ours}fc2.weight"] = get(f"{theirs}down_proj.weight").contiguous()


def window_settings(config) -> dict:
    """model.sliding_window(_layers) of a transformers config: its sliding_window on the layers
    `layer_types` calls "sliding_attention" (every layer where it lists none: Mistral)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    other = sorted(set(types or ()) - {"sliding_attention", "full_attention"})
    require(not other, f"layer_types has {other}: ptdp's layers attend fully or within "
                       f"model.sliding_window")
    local = [i for i, kind in enumerate(types or ()) if kind == "sliding_attention"]
    if window is None or (types is not None and not local):
        return {}
    return dict(sliding_window=int(window),
                sliding_window_layers=None if types is None or len(local) == len(types)
                else local)


class Mistral(Llama):
    """Llama's block with a sliding window in every layer (or none: then ptdp -> HF writes
    Llama)."""
    model_type, hf_class, config_class = "mistral", "MistralForCausalLM", "MistralConfig"
    block = {**{k: v for k, v in Llama.block.items() if k != "sliding_window"},
             "sliding_window_layers": None}

    def hf_extra(self, cfg: ModelConfig) -> dict:
        return dict(head_dim=cfg.head_dim, sliding_window=cfg.sliding_window)


class Qwen2(Llama):
    """Llama's block with biases on Q, K and V (model.qkv_bias=true, model.bias=false), and a
    window on the layers its layer_types name."""
    model_type, hf_class, config_class = "qwen2", "Qwen2ForCausalLM", "Qwen2Config"
    block = {k: v for k, v in dict(Llama.block, qkv_bias=True).items() if k != "sliding_window"}

    def hf_extra(self, cfg: ModelConfig) -> dict:
        return dict(head_dim=cfg.head_dim, **layer_types(cfg))


def layer_types(cfg: ModelConfig) -> dict:
    """transformers' window settings of ptdp's model (Qwen2's, Qwen3's)."""
    window = cfg.sliding_window
    types = ["sliding_attention" if cfg.attention_window(i) else "full_attention"
             for i in range(cfg.num_layers)]
    return dict(use_sliding_window=window is not None, sliding_window=window,
                layer_types=types, max_window_layers=types.index("sliding_attention")
                if window is not None else cfg.num_layers)


class Qwen3(Llama):
    """Llama's block with QK-norm (model.qk_norm: an RMSNorm over each query and key head,
    `q_norm`/`k_norm`), an explicit head size, and Qwen2's per-layer window."""
    model_type, hf_class, config_class = "qwen3", "Qwen3ForCausalLM", "Qwen3Config"
    block = {k: v for k, v in dict(Llama.block, qk_norm=True).items() if k != "sliding_window"}

    def model_keys(self, config) -> dict:
        return dict(super().model_keys(config), qk_norm=True)

    def hf_extra(self, cfg: ModelConfig) -> dict:
        return dict(head_dim=cfg.head_dim, attention_bias=False, **layer_types(cfg))
