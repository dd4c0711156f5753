"""ptdp's full (layout-free) weights <-> Hugging Face state dicts and configs.

GPT -> `GPT2LMHeadModel` (model_type gpt2). Same architecture: pre-LN blocks, learned
positions, final LayerNorm, output head tied to the word embedding. Differences, mapped:
  * QKV: ptdp's fused weight has rows [head, (q, k, v), head_dim] (each tensor rank owns whole
    heads); GPT-2's `c_attn` has columns [q | k | v], each [head, head_dim].
  * GPT-2's linear layers are `Conv1D`, weight [in, out]: ptdp's [out, in] transposed.
  * GeLU: ptdp uses the exact (erf) GeLU, so `activation_function` is "gelu", not GPT-2's
    default "gelu_new" (tanh approximation).
  * Vocabulary: ptdp pads its tables to a multiple of 128 * t; HF gets the tokenizer's real
    vocabulary (`model.vocab_size` rows) and the padding is re-added on the way back.

BERT -> `MegatronBertForPreTraining` (model_type megatron-bert), not `BertForPreTraining`:
ptdp's BERT is Megatron-BERT (pre-LN layers, a final LayerNorm, no LayerNorm on the
embeddings), while `BertForPreTraining` is the original post-LN BERT with an embedding
LayerNorm; no weight mapping makes one compute the other. `MegatronBertForPreTraining` is
the same network: embeddings (word + position + token type), pre-LN layers, final LN,
pooler (dense + tanh on [CLS]), masked-LM head (dense, GeLU, LN, tied decoder + bias) and a
2-way `seq_relationship` head. ptdp trains that head on sentence order: index 0 = segments in
order, 1 = swapped, the same convention as HF's next-sentence labels (0 = B continues A).
"""

from __future__ import annotations

import torch

from ptdp.config import ModelConfig

GPT_CLASS, BERT_CLASS = "GPT2LMHeadModel", "MegatronBertForPreTraining"


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------

def hf_config(cfg: ModelConfig, special: dict[str, int]):
    """A transformers config for ptdp's model; `special`: the tokenizer's special-token ids."""
    import transformers
    common = dict(vocab_size=cfg.vocab_size, initializer_range=cfg.init_std,
                  architectures=[hf_class_name(cfg.arch)], tie_word_embeddings=True)
    if cfg.arch == "gpt":
        eod = special.get("<eod>")
        return transformers.GPT2Config(
            n_positions=cfg.seq_length, n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
            n_head=cfg.num_heads, n_inner=cfg.ffn_hidden_size, activation_function="gelu",
            resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            layer_norm_epsilon=cfg.layernorm_eps, bos_token_id=eod, eos_token_id=eod, **common)
    return transformers.MegatronBertConfig(
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, intermediate_size=cfg.ffn_hidden_size,
        hidden_act="gelu", hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout, max_position_embeddings=cfg.seq_length,
        type_vocab_size=cfg.num_tokentypes, layer_norm_eps=cfg.layernorm_eps,
        pad_token_id=special.get("[PAD]", 0), **common)


def hf_class_name(arch: str) -> str:
    return GPT_CLASS if arch == "gpt" else BERT_CLASS


def model_config_from_hf(config) -> ModelConfig:
    """The ptdp ModelConfig of a transformers GPT-2 or Megatron-BERT config."""
    kind = config.model_type
    if kind == "gpt2":
        if config.activation_function != "gelu":
            raise ValueError(f"activation_function is {config.activation_function!r}; ptdp's GPT "
                             f"uses the exact GeLU ('gelu'), so the logits would differ")
        return ModelConfig(arch="gpt", num_layers=config.n_layer, hidden_size=config.n_embd,
                           num_heads=config.n_head,
                           ffn_hidden_size=config.n_inner or 4 * config.n_embd,
                           seq_length=config.n_positions, vocab_size=config.vocab_size,
                           dropout=config.resid_pdrop, layernorm_eps=config.layer_norm_epsilon,
                           init_std=config.initializer_range)
    if kind == "megatron-bert":
        if config.hidden_act != "gelu":
            raise ValueError(f"hidden_act is {config.hidden_act!r}; ptdp's BERT uses 'gelu'")
        return ModelConfig(arch="bert", num_layers=config.num_hidden_layers,
                           hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                           ffn_hidden_size=config.intermediate_size,
                           seq_length=config.max_position_embeddings,
                           vocab_size=config.vocab_size, dropout=config.hidden_dropout_prob,
                           layernorm_eps=config.layer_norm_eps,
                           init_std=config.initializer_range,
                           num_tokentypes=config.type_vocab_size)
    raise ValueError(f"model_type {kind!r} is not one ptdp converts: gpt2 (GPT) or megatron-bert "
                     f"(BERT)")


# --------------------------------------------------------------------------------------------
# QKV layouts
# --------------------------------------------------------------------------------------------

def _qkv_to_blocks(w: torch.Tensor, heads: int) -> torch.Tensor:
    """ptdp rows [head, (q, k, v), d] -> rows [(q, k, v), head, d] (any trailing dims)."""
    rest = w.shape[1:]
    return w.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(w.shape)


