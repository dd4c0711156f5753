"""Tiny megatron-core GPT and BERT models on CPU, saved the way Megatron-LM saves them.

megatron-core 0.16 assumes CUDA in a few places that a CPU forward or save reaches; the
`cpu_megatron` context patches exactly those (the rotary table's device, the dropout RNG
tracker's fork, the pre-save synchronize, the writer's results queue and memory probe) and
nothing of the model's arithmetic. The models use the local (non-TransformerEngine) layer
specs in fp32 with dropout 0, on a 1-rank gloo group.
"""

from __future__ import annotations

import contextlib
import queue
import types
from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB, SEQ = 128, 16


@contextlib.contextmanager
def cpu_megatron(monkeypatch_context):
    from megatron.core import parallel_state, tensor_parallel
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fsa

    mp = monkeypatch_context
    mp.setattr(torch.cuda, "current_device", lambda: "cpu")
    mp.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    mp.setattr(tensor_parallel, "get_cuda_rng_tracker",
               lambda *a, **k: types.SimpleNamespace(fork=contextlib.nullcontext))
    mp.setattr(fsa, "_results_queue", queue.Queue())
    mp.setattr(fsa, "_process_memory", lambda: 0)
    _cpu_experts(mp)
    import megatron.core.transformer.multi_latent_attention as mla
    # MLA asks TransformerEngine's TELinear (None without it) whether linear_proj is one
    mp.setattr(mla, "HAVE_TE", False)
    owned = not dist.is_initialized()
    if owned:
        from ptdp.runtime.local_ranks import free_port
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if owned:
            dist.destroy_process_group()


def _cpu_experts(mp) -> None:
    """megatron-core's MoE on CPU: the router's GEMM names TransformerEngine's `te_general_gemm`
    unguarded, and GroupedMLP needs the grouped_gemm package: a per-expert loop of the same
    products (`gmm(a, b, batch_sizes, trans_b)`: rows of expert e times b[e]) stands in."""
    import megatron.core.transformer.moe.grouped_gemm_util as gg
    import megatron.core.transformer.moe.moe_utils as moe_utils

    def gmm(a, b, batch_sizes, trans_b=False):
        rows = a.split(batch_sizes.tolist())
        return torch.cat([x @ (w.t() if trans_b else w) for x, w in zip(rows, b)])

    mp.setattr(moe_utils, "te_general_gemm", None, raising=False)
    mp.setattr(gg, "grouped_gemm", types.SimpleNamespace(ops=None))
    mp.setattr(gg, "ops", types.SimpleNamespace(gmm=gmm))


def gpt_args(**overrides) -> Namespace:
    """The Megatron-LM arguments of the tiny GPT (what its checkpoints carry as 'args')."""
    args = dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                group_query_attention=True, num_query_groups=2, kv_channels=8,
                seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=VOCAB,
                make_vocab_size_divisible_by=128, position_embedding_type="rope",
                rotary_base=10000, rotary_percent=1.0, normalization="RMSNorm",
                layernorm_epsilon=1e-5, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
                untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                attention_dropout=0.0, init_method_std=0.02, tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1, apply_query_key_layer_scaling=False)
    args.update(overrides)
    return Namespace(**args)


def bert_args(**overrides) -> Namespace:
    return gpt_args(**dict(dict(group_query_attention=False, num_query_groups=None,
                                position_embedding_type="learned_absolute",
                                normalization="LayerNorm", swiglu=False, add_bias_linear=True,
                                untie_embeddings_and_output_weights=False,
                                bert_binary_head=True, ffn_hidden_size=64), **overrides))


def moe_args(**overrides) -> Namespace:
    """A DeepSeek-style mixture of experts on the tiny Llama: sigmoid scores with selection
    biases, node-limited routing (each token's 2 experts from the better of 2 groups), scaled
    gates, a gated shared expert, SwiGLU experts, no biases."""
    return gpt_args(**dict(dict(
        num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
        moe_router_num_groups=2, moe_router_group_topk=1,
        moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5, moe_router_pre_softmax=False, moe_grouped_gemm=False,
        moe_layer_freq=1, moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="aux_loss"),
        **overrides))


