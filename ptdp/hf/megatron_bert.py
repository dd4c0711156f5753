"""BERT <-> `MegatronBertForPreTraining` (model_type megatron-bert).

Not `BertForPreTraining`: ptdp's BERT is Megatron-BERT (pre-LN layers, a final LayerNorm, no
LayerNorm on the embeddings), while `BertForPreTraining` is the original post-LN BERT with an
embedding LayerNorm; no weight mapping makes one compute the other.
`MegatronBertForPreTraining` is the same network: embeddings (word + position + token type),
pre-LN layers, final LN, pooler (dense + tanh on [CLS]), masked-LM head (dense, GeLU, LN, tied
decoder + bias) and a 2-way `seq_relationship` head. ptdp trains that head on sentence order:
index 0 = segments in order, 1 = swapped, the same convention as HF's next-sentence labels
(0 = B continues A). QKV: ptdp's rows [head, (q, k, v), head_dim] <-> separate query, key and
value linears.
"""

from __future__ import annotations

from ptdp.config import ModelConfig
from ptdp.config.models import BERT
from ptdp.data.tokenizer import PAD
from ptdp.hf.base import Family, fuse_qkv, require, split_qkv

_LAYER = [("ln1", "attention.ln"), ("attention.proj", "attention.output.dense"), ("ln2", "ln"),
          ("mlp.fc1", "intermediate.dense"), ("mlp.fc2", "output.dense")]
_HEADS = [("final_ln", "bert.encoder.ln"), ("heads.pooler", "bert.pooler.dense"),
          ("heads.lm_dense", "cls.predictions.transform.dense"),
          ("heads.lm_ln", "cls.predictions.transform.LayerNorm"),
          ("heads.binary", "cls.seq_relationship")]
_QKV = ("query", "key", "value")


class MegatronBert(Family):
    model_type, hf_class, config_class = "megatron-bert", "MegatronBertForPreTraining", \
        "MegatronBertConfig"
    model_family = BERT   # its block is GPT-2's, the only one BERT has (ptdp/config/models.py)

    def model_config(self, config) -> ModelConfig:
        require(config.hidden_act == "gelu",
                f"hidden_act is {config.hidden_act!r}; ptdp's BERT uses 'gelu'")
        kind = getattr(config, "position_embedding_type", "absolute")
        require(kind == "absolute", f"position_embedding_type is {kind!r}; ptdp's BERT learns "
                                    f"absolute positions ('absolute')")
        require(not getattr(config, "add_cross_attention", False),
                "add_cross_attention=True adds encoder-decoder attention, which ptdp's BERT "
                "has not")
        return ModelConfig(arch=BERT.name, num_layers=config.num_hidden_layers,
                           hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                           ffn_hidden_size=config.intermediate_size,
                           seq_length=config.max_position_embeddings,
                           vocab_size=config.vocab_size, dropout=config.hidden_dropout_prob,
                           attention_dropout=(
                               None if config.attention_probs_dropout_prob
                               == config.hidden_dropout_prob
                               else config.attention_probs_dropout_prob),
                           layernorm_eps=config.layer_norm_eps,
                           init_std=config.initializer_range,
                           num_tokentypes=config.type_vocab_size)

    def hf_config(self, cfg: ModelConfig, special: dict[str, int]):
        import transformers
        return transformers.MegatronBertConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.ffn_hidden_size, hidden_act="gelu",
            hidden_dropout_prob=cfg.dropout,
            attention_probs_dropout_prob=cfg.attention_dropout_rate,
            max_position_embeddings=cfg.seq_length, type_vocab_size=cfg.num_tokentypes,
            layer_norm_eps=cfg.layernorm_eps, initializer_range=cfg.init_std,
            architectures=[self.hf_class], tie_word_embeddings=True,
            pad_token_id=special.get(PAD, 0))

    @staticmethod
    def _pairs(cfg: ModelConfig):
        emb = "bert.embeddings."
        yield "embedding.word.weight", emb + "word_embeddings.weight", False
        yield "embedding.position", emb + "position_embeddings.weight", False
        yield "embedding.tokentype", emb + "token_type_embeddings.weight", False
        for i in range(cfg.num_layers):
            for a, b in _LAYER:
                for kind in ("weight", "bias"):
                    yield f"layers.{i}.{a}.{kind}", f"bert.encoder.layer.{i}.{b}.{kind}", False
        for a, b in _HEADS:
            for kind in ("weight", "bias"):
                yield f"{a}.{kind}", f"{b}.{kind}", False
        yield "heads.lm_bias", "cls.predictions.bias", False

    def to_hf(self, cfg, full):
        out = self.renamed_to_hf(cfg, full)
        n = cfg.num_heads
        for i in range(cfg.num_layers):
            prefix = f"bert.encoder.layer.{i}.attention.self."
            for kind in ("weight", "bias"):
                parts = split_qkv(full[f"layers.{i}.attention.qkv.{kind}"], n, n)
                for part, value in zip(_QKV, parts):
                    out[f"{prefix}{part}.{kind}"] = value
        out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"]
        out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]
        return out

    def from_hf(self, cfg, hf):
        out, get = self.renamed_from_hf(cfg, hf)
        n = cfg.num_heads
        for i in range(cfg.num_layers):
            prefix = f"bert.encoder.layer.{i}.attention.self."
            for kind in ("weight", "bias"):
                parts = [get(f"{prefix}{part}.{kind}") for part in _QKV]
                out[f"layers.{i}.attention.qkv.{kind}"] = fuse_qkv(*parts, n, n)
        return out
