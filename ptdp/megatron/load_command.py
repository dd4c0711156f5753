"""The Megatron-LM command-line arguments that load a checkpoint ptdp wrote: rendered from the
checkpoint's own `args` (ptdp/megatron/model_args.py `megatron_args`), so the run's values
are the checkpoint's wherever Megatron-LM's `check_checkpoint_args` compares them
(add_position_embedding, make_vocab_size_divisible_by, padded_vocab_size, tokenizer_type,
max_position_embeddings, the tensor and pipeline sizes) and the model it builds is the one
written. Optimizer and RNG states are not written, hence --no-load-optim --no-load-rng.
"""

from __future__ import annotations

from ptdp.megatron.model_args import gelu_with_bias
from ptdp.megatron.mtp_args import mtp_flags

# (Megatron-LM flag, argument): flags with a value, written when the argument is not None.
VALUED = [
    ("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
    ("--ffn-hidden-size", "ffn_hidden_size"), ("--num-attention-heads", "num_attention_heads"),
    ("--kv-channels", "kv_channels"), ("--seq-length", "seq_length"),
    ("--max-position-embeddings", "max_position_embeddings"),
    ("--position-embedding-type", "position_embedding_type"),
    ("--normalization", "normalization"), ("--norm-epsilon", "layernorm_epsilon"),
    ("--hidden-dropout", "hidden_dropout"), ("--attention-dropout", "attention_dropout"),
    ("--init-method-std", "init_method_std"),
    ("--tokenizer-type", "tokenizer_type"), ("--vocab-file", "vocab_file"),
    ("--merge-file", "merge_file"), ("--tokenizer-model", "tokenizer_model"),
    ("--vocab-size", "vocab_size"),
    ("--make-vocab-size-divisible-by", "make_vocab_size_divisible_by"),
    ("--padded-vocab-size", "padded_vocab_size"),
    ("--num-experts", "num_experts"), ("--moe-ffn-hidden-size", "moe_ffn_hidden_size"),
    ("--moe-router-topk", "moe_router_topk"),
    ("--moe-shared-expert-intermediate-size", "moe_shared_expert_intermediate_size"),
    ("--moe-router-score-function", "moe_router_score_function"),
    ("--moe-router-topk-scaling-factor", "moe_router_topk_scaling_factor"),
    ("--moe-router-bias-update-rate", "moe_router_bias_update_rate"),
    ("--moe-router-load-balancing-type", "moe_router_load_balancing_type"),
    ("--moe-aux-loss-coeff", "moe_aux_loss_coeff"), ("--moe-z-loss-coeff", "moe_z_loss_coeff"),
    ("--moe-router-num-groups", "moe_router_num_groups"),
    ("--moe-router-group-topk", "moe_router_group_topk"),
    ("--moe-expert-capacity-factor", "moe_expert_capacity_factor"),
    ("--ckpt-format", "ckpt_format"), ("--transformer-impl", "transformer_impl"),
]
# (flag, argument, the value that writes the flag): switches.
SWITCHES = [
    ("--no-position-embedding", "add_position_embedding", False),
    ("--group-query-attention", "group_query_attention", True),
    ("--use-rope-scaling", "use_rope_scaling", True), ("--swiglu", "swiglu", True),
    ("--squared-relu", "squared_relu", True), ("--openai-gelu", "openai_gelu", True),
    ("--apply-layernorm-1p", "apply_layernorm_1p", True),
    ("--disable-bias-linear", "add_bias_linear", False), ("--add-qkv-bias", "add_qkv_bias", True),
    ("--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights", True),
    ("--moe-shared-expert-gate", "moe_shared_expert_gate", True),
    ("--moe-router-pre-softmax", "moe_router_pre_softmax", True),
    ("--moe-router-enable-expert-bias", "moe_router_enable_expert_bias", True),
    ("--moe-grouped-gemm", "moe_grouped_gemm", True),   # GroupedMLP's legacy layout
]
# latent attention's, after --multi-latent-attention --qk-layernorm
LATENT = [("--q-lora-rank", "q_lora_rank"), ("--kv-lora-rank", "kv_lora_rank"),
          ("--qk-head-dim", "qk_head_dim"), ("--qk-pos-emb-head-dim", "qk_pos_emb_head_dim"),
          ("--v-head-dim", "v_head_dim"), ("--rope-type", "rope_type"),
          ("--rotary-scaling-factor", "rotary_scaling_factor"), ("--mscale", "mscale"),
          ("--mscale-all-dim", "mscale_all_dim")]


def load_flags(args, split: bool) -> list[str]:
    """The Megatron-LM arguments (a list of words) that build and load the checkpoint with
    `args`; `split`: the legacy format, whose tensor and pipeline sizes are the files'."""
    words: list[str] = []
    moe = bool(getattr(args, "num_experts", None))

    def add(flag, value):
        words.extend([flag, _text(value)])

    for flag, name in VALUED:
        if getattr(args, name, None) is not None and (moe or not name.startswith("moe_")):
            add(flag, getattr(args, name))
    if moe and getattr(args, "moe_expert_capacity_factor", None) is not None:
        add("--moe-token-drop-policy", args.moe_token_drop_policy)
    for flag, name, when in SWITCHES:
        if getattr(args, name, not when) == when and (moe or not name.startswith("moe_")):
            words.append(flag)
    if args.position_embedding_type == "rope":
        add("--rotary-base", args.rotary_base)
        if args.use_rope_scaling:
            add("--rope-scaling-factor", args.rope_scaling_factor)
    if args.group_query_attention:
        add("--num-query-groups", args.num_query_groups)
    if getattr(args, "multi_latent_attention", False):   # ptdp/megatron/latent.py
        words.extend(["--multi-latent-attention", "--qk-layernorm"])
        for flag, name in LATENT:
            if getattr(args, name, None) is not None:
                add(flag, getattr(args, name))
    if moe:
        add("--moe-layer-freq", args.moe_layer_freq)
    words += mtp_flags(args)   # --mtp-num-layers, --mtp-loss-scaling-factor
    if split:
        add("--tensor-model-parallel-size", args.tensor_model_parallel_size)
        add("--pipeline-model-parallel-size", args.pipeline_model_parallel_size)
        if args.expert_model_parallel_size > 1:
            add("--expert-model-parallel-size", args.expert_model_parallel_size)
    words += ["--no-load-optim", "--no-load-rng"]
    if gelu_with_bias(args) and not args.bias_gelu_fusion:
        words.append("--no-bias-gelu-fusion")   # its default fused bias-GeLU is the tanh one
    return words


def _text(value) -> str:
    """A value as Megatron-LM's parser takes it (a layer pattern as its Python list text)."""
    if isinstance(value, (list, tuple)):
        return "'[" + ",".join(str(v) for v in value) + "]'"
    return str(value)