def mla_args(**overrides) -> Namespace:
    """Latent attention (--multi-latent-attention --qk-layernorm, DeepSeek-V2/V3's) on the tiny
    GPT: a query latent of 12, a key/value latent of 10, per head 6 non-rotary and 4 rotary
    query/key values and 5 value values; YaRN (megatron-core's default rope type for MLA) with
    a factor of 4 (over megatron-core's original 4096 positions), DeepSeek's mscale and
    mscale_all_dim."""
    return gpt_args(**dict(dict(
        group_query_attention=False, num_query_groups=None, multi_latent_attention=True,
        qk_layernorm=True, q_lora_rank=12, kv_lora_rank=10, qk_head_dim=6,
        qk_pos_emb_head_dim=4, v_head_dim=5, rope_type="yarn", rotary_scaling_factor=4.0,
        mscale=0.8, mscale_all_dim=0.6), **overrides))


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
              "original_max_position_embeddings")


def _core_attention():
    """megatron-core 0.16's local DotProductAttention takes no k_channels / v_channels, which
    MLASelfAttention passes (only TransformerEngine's takes them): the same attention, its
    output sized by the value heads (v_channels), the softmax scale MLA's."""
    import copy
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LatentCoreAttention(DotProductAttention):
        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
            config = copy.copy(config)
            config.kv_channels = v_channels or config.kv_channels
            super().__init__(config, *args, **kwargs)
    return LatentCoreAttention


def _moe_config(args: Namespace) -> dict:
    if not getattr(args, "num_experts", None):
        return {}
    return dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                moe_shared_expert_gate=args.moe_shared_expert_gate,
                moe_router_score_function=args.moe_router_score_function,
                moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
                moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
                moe_router_pre_softmax=args.moe_router_pre_softmax,
                moe_router_num_groups=args.moe_router_num_groups,
                moe_router_group_topk=args.moe_router_group_topk,
                moe_grouped_gemm=args.moe_grouped_gemm, moe_aux_loss_coeff=0.0,
                moe_token_dispatcher_type="allgather")   # the others need CUDA streams


def transformer_config(args: Namespace):
    from megatron.core.transformer.transformer_config import (MLATransformerConfig,
                                                              TransformerConfig)
    gated, latent = args.swiglu, getattr(args, "multi_latent_attention", False)
    extra = ({name: getattr(args, name) for name in MLA_FIELDS if hasattr(args, name)}
             | dict(multi_latent_attention=True, qk_layernorm=args.qk_layernorm)
             if latent else {})
    return (MLATransformerConfig if latent else TransformerConfig)(**_moe_config(args), **extra,
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        ffn_hidden_size=args.ffn_hidden_size, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, gated_linear_unit=gated,
        activation_func=torch.nn.functional.silu if gated else torch.nn.functional.gelu,
        normalization=args.normalization, add_bias_linear=args.add_bias_linear,
        bias_activation_fusion=getattr(args, "bias_gelu_fusion", False),
        layernorm_epsilon=args.layernorm_epsilon, init_method_std=args.init_method_std,
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
        mtp_loss_scaling_factor=getattr(args, "mtp_loss_scaling_factor", 0.1))


def build_gpt(args: Namespace, seed: int = 7):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    torch.manual_seed(seed)
    experts = getattr(args, "num_experts", None)
    latent = getattr(args, "multi_latent_attention", False)
    spec = get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=bool(experts and args.moe_grouped_gemm),
        normalization=args.normalization, multi_latent_attention=latent,
        qk_layernorm=getattr(args, "qk_layernorm", False))
    if latent:
        spec.submodules.self_attention.submodules.core_attention = _core_attention()
    config = transformer_config(args)
    model = GPTModel(config, spec,
                     vocab_size=args.padded_vocab_size, max_sequence_length=SEQ,
                     position_embedding_type=args.position_embedding_type,
                     share_embeddings_and_output_weights=not
                     args.untie_embeddings_and_output_weights,
                     mtp_block_spec=_mtp_spec(config, spec))
    _randomise_norms(model)
    _grouped_in_fp32(model)
    if getattr(args, "apply_layernorm_1p", False):
        _zero_centred(model)
    return model.eval()


