"""Megatron-LM's own checks when it loads a checkpoint, reproduced without its training code
(not installed): `check_checkpoint_args` and the arguments `load_args_from_checkpoint` reads,
exactly as Megatron-LM core_v0.16.1 (commit 55ac7082517c3878ae653c07c09c534b8aed49f6,
github.com/NVIDIA/Megatron-LM) has them in megatron/training/checkpointing.py, lines 102-141
and 1393-1474; and the run's values of the compared arguments from a command line, with the
definitions and defaults of megatron/training/arguments.py and the padding of
megatron/training/tokenizer/tokenizer.py `build_tokenizer` / `_vocab_size_with_padding`.
"""

from __future__ import annotations

import argparse
import math
from argparse import Namespace

# load_args_from_checkpoint's _set_arg names (tokenizer_model / tokenizer_type under
# --use-tokenizer-model-from-checkpoint-args, the parallel sizes under
# --use-mp-args-from-checkpoint-args), in its order.
LOADED = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
    "num_query_groups", "group_query_attention", "kv_channels", "max_position_embeddings",
    "position_embedding_type", "add_position_embedding", "use_rotary_position_embeddings",
    "rotary_base", "rotary_percent", "rotary_interleaved", "add_bias_linear", "add_qkv_bias",
    "squared_relu", "swiglu", "untie_embeddings_and_output_weights", "apply_layernorm_1p",
    "normalization", "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout",
    "hybrid_override_pattern", "spec", "hybrid_attention_ratio", "hybrid_mlp_ratio",
    "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk",
    "moe_token_dispatcher_type", "moe_router_pre_softmax", "moe_grouped_gemm",
    "moe_shared_expert_intermediate_size", "moe_router_score_function",
    "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
    "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
    "is_hybrid_model", "heterogeneous_layers_config_path",
    "heterogeneous_layers_config_encoded_json", "moe_latent_size", "tokenizer_model",
    "tokenizer_type", "tiktoken_pattern", "padded_vocab_size", "ckpt_format",
    "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
    "expert_model_parallel_size")
# load_checkpoint reads these of the checkpoint's args after the comparison
PROGRESS = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")


def check_checkpoint_args(checkpoint_args, args, checkpoint_version: float) -> None:
    """Megatron-LM's check_checkpoint_args, line for line (AssertionError or AttributeError
    where Megatron-LM raises them)."""
    def _compare(arg_name, old_arg_name=None, default=None):
        ckpt_arg_name = old_arg_name if old_arg_name is not None else arg_name
        if default is not None:
            checkpoint_value = getattr(checkpoint_args, ckpt_arg_name, default)
        else:
            checkpoint_value = getattr(checkpoint_args, ckpt_arg_name)
        args_value = getattr(args, arg_name)
        assert checkpoint_value == args_value, (
            f"{arg_name} value from checkpoint ({checkpoint_value}) is not equal to the input "
            f"argument value ({args_value}).")

    _compare('num_layers')
    _compare('hidden_size')
    _compare('num_attention_heads')
    _compare('add_position_embedding', default=True)
    if args.vocab_file:
        _compare('max_position_embeddings')
        _compare('make_vocab_size_divisible_by')
        if not args.use_dist_ckpt:
            _compare('padded_vocab_size')
        _compare('tokenizer_type')
    if args.data_parallel_random_init:
        _compare('data_parallel_random_init')
    if args.phase_transition_iterations:
        _compare('global_batch_size')
    if checkpoint_version < 3.0:
        _compare('tensor_model_parallel_size', old_arg_name='model_parallel_size')
    if checkpoint_version >= 3.0 and not args.use_dist_ckpt:
        _compare('tensor_model_parallel_size')
        _compare('pipeline_model_parallel_size')


def _parser() -> argparse.ArgumentParser:
    """Megatron-LM's definitions of the arguments check_checkpoint_args reads."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads",
                 "--max-position-embeddings", "--padded-vocab-size", "--vocab-size",
                 "--global-batch-size"):
        p.add_argument(flag, type=int, default=None)
    p.add_argument("--no-position-embedding", action="store_false",
                   dest="add_position_embedding")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    for flag in ("--tokenizer-type", "--vocab-file", "--merge-file", "--tokenizer-model",
                 "--phase-transition-iterations"):
        p.add_argument(flag, type=str, default=None)
    p.add_argument("--data-parallel-random-init", action="store_true")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--ckpt-format", default="torch_dist")
    return p


def run_args(words: list[str], tokenizer_vocab: int) -> Namespace:
    """The compared arguments of a Megatron-LM run given `words` (the other flags of the line
    are the model's, not compared), its tokenizer holding `tokenizer_vocab` ids."""
    args, _ = _parser().parse_known_args(words)
    args.use_dist_ckpt = args.ckpt_format != "torch"            # update_use_dist_ckpt
    if args.padded_vocab_size is None:                          # build_tokenizer
        multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        args.padded_vocab_size = int(math.ceil(tokenizer_vocab / multiple) * multiple)
    return args


def assert_loads(directory, words: list[str], tokenizer_vocab: int) -> int:
    """check_checkpoint_args on the args of every file of a written iteration `directory`
    (each legacy rank file, or torch_dist's common.pt) against the run `words` make; returns
    how many files were checked."""
    import torch
    paths = sorted(directory.glob("mp_rank_*/model_optim_rng.pt")) or [directory / "common.pt"]
    run = run_args(words, tokenizer_vocab)
    for path in paths:
        saved = torch.load(path, weights_only=False)
        missing = [n for n in LOADED + PROGRESS if not hasattr(saved["args"], n)]
        assert missing == [], path
        check_checkpoint_args(saved["args"], run, saved.get("checkpoint_version", 0))
    return len(paths)
