"""The planner on multi-head latent attention (DeepSeek-V2/V3; models/latent_attention.py,
ptdp/planner/latent.py): parameter counts against the real model (whole and per tensor rank)
and DeepSeek-V3's published total, FLOPs against a hand-written sum and torch's FLOP counter,
activations and ZB-H1's pending weight gradients against what a layer really keeps, and the
layer times, profile rows and search rules that must see latent attention's own widths."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ptdp.config import load_config, padded_vocab_size
from ptdp.data.synthetic import synthetic_datasets
from ptdp.hardware import load_hardware
from ptdp.models import build_chunk
from ptdp.models.transformer import ModelContext, TransformerLayer, TransformerStack
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from ptdp.parallel.weight_grad import defer_weight_grads
from ptdp.planner.compute import (ModelShape, _attention_times, layer_kernel, layer_times,
                                  same_block)
from ptdp.planner.cost_model import Workload
from ptdp.planner.formulas import (active_parameters, decoder_parameters, iteration_flops,
                                   layer_parameter_split, parameter_total)
from ptdp.planner.latent import attention_forward_flops, attention_gemms
from ptdp.planner.memory import (layer_activation_bytes, layer_parameters,
                                 pending_weight_grad_bytes, stage_parameters)
from ptdp.planner.moe import moe_layer_count
from ptdp.planner.search import search
from ptdp.profiler.timing import param_storages, saved_bytes
from tests.optional import needs
from tests.planner.test_memory_terms import _tensors_in

# A toy DeepSeek-V3 attention: 4 heads of 8 (+ 4 rotary) query/key and 6 value values, a query
# latent of 16 and a key/value latent of 12 on h = 32; 3 layers so that MoE can keep one dense.
S, B, H = 16, 2, 32
MLA = ["model.arch=gpt", "model.num_layers=3", "model.hidden_size=32", "model.num_heads=4",
       "model.seq_length=16", "model.vocab_size=100", "model.dropout=0.0",
       "model.position_embedding=rope", "model.head_dim=8", "model.mla_kv_lora_rank=12",
       "model.mla_q_lora_rank=16", "model.mla_rope_head_dim=4", "model.mla_v_head_dim=6"]
BLOCKS = {"llama": ["model.preset=llama"],   # RMSNorm, SwiGLU, no biases, untied
          # LayerNorm's two parameters a unit (the latent norms' too), GeLU, the projection's bias
          "layernorm": ["model.normalization=layernorm", "model.activation=gelu",
                        "model.bias=true", "model.qkv_bias=false"]}
MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=16",
       "model.moe_first_dense_layers=1", "model.moe_shared_ffn_hidden_size=8",
       "model.moe_score_function=sigmoid", "model.moe_expert_bias_rate=0.01"]


def _config(block="llama", *overrides):
    return load_config(None, [*MLA, *BLOCKS[block], *overrides], world_size=1)


def _context(model, t=1, recompute="none", modules=None):
    tp = TensorParallel(group=None, rank=0, size=t)
    return ModelContext(model, tp, 7, TensorParallelRNG(7, 0, torch.device("cpu")),
                        padded_vocab_size(model.vocab_size, t), recompute, 1,
                        recompute_modules=modules)


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("q_lora", [16, 0])
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_parameter_count_equals_the_model(block, q_lora, tie, moe):
    # (with model.bias the dense MLPs and the shared expert have biases, the routed experts none)
    cfg = _config(block, f"model.mla_q_lora_rank={q_lora}",
                  f"model.tie_embeddings={str(tie).lower()}", *(MOE if moe else []))
    shape = ModelShape.from_config(cfg.model)
    assert shape.latent and shape.mla_q_lora == q_lora and bool(shape.experts) == moe
    params = _count(build_chunk(_context(cfg.model), 0, 1))
    assert decoder_parameters(shape, cfg.padded_vocab_size) == params
    assert parameter_total(shape, cfg.padded_vocab_size) == params
    assert stage_parameters(shape, 1, 1, cfg.padded_vocab_size, True, True) == params
    if not moe:
        assert active_parameters(shape, cfg.padded_vocab_size) == params


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("q_lora", [16, 0])
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_one_tensor_rank_holds_the_split_part_over_t_and_the_rest_whole(block, q_lora, t):
    """The up-projections and the projection are split by the heads, the down-projections, the
    latent norms and the projection's bias whole on every rank (models/latent_attention.py)."""
    cfg = _config(block, f"model.mla_q_lora_rank={q_lora}")
    shape = ModelShape.from_config(cfg.model)
    layer = TransformerLayer(_context(cfg.model, t), 0, causal=True)
    assert _count(layer) == layer_parameters(shape, t)
    whole = TransformerLayer(_context(cfg.model), 0, causal=True)
    split, replicated = layer_parameter_split(shape)
    assert (split, replicated) == (t * (_count(layer) - replicated), _count(whole) - split)