def _mtp_spec(config, spec):
    """Multi-token prediction's depths (--mtp-num-layers) as Megatron-LM's GPT builder makes
    them: the last decoder layer's spec in megatron-core's MTP block spec; None without."""
    if not config.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)


def _zero_centred(model) -> None:
    """--apply-layernorm-1p: the norms' gain is 1 + weight, as megatron-core's FusedLayerNorm
    and TENorm compute it (megatron/core/fusions/fused_layer_norm.py: `weight = self.weight +
    1 if self.zero_centered_gamma`); its local spec's torch LayerNorm refuses the option, so
    its norms get that forward here."""
    import torch.nn.functional as F
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.forward = lambda x, m=module: F.layer_norm(
                x, m.normalized_shape, m.weight + 1, m.bias, m.eps)


def _grouped_in_fp32(model) -> None:
    """GroupedMLP.forward asserts config.bf16 (its grouped_gemm kernels' one dtype); the CPU
    stand-in computes in fp32, so its experts get a copy of the config saying bf16."""
    import copy
    from megatron.core.transformer.moe.experts import GroupedMLP
    for module in model.modules():
        if isinstance(module, GroupedMLP):
            module.config = copy.copy(module.config)
            module.config.bf16 = True


def build_bert(args: Namespace, seed: int = 8):
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    torch.manual_seed(seed)
    model = BertModel(transformer_config(args), num_tokentypes=2,
                      transformer_layer_spec=bert_layer_local_spec,
                      vocab_size=args.padded_vocab_size, max_sequence_length=SEQ,
                      share_embeddings_and_output_weights=True, add_binary_head=True)
    _randomise_norms(model)
    return model.eval()


def _randomise_norms(model) -> None:
    """Norm gains of 1 and zero biases would hide a swapped or missing weight."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):   # selection biases, as after some training
                b.copy_(torch.randn_like(b) * 0.1)


def gpt_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [b, s, vocab]: positions 0..s-1 and the causal mask, as pretrain_gpt.py."""
    s = tokens.shape[1]
    mask = torch.triu(torch.ones(1, 1, s, s), diagonal=1).bool()   # True = masked
    with torch.no_grad():
        return model(tokens, torch.arange(s).expand_as(tokens), mask).float()


def bert_logits(model, tokens, types_) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked-LM logits [b, s, vocab], binary logits [b, 2]) with no padding."""
    with torch.no_grad():
        lm, binary = model(tokens, torch.ones_like(tokens), tokentype_ids=types_)
    return lm.float(), binary.float()


def save_legacy(model, args: Namespace, root: Path, iteration: int,
                scheduler: dict | None = None) -> Path:
    """megatron-core's state dict where Megatron-LM's `--ckpt-format torch` puts it: root/
    latest_checkpointed_iteration.txt and root/iter_N/mp_rank_00/model_optim_rng.pt with
    'args', 'checkpoint_version', 'iteration' and 'model' (model.state_dict_for_save_checkpoint),
    and 'opt_param_scheduler' (its OptimizerParamScheduler.state_dict()) when given."""
    sub = root / f"iter_{iteration:07d}" / "mp_rank_00"
    sub.mkdir(parents=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                "model": model.state_dict_for_save_checkpoint(),
                **({"opt_param_scheduler": scheduler} if scheduler else {})},
               sub / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


def save_torch_dist(model, args: Namespace, root: Path, iteration: int) -> Path:
    """megatron.core.dist_checkpointing.save of Megatron-LM's state dict (the model's sharded
    state dict under 'model', the args and iteration beside it: they land in common.pt)."""
    from megatron.core import dist_checkpointing
    directory = root / f"iter_{iteration:07d}"
    directory.mkdir(parents=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args,
                             "iteration": iteration, "checkpoint_version": 3.0}, str(directory))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


def load_legacy_into(model, directory: Path) -> None:
    """Megatron-LM's legacy load of a (1, 1) checkpoint: strict load_state_dict of 'model'."""
    saved = torch.load(directory / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    model.load_state_dict(saved["model"], strict=True)


