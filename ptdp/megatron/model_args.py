"""The model shape in a Megatron checkpoint's `args` (its argparse Namespace) <-> ptdp's
ModelConfig, refusing in one line what ptdp's model would compute differently.

Read: the fields Megatron-LM's `load_args_from_checkpoint` reads (num_layers, hidden_size,
num_attention_heads, num_query_groups, ffn_hidden_size, max_position_embeddings,
padded_vocab_size, normalization, swiglu, position_embedding_type, ...). The vocabulary is
`padded_vocab_size`: Megatron's softmax runs over the padded rows too, so keeping them is
what reproduces its logits and losses.

Written (ptdp -> Megatron): every argument Megatron-LM's `load_args_from_checkpoint` reads and
its `check_checkpoint_args` compares (tensor/pipeline sizes, make_vocab_size_divisible_by,
add_position_embedding, the tokenizer's, ptdp/megatron/tokenizer_args.py), the MoE ones
(ptdp/megatron/moe_args.py), multi-token prediction's (ptdp/megatron/mtp_args.py) and the
progress fields its loader reads (iteration, consumed_train_samples);
ptdp/megatron/load_command.py prints the matching command line.
"""

from __future__ import annotations

from argparse import Namespace

import torch

from ptdp.config import ModelConfig
from ptdp.config.models import GPT2_BLOCK, LLAMA_BLOCK, Heads, model_family
from ptdp.megatron.latent import latent_megatron_args, refuse_latent_for_megatron
from ptdp.megatron.moe_args import moe_args, moe_config, refuse_moe_for_megatron
from ptdp.megatron.mtp_args import mtp_config, mtp_megatron_args, mtp_notes
from ptdp.megatron.errors import argument, require

# Megatron's llama3 rope scaling (rotary_pos_embedding.py `_apply_scaling`) fixes these three.
ROPE_SCALING_FIXED = dict(rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                          rope_original_seq_length=8192)


def _refusals(args):
    """(condition, argument, why) for every setting ptdp's block cannot compute."""
    latent = argument(args, "multi_latent_attention", False)   # ptdp/megatron/latent.py
    yield argument(args, "qk_layernorm", False) and not latent, "qk_layernorm", \
        "the converter does not map q_layernorm/k_layernorm weights yet (model.qk_norm computes it)"
    yield argument(args, "apply_residual_connection_post_layernorm", False), \
        "apply_residual_connection_post_layernorm", "ptdp's residual adds the layer's input"
    yield argument(args, "squared_relu", False), "squared_relu", "ptdp's MLP is GeLU or SwiGLU"
    yield argument(args, "softmax_scale", None) is not None, "softmax_scale", \
        "ptdp scales attention by 1/sqrt(head_dim)"
    yield argument(args, "rotary_interleaved", False), "rotary_interleaved", \
        "ptdp rotates halves of each head (rotate_half), not interleaved pairs"
    yield argument(args, "rotary_percent", 1.0) != 1.0 and not latent, "rotary_percent", \
        "ptdp rotates the whole head"
    yield argument(args, "window_size", None) is not None, "window_size", \
        "the converter does not translate Megatron's sliding windows yet (model.sliding_window)"
    yield argument(args, "heterogeneous_layers_config_path", None), \
        "heterogeneous_layers_config_path", "ptdp's layers all have one shape"
    yield argument(args, "add_position_embedding", True) is False and argument(
        args, "position_embedding_type", "learned_absolute") == "learned_absolute", \
        "add_position_embedding", "a model without positions; ptdp's have learned or rotary ones"