def _deepseek_v3(**changes):
    """DeepSeek-V3 (without its multi-token-prediction module): 61 layers, h = 7168, 128
    heads of 128 non-rotary + 64 rotary query/key values and 128 value values, latents of 1536
    (queries) and 512 (keys and values), V = 129280, RMSNorm, SwiGLU, untied; dense f = 18432 in
    the first 3 layers, then 256 routed experts of 2048 (top-8, sigmoid router) and one shared
    expert of 2048."""
    cfg = load_config(None, [
        "model.arch=gpt", "model.preset=llama", "model.num_layers=61", "model.hidden_size=7168",
        "model.num_heads=128", "model.head_dim=128", "model.mla_rope_head_dim=64",
        "model.mla_v_head_dim=128", "model.mla_q_lora_rank=1536", "model.mla_kv_lora_rank=512",
        "model.ffn_hidden_size=18432", "model.seq_length=4096", "model.vocab_size=129280",
        "model.num_experts=256", "model.moe_top_k=8", "model.moe_ffn_hidden_size=2048",
        "model.moe_shared_ffn_hidden_size=2048", "model.moe_first_dense_layers=3",
        "model.moe_score_function=sigmoid", "model.moe_expert_bias_rate=0.001",
        "model.dropout=0.0"], world_size=1)
    return dataclasses.replace(ModelShape.from_config(cfg.model), **changes)


# Per layer: attention q_down 1536 h, q_norm 1536, q_up 128*192*1536, kv_down (512 + 64) h,
# kv_norm 512, kv_up 128*256*512, the projection h*128*128; two RMSNorm gains 2h. MLPs: dense
# 3 h 18432; MoE router 256 h, 256 experts and one shared of 3 h 2048. Tables 2 V h, final norm h.
_H = 7168
DS_ATTENTION = (1536 * _H + 1536 + 128 * 192 * 1536 + 576 * _H + 512 + 128 * 256 * 512
                + _H * 128 * 128)
DS_EXPERT = 3 * _H * 2048
DS_REST = 61 * (DS_ATTENTION + 2 * _H) + 3 * 3 * _H * 18432 + 2 * 129280 * _H + _H
DS_SELECTION_BIASES = 58 * 256   # one per routed expert of each MoE layer: not trained weights


def test_deepseek_v3_has_its_published_parameter_count():
    """DeepSeek-V3's 671 B without the MTP module: its checkpoint's tensors count
    671,026,419,200, of which 58 * 256 = 14,848 are the MoE routers' selection biases
    (`e_score_correction_bias`, a buffer in Hugging Face's model, ptdp's `expert_bias`: updated
    by a rule, not trained), which neither counts as a parameter. So the planner's count (the
    router as a bias-free h -> E linear) is 671,026,404,352, exactly Hugging Face's
    sum(p.numel() for p in model.parameters()); the published number adds the biases. Active:
    k = 8 routed experts a token, 37.55 B ("37B activated")."""
    shape = _deepseek_v3()
    assert (shape.mla_kv_lora, shape.mla_q_lora, shape.mla_rope_dim, shape.mla_v_dim) == (
        512, 1536, 64, 128)
    assert (shape.q_hidden, shape.kv_hidden, shape.heads * shape.v_head_dim) == (
        128 * 192, 128 * 192, 128 * 128)
    assert moe_layer_count(shape) == 58
    total = DS_REST + 58 * (256 * _H + 256 * DS_EXPERT + DS_EXPERT)
    assert decoder_parameters(shape) == parameter_total(shape) == total == 671_026_404_352
    assert decoder_parameters(shape) + DS_SELECTION_BIASES == 671_026_419_200
    active = DS_REST + 58 * (256 * _H + 8 * DS_EXPERT + DS_EXPERT)
    assert active_parameters(shape) == active == 37_552_282_624


