"""Megatron-core's weight names and layouts <-> ptdp's, on full (unsplit) tensors.

A "Megatron state" here is what megatron-core's `GPTModel` / `BertModel` hold on one rank
with tensor and pipeline size 1: names with global layer numbers, the local (non-fused)
norm names `input_layernorm` / `pre_mlp_layernorm`, the vocabulary padded to Megatron's
`padded_vocab_size`. ptdp/megatron/legacy.py and torch_dist.py build it from a checkpoint of
any split; this module only renames and reorders.

What differs besides the names:
  * QKV: none. Megatron's rows are per query group [q heads of the group, k, v], each
    head_dim rows: ptdp's own order (models/transformer.py `ParallelAttention`).
  * SwiGLU's fc1: Megatron's full weight is [gate (f rows); up (f rows)] (what torch_dist
    stores; a legacy rank holds [its gate rows; its up rows]); ptdp's rows alternate gate and
    up (`fc1.view(f, 2, h)`, so any tensor split keeps pairs together).
  * The tied output layer: Megatron's last pipeline stage keeps a copy named
    `output_layer.weight`; ptdp stores the word table once.

Multi-token prediction's depths (`mtp.layers.{j}.*`, ptdp/megatron/mtp_names.py) are mapped
here too: their norms and projection by name, their transformer layer as a decoder layer of
global index num_layers + j (the same pairs, SwiGLU rows, experts and selection bias).
"""

from __future__ import annotations

import re

import torch

from ptdp.config import ModelConfig
from ptdp.config.models import BERT, GPT, Heads
from ptdp.megatron.errors import MegatronConversionError, require
from ptdp.megatron.latent_names import fused_latent_names, latent_pairs, rotary_rows
from ptdp.megatron.mtp_names import depth_pairs, layer_prefixes
from ptdp.models.transformer import fuse_gate_up, split_gate_up


# TransformerEngine fuses each pre-norm into the next linear; torch_dist always uses these names.
FUSED_NORMS = {".self_attention.linear_qkv.layer_norm_": ".input_layernorm.",
               ".mlp.linear_fc1.layer_norm_": ".pre_mlp_layernorm."}
# ... and TransformerEngine's latent attention's latent norms (ptdp/megatron/latent.py)
FUSED_LATENT_NORMS = {
    ".self_attention.linear_q_up_proj.layer_norm_": ".self_attention.q_layernorm.",
    ".self_attention.linear_kv_up_proj.layer_norm_": ".self_attention.kv_layernorm."}
COLUMN_PARALLEL = (".linear_qkv.weight", ".linear_qkv.bias", ".linear_fc1.weight",
                   ".linear_q_up_proj.weight", ".linear_q_proj.weight", ".linear_kv_up_proj.weight",
                   ".linear_fc1.bias", "embedding.word_embeddings.weight", "output_layer.weight",
                   "output_layer.bias", ".eh_proj.weight")   # (eh_proj: multi-token prediction's)
ROW_PARALLEL = (".linear_proj.weight", ".linear_fc2.weight")


def block_name(cfg: ModelConfig) -> str:
    """The TransformerBlock's attribute name: GPTModel's `decoder`, BertModel's `encoder`."""
    return "decoder" if cfg.family.causal else "encoder"