def _blocks_to_qkv(w: torch.Tensor, heads: int) -> torch.Tensor:
    rest = w.shape[1:]
    return w.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(w.shape)


# --------------------------------------------------------------------------------------------
# Name maps: (ptdp name, HF name, transposed) per layer and for the whole model
# --------------------------------------------------------------------------------------------

def _gpt_pairs(cfg: ModelConfig):
    yield "embedding.word.weight", "transformer.wte.weight", False
    yield "embedding.position", "transformer.wpe.weight", False
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        for a, b, t in [("ln1.weight", "ln_1.weight", False), ("ln1.bias", "ln_1.bias", False),
                        ("attention.proj.weight", "attn.c_proj.weight", True),
                        ("attention.proj.bias", "attn.c_proj.bias", False),
                        ("ln2.weight", "ln_2.weight", False), ("ln2.bias", "ln_2.bias", False),
                        ("mlp.fc1.weight", "mlp.c_fc.weight", True),
                        ("mlp.fc1.bias", "mlp.c_fc.bias", False),
                        ("mlp.fc2.weight", "mlp.c_proj.weight", True),
                        ("mlp.fc2.bias", "mlp.c_proj.bias", False)]:
            yield ours + a, theirs + b, t
    yield "final_ln.weight", "transformer.ln_f.weight", False
    yield "final_ln.bias", "transformer.ln_f.bias", False


def _bert_pairs(cfg: ModelConfig):
    emb = "bert.embeddings."
    yield "embedding.word.weight", emb + "word_embeddings.weight", False
    yield "embedding.position", emb + "position_embeddings.weight", False
    yield "embedding.tokentype", emb + "token_type_embeddings.weight", False
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"bert.encoder.layer.{i}."
        for a, b in [("ln1", "attention.ln"), ("attention.proj", "attention.output.dense"),
                     ("ln2", "ln"), ("mlp.fc1", "intermediate.dense"),
                     ("mlp.fc2", "output.dense")]:
            for kind in ("weight", "bias"):
                yield f"{ours}{a}.{kind}", f"{theirs}{b}.{kind}", False
    for a, b in [("final_ln", "bert.encoder.ln"), ("heads.pooler", "bert.pooler.dense"),
                 ("heads.lm_dense", "cls.predictions.transform.dense"),
                 ("heads.lm_ln", "cls.predictions.transform.LayerNorm"),
                 ("heads.binary", "cls.seq_relationship")]:
        for kind in ("weight", "bias"):
            yield f"{a}.{kind}", f"{b}.{kind}", False
    yield "heads.lm_bias", "cls.predictions.bias", False


def _pairs(cfg: ModelConfig):
    return _gpt_pairs(cfg) if cfg.arch == "gpt" else _bert_pairs(cfg)


def to_hf_state(cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ptdp full weights (vocabulary already trimmed) -> the HF model's state dict."""
    out = {}
    for ours, theirs, transposed in _pairs(cfg):
        value = full[ours]
        out[theirs] = (value.t() if transposed else value).contiguous()
    n = cfg.num_heads
    for i in range(cfg.num_layers):
        w, b = full[f"layers.{i}.attention.qkv.weight"], full[f"layers.{i}.attention.qkv.bias"]
        w, b = _qkv_to_blocks(w, n), _qkv_to_blocks(b, n)
        if cfg.arch == "gpt":
            out[f"transformer.h.{i}.attn.c_attn.weight"] = w.t().contiguous()
            out[f"transformer.h.{i}.attn.c_attn.bias"] = b.contiguous()
        else:
            prefix = f"bert.encoder.layer.{i}.attention.self."
            for part, wq, bq in zip(("query", "key", "value"), w.chunk(3), b.chunk(3)):
                out[f"{prefix}{part}.weight"] = wq.contiguous()
                out[f"{prefix}{part}.bias"] = bq.contiguous()
    if cfg.arch == "gpt":
        out["lm_head.weight"] = out["transformer.wte.weight"]
    else:
        out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"]
        out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]
    return out


def from_hf_state(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF model's state dict -> ptdp full weights (the inverse of `to_hf_state`)."""
    def get(name):
        if name not in hf:
            raise KeyError(f"the Hugging Face weights have no '{name}'")
        return hf[name].float()

    out = {}
    for ours, theirs, transposed in _pairs(cfg):
        value = get(theirs)
        out[ours] = (value.t() if transposed else value).contiguous()
    n = cfg.num_heads
    for i in range(cfg.num_layers):
        if cfg.arch == "gpt":
            w = get(f"transformer.h.{i}.attn.c_attn.weight").t()
            b = get(f"transformer.h.{i}.attn.c_attn.bias")
        else:
            prefix = f"bert.encoder.layer.{i}.attention.self."
            w = torch.cat([get(f"{prefix}{p}.weight") for p in ("query", "key", "value")])
            b = torch.cat([get(f"{prefix}{p}.bias") for p in ("query", "key", "value")])
        out[f"layers.{i}.attention.qkv.weight"] = _blocks_to_qkv(w, n).contiguous()
        out[f"layers.{i}.attention.qkv.bias"] = _blocks_to_qkv(b, n).contiguous()
    return out