def test_deepseek_v3_count_equals_hugging_faces_model():
    transformers = needs("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, tie_word_embeddings=False, n_group=8, topk_group=4)
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    biases = sum(b.numel() for name, b in model.named_buffers()
                 if name.endswith("e_score_correction_bias"))
    assert params == decoder_parameters(_deepseek_v3()) == 671_026_404_352
    assert (biases, params + biases) == (DS_SELECTION_BIASES, 671_026_419_200)


# --------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------

def _flops_by_hand(shape: ModelShape, batch: int, vocab: int, passes: int) -> float:
    """The layers' GEMMs (2 FLOPs a multiply-add), scores and products with V, written out."""
    T, s, h, a = batch * shape.seq, shape.seq, shape.hidden, shape.heads
    n, r, v = shape.head_dim, shape.mla_rope_dim, shape.mla_v_dim
    lq, lkv, g = shape.mla_q_lora, shape.mla_kv_lora, shape.gated
    queries = 2 * T * (h * lq + lq * a * (n + r)) if lq else 2 * T * h * a * (n + r)
    keys_values = 2 * T * h * (lkv + r) + 2 * T * lkv * a * (n + v)
    projection = 2 * T * a * v * h
    scores = 2 * batch * s * s * a * (n + r) + 2 * batch * s * s * a * v
    attention = queries + keys_values + projection + scores
    dense = 2 * T * h * (1 + g) * shape.ffn + 2 * T * shape.ffn * h
    mlp = 0
    for layer in range(shape.layers):
        if shape.experts and layer >= shape.dense_first:
            mlp += (2 * T * h * shape.experts
                    + shape.top_k * 2 * T * h * (2 + g) * shape.moe_ffn
                    + 2 * T * h * (2 + g) * shape.shared_ffn)
        else:
            mlp += dense
    return passes * (shape.layers * attention + mlp) + 6 * T * h * vocab


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("shape", [
    _deepseek_v3(), _deepseek_v3(mla_q_lora=0), _deepseek_v3(experts=0),
    ModelShape("gpt", 4, 256, 8, 1024, 512, 1000, False, mla_kv_lora=64, mla_q_lora=96,
               mla_rope_dim=16, mla_v_dim=24, head_dim=40),
], ids=["deepseek-v3", "no-query-latent", "dense", "gpt-block"])
def test_iteration_flops_equal_the_sum_by_hand(shape, recompute):
    by_hand = _flops_by_hand(shape, 8, shape.vocab, 4 if recompute else 3)
    assert iteration_flops(shape, 8, recompute_forward=recompute) == pytest.approx(by_hand,
                                                                                    rel=1e-12)


def test_a_sliding_window_saves_the_scores_and_v_products_of_its_keys():
    shape = _deepseek_v3(experts=0, layers=4)
    local = dataclasses.replace(shape, window=1024, local_layers=2)
    a, s = shape.heads, shape.seq
    saved = 4 * 2 * (2 * 2 * s * (s - 1024) * a * (192 + 128))   # 4 passes, 2 local layers, b 2
    assert iteration_flops(shape, 2) - iteration_flops(local, 2) == pytest.approx(saved, rel=1e-12)


@pytest.mark.parametrize("q_lora", [16, 0])
def test_flop_formula_equals_the_counted_matmuls(q_lora):
    """A forward and backward of the tiny model under torch's FLOP counter (the CPU runs SDPA's
    math path for unequal query/key and value head sizes, whose matmuls it counts)."""
    cfg = _config("llama", f"model.mla_q_lora_rank={q_lora}")
    chunk = build_chunk(_context(cfg.model), 0, 1)
    data = synthetic_datasets(cfg.model, 3)["train"]
    batch = torch.utils.data.default_collate([data[i] for i in range(B)])
    with FlopCounterMode(display=False) as counter:
        loss = chunk(None, batch)
        (loss[0] if isinstance(loss, tuple) else loss).backward()
    shape = ModelShape.from_config(cfg.model)
    assert counter.get_total_flops() == iteration_flops(shape, B, cfg.padded_vocab_size,
                                                        recompute_forward=False)


def test_the_analytic_layer_times_the_gemms_the_flops_count(ideal):
    """Latent attention's GEMMs at t = 1 are the FLOP formula's, less the scores; split GEMMs
    narrow with t, the down-projections do not; attention runs on n + r and v wide heads."""
    shape = _deepseek_v3(experts=0)
    tokens = 4096.0
    gemm_flops = sum(2 * m * n * k for m, n, k in attention_gemms(shape, tokens, 1))
    scores = 2 * 4096 ** 2 * 128 * (192 + 128)
    assert gemm_flops + scores == attention_forward_flops(shape, 1)
    eight = attention_gemms(shape, tokens, 8)
    assert [g[1] for g in eight] == [1536, 128 * 192 / 8, 576, 128 * 256 / 8, 7168]
    assert [g[2] for g in eight] == [7168, 1536, 7168, 512, 128 * 128 / 8]
    # flash: 2 s^2 (d_qk + d_v) a FLOPs forward (causal: half)
    fwd, _ = _attention_times(ideal, "bf16", shape, 1, 8, "flash")
    eff = ideal.efficiency
    sat = (4096 / (4096 + eff.gemm_half_dim)) * (192 / (192 + eff.gemm_half_dim))
    flops = 2.0 * 4096 ** 2 * (192 + 128) * 128 / 8 * 0.5
    assert fwd == pytest.approx(flops / (ideal.peak_flops("bf16") * eff.gemm_max * eff.attention
                                         * sat))
    plain = dataclasses.replace(shape, mla_kv_lora=0, mla_q_lora=0, mla_rope_dim=0, mla_v_dim=0)
    assert layer_times(ideal, "bf16", shape, 1, 8, "flash") != layer_times(ideal, "bf16", plain,
                                                                          1, 8, "flash")


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------

CPU = load_hardware("cpu-local")


def _kept(block, *overrides, recompute="none", modules=None):
    """(bytes one layer saves for backward, its shape) in fp32, b = B."""
    cfg = _config(block, "model.num_layers=1", *overrides)
    stack = TransformerStack(_context(cfg.model, recompute=recompute, modules=modules), 0, 1,
                             causal=True).train()
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    _, nbytes = saved_bytes(lambda: stack(x), param_storages(stack))
    return nbytes, ModelShape.from_config(cfg.model)


RECOMPUTES = [("none", None), ("selective", ("core_attn",)), ("selective", ("layernorm",)),
              ("selective", ("activation",)), ("selective", ("mlp",)),
              ("selective", ("core_attn", "layernorm"))]


@pytest.mark.parametrize("recompute, modules", RECOMPUTES)
@pytest.mark.parametrize("heads", [
    ["model.mla_q_lora_rank=16"], ["model.mla_q_lora_rank=0"],
    ["model.mla_v_head_dim=12"], ["model.mla_v_head_dim=12", "model.mla_q_lora_rank=0"]],
    ids=["v6", "v6-no-query-latent", "v12", "v12-no-query-latent"])
def test_the_activation_count_is_not_below_what_a_layer_keeps(heads, recompute, modules):
    """LayerNorm and GeLU, whose eager kernels keep what fused ones do. With value heads of 6
    (query/key heads of 12) the CPU's SDPA runs its math path, which keeps the probabilities
    (compute.layer_kernel: counted as materialized); with 12 its fused kernel."""
    kept, shape = _kept("layernorm", *heads, recompute=recompute, modules=modules)
    unequal = shape.qk_head_dim != shape.v_head_dim
    assert layer_kernel(CPU, shape, "flash") == ("materialized" if unequal else "flash")
    planned = layer_activation_bytes(shape, B, 1, "fp32", recompute, "flash", hw=CPU,
                                     modules=modules)
    assert kept <= planned <= 1.2 * kept


@pytest.mark.parametrize("q_lora", [16, 0])
def test_eager_rmsnorm_and_swiglu_keep_only_their_documented_extras(q_lora):
    """Llama-style: eager kernels also keep each RMSNorm's normalised output (the block's two,
    of h, and the latent ones, of L_q and L_kv) and SiLU(gate), which the count leaves to
    fused kernels (memory.py); with those the count is not below what the layer keeps."""
    kept, shape = _kept("llama", f"model.mla_q_lora_rank={q_lora}")
    planned = layer_activation_bytes(shape, B, 1, "fp32", "none", "flash", hw=CPU)
    eager = S * B * (2 * H + q_lora + 12 + shape.ffn) * 4
    assert planned < kept <= planned + eager


def test_the_latent_terms_follow_the_derivation():
    """bf16, t = 2, flash (a GPU: hw=None), per token: the replicated latents' norm inputs
    L_q + L_kv + r and up-projection inputs L_q + L_kv; Q and K a(n+r)/t each, kv_up's output
    a(n+v)/t, the projection input a v/t and flash's output a v/t; norm statistics (4 norms, 8
    bytes each) and the rotary tables (8 r bytes); with sequence parallelism the norms' share
    is 1/t."""
    shape = _deepseek_v3(experts=0)
    plain = dataclasses.replace(shape, mla_kv_lora=0, mla_q_lora=0, mla_rope_dim=0, mla_v_dim=0,
                                head_dim=56)   # no attention split activations: a d = 56 block
    a, n, r, v, lq, lkv, f, h = 128, 128, 64, 128, 1536, 512, 18432, 7168
    tokens = 4096

    def per_token(s, sp=False):
        return layer_activation_bytes(s, 1, 2, "bf16", "none", "flash",
                                      sequence_parallel=sp) / tokens
    block = 4 * h * 2 + 3 * f / 2 * 2 + a / 2 * 4          # norms', QKV, fc1 inputs; MLP; lse
    latents = (lq + lkv + r + lq + lkv) * 2 + 4 * 8 + 8 * r
    split = (2 * a * (n + r) + a * (n + v) + a * v + a * v) / 2 * 2
    assert per_token(shape) == pytest.approx(block + latents + split)
    sp_block = 2 * h * 2 / 2 + 2 * h * 2 + 3 * f / 2 * 2 + a / 2 * 4
    sp_latents = (lq + lkv + r) * 2 / 2 + (lq + lkv) * 2 + 4 * 8 / 2 + 8 * r
    assert per_token(shape, sp=True) == pytest.approx(sp_block + sp_latents + split)
    assert per_token(plain) < per_token(shape)


def _pending(block, q_lora):
    cfg = _config(block, "model.num_layers=1", f"model.mla_q_lora_rank={q_lora}")
    layer = TransformerLayer(_context(cfg.model), 0, causal=True)
    queue = defer_weight_grads(layer)
    x = torch.randn(S, B, H, requires_grad=True)
    with queue.defer("mb"):
        layer(x).backward(torch.randn_like(x))
    params, storages, seen = param_storages(layer), {}, set()
    for _, compute in queue._pending["mb"]:
        for t in _tensors_in(compute, seen):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values()), ModelShape.from_config(cfg.model)