def partition_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits `name` along (None: replicated)."""
    if name.endswith(COLUMN_PARALLEL):
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    return None


def is_gated_fc1(name: str, cfg: ModelConfig) -> bool:
    return cfg.gated and ".linear_fc1." in name


def local_norm_names(state: dict) -> dict:
    """TransformerEngine's fused norm names -> the local spec's; `_extra_state` dropped."""
    out = {}
    for name, value in state.items():
        if name.endswith("_extra_state"):
            continue
        for fused, local in {**FUSED_NORMS, **FUSED_LATENT_NORMS}.items():
            name = name.replace(fused, local)
        out[name] = value
    return out


def fused_norm_names(state: dict) -> dict:
    """The local spec's norm names -> TransformerEngine's (--transformer-impl
    transformer_engine, Megatron-LM's default)."""
    out = {}
    for name, value in state.items():
        for fused, local in FUSED_NORMS.items():
            name = name.replace(local, fused)
        out[name] = value
    return out


def written_norm_names(state: dict, cfg: ModelConfig, fused_norms: bool,
                       torch_dist: bool = False) -> dict:
    """The norm names a written checkpoint holds: TransformerEngine's fused ones (--transformer-
    impl transformer_engine), and in torch_dist always for the usual block (its local spec's
    sharded_state_dict maps them); latent attention's specs map none (ptdp/megatron/latent.py)."""
    if cfg.latent_attention:
        return fused_latent_names(state, cfg) if fused_norms else state
    return fused_norm_names(state) if fused_norms or torch_dist else state


def arch_of(state: dict) -> str:
    """The model family (model.arch) of a Megatron state: BERT has an encoder and an LM head;
    GPT a decoder."""
    if any(k.startswith(("encoder.", "lm_head.", "binary_head.")) for k in state):
        return BERT.name
    require(any(k.startswith("decoder.") for k in state) or "embedding.word_embeddings.weight"
            in state, _unknown_model(state))
    return GPT.name


def _unknown_model(state: dict) -> str:
    first = next(iter(state), "nothing")
    if first.startswith("language_model."):
        return (f"'{first}' is a Megatron-LM legacy-model name (megatron/legacy/model); only "
                f"megatron-core models (decoder.layers.N...) convert: re-save it with "
                f"Megatron-LM's tools/checkpoint/convert.py --saver core first")
    return f"the checkpoint's weights start with '{first}': not a megatron-core GPT or BERT"


def _pairs(cfg: ModelConfig):
    """(ptdp name, Megatron name) of every weight but a gated fc1."""
    block, bias = block_name(cfg), ("weight", "bias")
    yield "embedding.word.weight", "embedding.word_embeddings.weight"
    if cfg.position_embedding == "learned":
        yield "embedding.position", "embedding.position_embeddings.weight"
    if cfg.family.token_types:
        yield "embedding.tokentype", "embedding.tokentype_embeddings.weight"
    norm_kinds = bias if cfg.normalization == "layernorm" else ("weight",)
    for i, ours, theirs in _layers(cfg):
        yield from _layer_pairs(cfg, i, ours, theirs, norm_kinds)
    yield from depth_pairs(cfg, norm_kinds)   # multi-token prediction's (mtp_names.py)
    for kind in norm_kinds:
        yield f"final_ln.{kind}", f"{block}.final_layernorm.{kind}"
    if not cfg.tie_embeddings:
        yield "output_layer.weight", "output_layer.weight"
    if cfg.family.heads is Heads.BERT:
        for a, b in [("heads.lm_dense", "lm_head.dense"), ("heads.lm_ln", "lm_head.layer_norm"),
                     ("heads.pooler", "pooler.dense"), ("heads.binary", "binary_head")]:
            for kind in bias:
                yield f"{a}.{kind}", f"{b}.{kind}"
        yield "heads.lm_bias", "output_layer.bias"


def _layers(cfg: ModelConfig):
    """(global index, ptdp prefix, Megatron prefix) of every transformer layer: the decoder's
    (encoder's) and the multi-token-prediction depths' (ptdp/megatron/mtp_names.py)."""
    block = block_name(cfg)
    for i in range(cfg.num_layers):
        yield i, f"layers.{i}.", f"{block}.layers.{i}."
    yield from layer_prefixes(cfg)


def _layer_pairs(cfg: ModelConfig, i: int, ours: str, theirs: str, norm_kinds):
    """(ptdp, Megatron) names of transformer layer i (prefixes `ours`, `theirs`) but a gated
    fc1."""
    bias = ("weight", "bias")
    proj_kinds = bias if cfg.bias else ("weight",)
    if cfg.latent_attention:
        yield from latent_pairs(cfg, ours, theirs, norm_kinds, proj_kinds)
    for a, b, kinds in [
            ("ln1", "input_layernorm", norm_kinds), ("ln2", "pre_mlp_layernorm", norm_kinds),
            ("attention.qkv", "self_attention.linear_qkv", bias if cfg.qkv_bias else ("weight",)),
            ("attention.proj", "self_attention.linear_proj", proj_kinds)]:
        if cfg.latent_attention and a.startswith("attention."):
            continue
        for kind in kinds:
            yield f"{ours}{a}.{kind}", f"{theirs}{b}.{kind}"
    for a, b in _mlp_linears(cfg, i):
        if not (cfg.gated and _is_fc1(a)):
            yield f"{ours}{a}", f"{theirs}{b}"


def _mlp_linears(cfg: ModelConfig, layer: int):
    """(ptdp, Megatron) names under layer `layer`'s MLP: the dense MLP's linears, or a mixture
    of experts' router, experts (by global index: a legacy file's `local_experts.{j}` is
    renumbered when read, ptdp/megatron/legacy.py) and shared experts."""
    if not cfg.is_moe_layer(layer):
        for a, b in (("mlp.fc1", "mlp.linear_fc1"), ("mlp.fc2", "mlp.linear_fc2")):
            for kind in ("weight", "bias") if cfg.bias else ("weight",):
                yield f"{a}.{kind}", f"{b}.{kind}"
        return
    yield "mlp.router.weight", "mlp.router.weight"
    for j in range(cfg.num_experts):
        for a, b in (("fc1", "linear_fc1"), ("fc2", "linear_fc2")):
            yield f"mlp.experts.{j}.{a}.weight", f"mlp.experts.local_experts.{j}.{b}.weight"
    if cfg.moe_shared_ffn_hidden_size:
        for a, b in (("fc1", "linear_fc1"), ("fc2", "linear_fc2")):
            yield f"mlp.shared.mlp.{a}.weight", f"mlp.shared_experts.{b}.weight"
        if cfg.moe_shared_expert_gate:
            yield "mlp.shared.gate", "mlp.shared_experts.gate_weight"


def _is_fc1(name: str) -> bool:
    return ".fc1." in f".{name}"


def _fc1_names(cfg: ModelConfig):
    """(ptdp, Megatron) names of every fc1 weight (and bias) whose rows are SwiGLU's gate and
    up."""
    for i, ours, theirs in _layers(cfg):
        for a, b in _mlp_linears(cfg, i):
            if _is_fc1(a):
                yield f"{ours}{a}", f"{theirs}{b}"


def to_ptdp(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full Megatron state -> ptdp's full state, refusing a missing or an unused weight."""
    state = {k: v for k, v in state.items() if not k.endswith(EXPERT_BIAS)}   # expert_biases
    if cfg.tie_embeddings:
        state.pop("output_layer.weight", None)   # the last stage's copy of the word table
    out, used = {}, set()

    def take(theirs: str) -> torch.Tensor:
        require(theirs in state, f"the Megatron checkpoint has no '{theirs}' (its args describe "
                                 f"a model that has it)")
        used.add(theirs)
        return state[theirs].float()

    for ours, theirs in _pairs(cfg):
        out[ours] = rotary_rows(cfg, theirs, take(theirs), to_pairs=False).contiguous()
    if cfg.gated:
        for ours, theirs in _fc1_names(cfg):
            out[ours] = fuse_gate_up(*take(theirs).chunk(2, dim=0))   # Megatron: [gate; up]
    extra = [name for name in state if name not in used]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise MegatronConversionError(f"the Megatron checkpoint holds '{extra[0]}'{more}, which "
                                      f"ptdp's model has no place for")
    return _cut_rows(cfg, out)


def _cut_rows(cfg: ModelConfig, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The vocabulary tables cut to model.vocab_size rows (Megatron's padded size unless a
    smaller one was asked for) and a learned position table to model.seq_length rows."""
    for name, key in [("embedding.word.weight", "vocab_size"), ("heads.lm_bias", "vocab_size"),
                      ("output_layer.weight", "vocab_size"), ("embedding.position", "seq_length")]:
        if name in out:
            count = getattr(cfg, key)
            require(out[name].shape[0] >= count, f"model.{key}={count} is more than the "
                                                 f"checkpoint's {out[name].shape[0]} rows of "
                                                 f"'{name}'")
            out[name] = out[name][:count].contiguous()
    return out


EXPERT_BIAS = ".mlp.router.expert_bias"


def _routers(cfg: ModelConfig) -> dict[str, str]:
    """{global MoE layer: its router's Megatron selection-bias name}, the depths' layers too."""
    return {str(i): f"{theirs}{EXPERT_BIAS[1:]}" for i, _, theirs in _layers(cfg)
            if cfg.is_moe_layer(i)}


def expert_biases(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """The routers' selection biases of a Megatron state (--moe-router-enable-expert-bias) as
    ptdp's checkpoints hold them (metadata "moe" `expert_bias`: layer -> E values)."""
    return {i: state[name].float().tolist() for i, name in _routers(cfg).items() if name in state}


def to_megatron(cfg: ModelConfig, full: dict[str, torch.Tensor],
                biases: dict | None = None) -> dict[str, torch.Tensor]:
    """ptdp's full state (and its selection biases, metadata "moe") -> a full Megatron state
    (vocabulary not padded yet)."""
    out = {theirs: rotary_rows(cfg, theirs, full[ours], to_pairs=True)
           for ours, theirs in _pairs(cfg)}
    if cfg.moe_expert_bias_rate > 0:   # megatron-core's router then holds the buffer
        for i, name in _routers(cfg).items():
            row = (biases or {}).get(i, [0.0] * cfg.num_experts)
            out[name] = torch.tensor(row, dtype=torch.float32)
    if cfg.gated:
        for ours, theirs in _fc1_names(cfg):
            out[theirs] = torch.cat(split_gate_up(full[ours]), dim=0)
    return out


# Split by a vocabulary (rows padded to Megatron's padded_vocab_size).
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")
# megatron-core saves an `_extra_state` (TransformerEngine's fp8 metadata; None with the local
# spec) for each linear of a layer (experts' and shared experts' included) and, with
# TransformerEngine, for its attention kernel. A strict load expects exactly these, so a
# written checkpoint has them.
_LINEAR = re.compile(r"^(.*\.(?:linear_(?:qkv|proj|fc1|fc2|q_proj|q_down_proj|q_up_proj"
                     r"|kv_down_proj|kv_up_proj)|eh_proj))\.weight$")
_QKV = re.compile(r"^(.*\.layers\.\d+\.(?:transformer_layer\.)?self_attention\.)"
                  r"linear_(?:qkv|kv_up_proj)\.weight$")


def extra_states(state: dict, fused_norms: bool) -> dict:
    """{module._extra_state: None} for the layers' modules of `state` (numbered names)."""
    out = {}
    for name in state:
        if match := _LINEAR.match(name):
            out[f"{match.group(1)}._extra_state"] = None
        if fused_norms and (match := _QKV.match(name)):
            out[f"{match.group(1)}core_attention._extra_state"] = None
    return out
