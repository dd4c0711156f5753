"""GPT <-> `GPT2LMHeadModel` (model_type gpt2).

Same architecture: pre-LN blocks, learned positions, final LayerNorm, an output head tied to
the word embedding or (tie_word_embeddings=False) a separate `lm_head`, which ptdp holds as
`output_layer.weight` with model.tie_embeddings=false. Differences, mapped:
  * QKV: ptdp's fused weight has rows [head, (q, k, v), head_dim] (each tensor rank owns whole
    heads); GPT-2's `c_attn` has columns [q | k | v], each [head, head_dim].
  * GPT-2's linear layers are `Conv1D`, weight [in, out]: ptdp's [out, in] transposed.
  * GeLU: GPT-2's released "gelu_new" (and "gelu_pytorch_tanh") is the tanh approximation,
    model.activation=gelu_tanh; "gelu" is the exact (erf) one, model.activation=gelu; any
    other is refused.
  * Vocabulary: ptdp pads its tables to a multiple of 128 * t; HF gets the tokenizer's real
    vocabulary (`model.vocab_size` rows) and the padding is re-added on the way back.
Refused because ptdp's attention cannot compute them: scale_attn_by_inverse_layer_idx=True,
scale_attn_weights=False, add_cross_attention=True.
"""

from __future__ import annotations

import torch

from ptdp.config import ModelConfig
from ptdp.config.models import GPT, GPT2_BLOCK
from ptdp.data.tokenizer import BOS, EOD, PAD
from ptdp.hf.base import PLAIN, Family, OneOf, fuse_qkv, require, split_qkv


# transformers' activation_function -> model.activation, and back
GELUS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
HF_GELU = {"gelu": "gelu", "gelu_tanh": "gelu_new"}


class GPT2(Family):
    model_type, hf_class, config_class = "gpt2", "GPT2LMHeadModel", "GPT2Config"
    model_family = GPT
    block = dict(PLAIN, position_embedding="learned", normalization="layernorm",
                 activation=OneOf(("gelu", "gelu_tanh")), bias=True, qkv_bias=True)

    def mismatches(self, cfg: ModelConfig) -> list[str]:
        grouped = ([f"model.num_kv_heads={cfg.num_heads} (not {cfg.num_kv_heads})"]
                   if cfg.num_kv_heads != cfg.num_heads else [])
        split = cfg.hidden_size // cfg.num_heads
        heads = [f"model.head_dim={split} (not {cfg.head_dim})"] if cfg.head_dim != split else []
        return super().mismatches(cfg) + grouped + heads

    def model_config(self, config) -> ModelConfig:
        act = config.activation_function
        require(act in GELUS, f"activation_function is {act!r}; ptdp's GPT computes "
                              f"{' or '.join(map(repr, GELUS))}, so the logits would differ")
        require(not getattr(config, "scale_attn_by_inverse_layer_idx", False),
                "scale_attn_by_inverse_layer_idx=True scales each layer's attention by "
                "1/(layer+1); ptdp's attention does not")
        require(getattr(config, "scale_attn_weights", True),
                "scale_attn_weights=False leaves attention scores unscaled; ptdp's attention "
                "divides them by sqrt(head_dim)")
        require(not getattr(config, "add_cross_attention", False),
                "add_cross_attention=True adds encoder-decoder attention, which ptdp's GPT has not")
        return ModelConfig(arch=GPT.name, preset=GPT2_BLOCK, num_layers=config.n_layer,
                           hidden_size=config.n_embd, num_heads=config.n_head,
                           ffn_hidden_size=config.n_inner or 4 * config.n_embd,
                           seq_length=config.n_positions, vocab_size=config.vocab_size,
                           dropout=config.resid_pdrop, layernorm_eps=config.layer_norm_epsilon,
                           attention_dropout=(None if config.attn_pdrop == config.resid_pdrop
                                              else config.attn_pdrop),
                           init_std=config.initializer_range,
                           tie_embeddings=bool(config.tie_word_embeddings),
                           activation=GELUS[act])

    def hf_config(self, cfg: ModelConfig, special: dict[str, int]):
        import transformers
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.seq_length, n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=cfg.ffn_hidden_size,
            activation_function=HF_GELU[cfg.activation], resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.attention_dropout_rate, layer_norm_epsilon=cfg.layernorm_eps,
            initializer_range=cfg.init_std, architectures=[self.hf_class],
            tie_word_embeddings=cfg.tie_embeddings, bos_token_id=special.get(BOS, special.get(EOD)),
            eos_token_id=special.get(EOD), pad_token_id=special.get(PAD))

    @staticmethod
    def _pairs(cfg: ModelConfig):
        """(ptdp name, HF name, transposed) of every weight but the QKV and the head."""
        yield "embedding.word.weight", "transformer.wte.weight", False
        yield "embedding.position", "transformer.wpe.weight", False
        for i in range(cfg.num_layers):
            ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
            for a, b, t in [("ln1", "ln_1", False), ("attention.proj", "attn.c_proj", True),
                            ("ln2", "ln_2", False), ("mlp.fc1", "mlp.c_fc", True),
                            ("mlp.fc2", "mlp.c_proj", True)]:
                yield f"{ours}{a}.weight", f"{theirs}{b}.weight", t
                yield f"{ours}{a}.bias", f"{theirs}{b}.bias", False
        yield "final_ln.weight", "transformer.ln_f.weight", False
        yield "final_ln.bias", "transformer.ln_f.bias", False
        if not cfg.tie_embeddings:
            yield "output_layer.weight", "lm_head.weight", False

    def to_hf(self, cfg, full):
        out = self.renamed_to_hf(cfg, full)
        n = cfg.num_heads
        for i in range(cfg.num_layers):
            w = split_qkv(full[f"layers.{i}.attention.qkv.weight"], n, n)
            b = split_qkv(full[f"layers.{i}.attention.qkv.bias"], n, n)
            out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat(w).t().contiguous()
            out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat(b)
        if cfg.tie_embeddings:
            out["lm_head.weight"] = out["transformer.wte.weight"]
        return out

    def from_hf(self, cfg, hf):
        out, get = self.renamed_from_hf(cfg, hf)
        n = cfg.num_heads
        for i in range(cfg.num_layers):
            w = get(f"transformer.h.{i}.attn.c_attn.weight").t()
            b = get(f"transformer.h.{i}.attn.c_attn.bias")
            out[f"layers.{i}.attention.qkv.weight"] = fuse_qkv(*w.chunk(3), n, n)
            out[f"layers.{i}.attention.qkv.bias"] = fuse_qkv(*b.chunk(3), n, n)
        return out