@pytest.mark.parametrize("q_lora", [16, 0])
def test_pending_weight_gradients_hold_what_the_model_counts(q_lora):
    """ZB-H1: between B and W every deferred weight gradient holds its input and output
    gradient: with LayerNorm exactly the count plus the norms' fp32 mean and rstd (as
    test_memory_terms' GPT layer); RMSNorm's gains hold their normalised input (L_kv, not
    kv_down's whole L_kv + r output), so there the count is above."""
    held, shape = _pending("layernorm", q_lora)
    norms = 3 + (1 if q_lora else 0)
    assert held == pending_weight_grad_bytes(shape, B, 1, "fp32") + norms * 2 * S * B * 4
    held, shape = _pending("llama", q_lora)
    assert 0 <= pending_weight_grad_bytes(shape, B, 1, "fp32") - held == S * B * 4 * 4


# --------------------------------------------------------------------------------------------
# Profiles and search
# --------------------------------------------------------------------------------------------

def test_a_measured_row_of_another_block_does_not_time_a_latent_layer(a100):
    """Profile rows carry the block key, latent attention's sizes in it (rows without them
    were measured without latent attention)."""
    shape = _deepseek_v3(experts=0)
    plain = dataclasses.replace(shape, mla_kv_lora=0, mla_q_lora=0, mla_rope_dim=0, mla_v_dim=0)
    row = dict(hidden=7168, heads=128, ffn=18432, seq=4096, tensor=8, precision="bf16",
               micro_batch=1, forward_s=1.0, backward_s=2.0, **plain.block_key())
    del row["mla_kv_lora"], row["mla_q_lora"], row["mla_rope_dim"], row["mla_v_dim"]
    assert same_block(row, plain) and not same_block(row, shape)
    assert same_block({**row, **shape.block_key()}, shape)
    hw = dataclasses.replace(a100, measured={"layers": [row]})
    assert layer_times(hw, "bf16", plain, 1, 8, "flash").forward == 1.0
    assert layer_times(hw, "bf16", shape, 1, 8, "flash").forward != 1.0


def test_search_takes_context_parallelism_with_value_heads_no_larger(a100):
    """As the trainer (ptdp/config/latent.py): the ring pads the value heads up to the
    query/key heads' size, so larger value heads are refused with c > 1."""
    shape = ModelShape("gpt", 4, 256, 8, 1024, 512, 1000, False, position_embedding="rope",
                       mla_kv_lora=64, mla_q_lora=96, mla_rope_dim=16, mla_v_dim=24, head_dim=40)
    assert search(a100, Workload(shape, 16, "bf16", 8), 4, fixed={"context": 2}).ranked
    wide = dataclasses.replace(shape, mla_v_dim=64)   # > 40 + 16
    result = search(a100, Workload(wide, 16, "bf16", 8), 4, fixed={"context": 2})
    assert not result.ranked
    assert "pads value heads" in result.rejected.examples["indivisible"]
    assert search(a100, Workload(wide, 16, "bf16", 8), 4).ranked