def model_config(args, arch: str, vocab_rows: int | None = None) -> ModelConfig:
    """The ModelConfig of a checkpoint's args (`vocab_rows`: the word table's padded size,
    when args lack padded_vocab_size)."""
    require(args is not None, "the checkpoint has no 'args': Megatron-LM saves its arguments "
                              "in every checkpoint, and the model's shape comes from them")
    for condition, name, why in _refusals(args):
        require(not condition, f"--{name.replace('_', '-')}={argument(args, name)}: {why}, so the "
                               f"logits would differ")
    norm = argument(args, "normalization", "LayerNorm")
    require(norm in ("LayerNorm", "RMSNorm"), f"--normalization={norm}: ptdp has LayerNorm and "
                                              f"RMSNorm")
    kind = argument(args, "position_embedding_type", "learned_absolute")
    require(kind in ("learned_absolute", "rope"), f"--position-embedding-type={kind}: ptdp's "
                                                  f"positions are learned_absolute or rope")
    heads, hidden = args.num_attention_heads, args.hidden_size
    kv = argument(args, "kv_channels", hidden // heads)
    gated = bool(argument(args, "swiglu", False))
    if model_family(arch).heads is Heads.BERT:   # Megatron's BertModel
        _refuse_for_bert(args, gated, norm, kind)
    groups = (argument(args, "num_query_groups", heads)
              if argument(args, "group_query_attention", False) else heads)
    bias = bool(argument(args, "add_bias_linear", True))
    rope = kind == "rope"
    max_pos = argument(args, "max_position_embeddings", argument(args, "seq_length"))
    seq = argument(args, "seq_length", max_pos)
    require(rope or seq <= max_pos, f"--seq-length={seq} is longer than the position table "
                                    f"(--max-position-embeddings={max_pos})")
    extra = {}
    latent = bool(argument(args, "multi_latent_attention", False))
    require(rope or not latent, f"--multi-latent-attention with --position-embedding-type={kind}: "
                                f"ptdp's latent attention has rotary positions")
    if rope:
        extra = dict(rope_theta=float(argument(args, "rotary_base", 10000)))
        if max_pos is not None and seq is not None and max_pos > seq:   # trainable up to it
            extra.update(max_position_embeddings=max_pos)
        if argument(args, "use_rope_scaling", False) and not latent:   # (MLA: not read)
            extra.update(rope_scaling_factor=float(argument(args, "rope_scaling_factor", 8.0)),
                         **ROPE_SCALING_FIXED)
    vocab = argument(args, "padded_vocab_size", vocab_rows)
    require(vocab is not None, "the checkpoint's args have no padded_vocab_size")
    keys = dict(
        arch=arch, num_layers=args.num_layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=groups, ffn_hidden_size=argument(args, "ffn_hidden_size", 4 * hidden),
        # the length Megatron trained at; a longer learned table is cut to it (names.py)
        seq_length=seq,
        vocab_size=vocab, dropout=float(argument(args, "hidden_dropout", 0.1)),
        attention_dropout=float(argument(args, "attention_dropout", 0.1)),
        layernorm_eps=float(argument(args, "layernorm_epsilon", 1e-5)),
        init_std=float(argument(args, "init_method_std", 0.02)),
        preset=LLAMA_BLOCK if rope else GPT2_BLOCK,
        position_embedding="rope" if rope else "learned",
        normalization="rmsnorm" if norm == "RMSNorm" else "layernorm",
        norm_zero_centered=bool(argument(args, "apply_layernorm_1p", False)
                                or argument(args, "layernorm_zero_centered_gamma", False)),
        activation="swiglu" if gated else "gelu_tanh" if tanh_gelu(args, arch) else "gelu",
        bias=bias, head_dim=kv,
        qkv_bias=bias or bool(argument(args, "add_qkv_bias", False)),
        tie_embeddings=not argument(args, "untie_embeddings_and_output_weights", False),
        **moe_config(args, argument), **mtp_config(args))
    return ModelConfig(**dict(keys, **_latent(args, latent, heads, extra)))


def _latent(args, latent: bool, heads: int, extra: dict) -> dict:
    """`extra` with latent attention's keys and rotary scaling (ptdp/megatron/latent.py)."""
    if not latent:
        return extra
    from ptdp.megatron.latent import latent_config
    base = dict(extra, num_heads=heads, position_embedding="rope")
    return dict(extra, **latent_config(args, base))


def _refuse_for_bert(args, gated: bool, norm: str, kind: str) -> None:
    """ptdp's BERT (models/bert.py): GeLU, LayerNorm (its LM head's too), learned positions,
    the LM head tied to the word table, and always the sentence-order head."""
    for condition, setting in [
            (gated, "--swiglu"), (norm != "LayerNorm", f"--normalization={norm}"),
            (kind != "learned_absolute", f"--position-embedding-type={kind}"),
            (argument(args, "untie_embeddings_and_output_weights", False),
             "--untie-embeddings-and-output-weights"),
            (not argument(args, "bert_binary_head", True), "--bert-binary-head=False")]:
        require(not condition, f"{setting} with BERT: ptdp's BERT has GeLU, LayerNorm, learned "
                               f"positions, a tied LM head and the sentence-order head")


def notes(args, arch: str) -> list[str]:
    """What converts but trains differently, one line each (printed by `ptdp convert`)."""
    out = []
    if fused_tanh_gelu(args) and not tanh_gelu(args, arch):
        out.append("the run used Megatron's fused bias-GeLU (--bias-gelu-fusion, its default), "
                   "the tanh approximation; ptdp's BERT has the GPT-2 block's exact GeLU, so "
                   "logits differ slightly")
    seq, table = argument(args, "seq_length"), argument(args, "max_position_embeddings")
    if argument(args, "position_embedding_type", "learned_absolute") == "learned_absolute" and \
            seq is not None and table is not None and seq < table:
        out.append(f"the position table's rows from --seq-length={seq} on (of "
                   f"--max-position-embeddings={table}) are dropped: ptdp's table has "
                   f"model.seq_length rows, and Megatron trained none beyond {seq}")
    if argument(args, "openai_gelu", False):
        out.append("--openai-gelu changes only Megatron-LM's legacy models; its megatron-core "
                   "model computed the GeLU the checkpoint converts with")
    return out + mtp_notes(args)


def gelu_with_bias(args) -> bool:
    """A GeLU MLP with biases: the model Megatron-LM computes, by default
    (--bias-gelu-fusion), with its fused kernel, the tanh approximation
    (megatron/core/fusions/fused_bias_gelu.py), and otherwise the exact GeLU."""
    gelu = not (argument(args, "swiglu", False) or argument(args, "squared_relu", False))
    return gelu and argument(args, "add_bias_linear", True)


def tanh_gelu(args, arch: str) -> bool:
    """model.activation: gelu_tanh for Megatron's fused bias-GeLU where the family has block
    options (ptdp's BERT keeps the GPT-2 block's exact GeLU: noted instead)."""
    return fused_tanh_gelu(args) and model_family(arch).block_options


def fused_tanh_gelu(args) -> bool:
    """Whether megatron-core's MLP computed the tanh GeLU (model.activation: gelu_tanh): the
    fused bias-GeLU (Megatron-LM's args default --bias-gelu-fusion to True; megatron-core's
    MLP ignores --openai-gelu, which only Megatron-LM's legacy models read)."""
    return gelu_with_bias(args) and bool(argument(args, "bias_gelu_fusion", False))


def refuse_for_megatron(cfg: ModelConfig) -> None:
    """What of ptdp's model Megatron's would compute otherwise (ptdp -> Megatron)."""
    refuse_moe_for_megatron(cfg)
    require(cfg.activation != "gelu_tanh" or cfg.bias,
            "model.activation=gelu_tanh without biases: megatron-core computes the tanh GeLU "
            "only fused with the MLP's bias (--bias-gelu-fusion)")
    require(cfg.activation != "geglu", "model.activation=geglu: megatron-core's gated MLP is "
                                        "SwiGLU (--swiglu); it has no GeGLU")
    require(not cfg.qk_norm, "model.qk_norm=true: the converter does not write Megatron's "
                             "q_layernorm/k_layernorm weights yet (--qk-layernorm)")
    if cfg.latent_attention:
        refuse_latent_for_megatron(cfg)
    require(cfg.rope_scaling_factor == 1.0 or cfg.rope_scaling_type == "llama3"
            or cfg.latent_attention,
            f"model.rope_scaling_type={cfg.rope_scaling_type}: Megatron-LM's GPT scales rotary "
            f"positions as Llama 3 does (--use-rope-scaling) only")
    require(not cfg.scale_embeddings, "model.scale_embeddings=true: Megatron-LM's GPT has no "
                                      "such option")
    require(cfg.sliding_window is None, "model.sliding_window: the converter does not write "
                                        "Megatron's sliding windows (--window-size) yet")
    if cfg.position_embedding == "rope" and cfg.rope_scaling_factor != 1.0 and \
            not cfg.latent_attention:
        for key, fixed in ROPE_SCALING_FIXED.items():
            require(getattr(cfg, key) == fixed, f"model.{key}={getattr(cfg, key)}: Megatron's "
                                                f"rope scaling fixes it at {fixed}")
    if cfg.family.heads is Heads.BERT:
        for key, want in [("normalization", "layernorm"), ("activation", "gelu"),
                          ("position_embedding", "learned"), ("tie_embeddings", True),
                          ("num_tokentypes", 2)]:
            require(getattr(cfg, key) == want, f"model.{key}={getattr(cfg, key)}: Megatron's "
                                               f"BERT (with its binary head) has {key} {want}")


def vocab_divisor(vocab: int, tensor: int) -> int:
    """The largest of 128, 64, ..., 1 whose multiple of `tensor` divides `vocab`: Megatron pads
    the vocabulary to a multiple of make_vocab_size_divisible_by * tensor size, and with this
    divisor it adds no rows (1 when even that pads: vocab not a multiple of the tensor size)."""
    for divisor in (128, 64, 32, 16, 8, 4, 2, 1):
        if vocab % (divisor * tensor) == 0:
            return divisor
    return 1


def megatron_args(cfg: ModelConfig, split: dict, padded_vocab: int, progress: dict,
                  transformer_impl: str, ckpt_format: str, tokenizer: dict) -> Namespace:
    """The Namespace Megatron-LM's loader reads for ptdp's model: every argument its
    `check_checkpoint_args` compares and its `load_args_from_checkpoint` sets
    (megatron/training/checkpointing.py), Megatron-LM's defaults where ptdp has no
    counterpart. `split`: {"tensor", "pipeline", "expert"}; `progress`: {"iteration",
    "consumed_samples", "global_batch_size"}; `tokenizer`: ptdp/megatron/tokenizer_args.py."""
    rope = cfg.position_embedding == "rope"
    scaled = rope and cfg.rope_scaling_factor != 1.0 and not cfg.latent_attention
    return Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=cfg.num_heads,
        group_query_attention=cfg.num_kv_heads != cfg.num_heads,
        num_query_groups=cfg.num_kv_heads, kv_channels=cfg.head_dim,
        seq_length=cfg.seq_length, max_position_embeddings=cfg.max_positions,
        position_embedding_type="rope" if rope else "learned_absolute",
        # compared by check_checkpoint_args (its default True): the load command then says
        # --no-position-embedding for a rotary model (ptdp/megatron/load_command.py)
        add_position_embedding=not rope, use_rotary_position_embeddings=rope,
        rotary_base=int(cfg.rope_theta) if float(cfg.rope_theta).is_integer() else cfg.rope_theta,
        rotary_percent=1.0, rotary_interleaved=False, use_rope_scaling=scaled,
        rope_scaling_factor=cfg.rope_scaling_factor if scaled else 8.0,
        normalization="RMSNorm" if cfg.normalization == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=cfg.layernorm_eps, apply_layernorm_1p=cfg.norm_zero_centered,
        swiglu=cfg.activation == "swiglu", squared_relu=False, openai_gelu=False,
        # Megatron-LM's default: its fused bias-GeLU is the tanh GeLU; off, the exact one
        bias_gelu_fusion=cfg.activation == "gelu_tanh",
        add_bias_linear=cfg.bias, add_qkv_bias=cfg.qkv_bias,
        untie_embeddings_and_output_weights=not cfg.tie_embeddings,
        hidden_dropout=cfg.dropout, attention_dropout=cfg.attention_dropout_rate,
        init_method_std=cfg.init_std, apply_query_key_layer_scaling=False,
        apply_residual_connection_post_layernorm=False,
        bert_binary_head=cfg.family.heads is Heads.BERT,
        **NOT_PTDP, **moe_args(cfg), **latent_megatron_args(cfg), **mtp_megatron_args(cfg),
        **tokenizer,
        padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=vocab_divisor(cfg.vocab_size, split["tensor"]),
        tensor_model_parallel_size=split["tensor"],
        pipeline_model_parallel_size=split["pipeline"],
        expert_model_parallel_size=split.get("expert", 1),
        virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
        transformer_impl=transformer_impl, ckpt_format=ckpt_format,
        iteration=progress["iteration"], consumed_train_samples=progress["consumed_samples"],
        skipped_train_samples=0, consumed_valid_samples=0,
        global_batch_size=progress.get("global_batch_size"), data_parallel_random_init=False,
        phase_transition_iterations=None, params_dtype=torch.float32, fp16=False, bf16=False)


# What load_args_from_checkpoint reads that ptdp's models never have: Megatron-LM 0.16.1's
# defaults (megatron/training/arguments.py), so a reader finds each argument.
NOT_PTDP = dict(hybrid_override_pattern=None, spec=None, hybrid_attention_ratio=0.0,
                hybrid_mlp_ratio=0.0, is_hybrid_model=False, mamba_state_dim=128,
                mamba_head_dim=64, mamba_num_groups=8, mamba_num_heads=None,
                heterogeneous_layers_config_path=None,
                heterogeneous_layers_config_encoded_json=None, moe_latent_size=None)
