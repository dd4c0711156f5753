"""The planner's mixture-of-experts formulas: parameter counts against the published totals
(Mixtral-8x7B and Qwen3-30B-A3B exactly), active FLOPs,
layer placement, memory with E/e experts per rank, the all-to-all in the cost model."""

import dataclasses
from pathlib import Path

import pytest

from ptdp.config import ModelConfig, load_config
from ptdp.planner import comm
from ptdp.planner.compute import ModelShape
from ptdp.planner.cost_model import Layout, Workload, predict
from ptdp.planner.formulas import active_parameters, decoder_parameters, iteration_flops
from ptdp.planner.memory import gpu_memory
from ptdp.planner.moe import (all_to_all_bytes, expert_placement, kept_share,
                              moe_activation_bytes, moe_layer_count, moe_mlp_parameters,
                              rank_moe_layers)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def mixtral(**changes) -> ModelShape:
    """Mixtral-8x7B: h=4096, 32 layers, 32 heads, 8 K/V heads, SwiGLU f=14336, E=8, k=2,
    V=32000, untied, RMSNorm, no biases."""
    shape = ModelShape("gpt", 32, 4096, 32, 14336, 4096, 32000, False, kv_heads=8,
                       activation="swiglu", normalization="rmsnorm", position_embedding="rope",
                       bias=False, tie_embeddings=False, experts=8, top_k=2, moe_ffn=14336)
    return dataclasses.replace(shape, **changes)


def test_mixtral_matches_the_published_counts_exactly():
    """By hand, per layer: attention 4096*(4096 + 2*1024) + 4096^2 = 41,943,040, two RMSNorm
    gains 8,192, router 8*4096 = 32,768, experts 8 * 3*4096*14336 = 1,409,286,144; plus the
    word table and the untied output layer 2*32000*4096 and the final norm 4096. Mixtral has
    no biases and RMSNorm's single gain, which ptdp counts the same way, so the counts are
    exact: 46,702,792,704 (Mistral: 46.7 B) and, with 2 experts a token, 12,879,925,248
    (12.9 B)."""
    attention, norms, router = 4096 * (4096 + 2 * 1024) + 4096 ** 2, 2 * 4096, 8 * 4096
    expert = 3 * 4096 * 14336
    tables = 2 * 32000 * 4096 + 4096
    assert decoder_parameters(mixtral()) == 32 * (attention + norms + router + 8 * expert) + tables
    assert active_parameters(mixtral()) == 32 * (attention + norms + router + 2 * expert) + tables
    assert decoder_parameters(mixtral()) == 46_702_792_704
    assert active_parameters(mixtral()) == 12_879_925_248
    assert round(decoder_parameters(mixtral()) / 1e9, 1) == 46.7
    assert round(active_parameters(mixtral()) / 1e9, 1) == 12.9


def test_the_mixtral_config_has_mixtrals_counts():
    cfg = load_config(CONFIGS / "mixtral_8x7b.yaml", world_size=64)
    shape = ModelShape.from_config(cfg.model)
    assert shape == mixtral()
    assert (cfg.parallel.pipeline, cfg.parallel.tensor, cfg.parallel.data,
            cfg.parallel.expert) == (2, 1, 32, 8)


def test_the_qwen3_30b_a3b_config_has_qwen3s_counts():
    """Qwen3-30B-A3B: 48 layers, h=2048, 32 heads of head_dim 128 (queries 4096 wide), 4 K/V
    heads, QK-norm, E=128 experts of f=768, k=8, V=151936, untied. Published: 30.5 B total,
    3.3 B active; by hand 30,532,122,624 and 3,353,032,704."""
    cfg = load_config(CONFIGS / "qwen3_30b_a3b.yaml", world_size=64)
    shape = ModelShape.from_config(cfg.model)
    assert (shape.q_hidden, shape.kv_hidden, shape.qk_norm) == (4096, 512, True)
    assert decoder_parameters(shape) == 30_532_122_624
    assert active_parameters(shape) == 3_353_032_704
    assert round(decoder_parameters(shape) / 1e9, 1) == 30.5
    assert 3.3e9 <= active_parameters(shape) < 3.4e9   # Qwen's "3.3 B" truncates


def test_active_flops_are_a_dense_model_with_k_experts_plus_the_router():
    """Without a shared expert an MoE layer's MLP costs what a dense MLP of width k*f_moe
    does, plus the router's 2*T*h*E; every layer is MoE here."""
    moe = mixtral()
    dense = dataclasses.replace(moe, experts=0, ffn=2 * 14336)
    for recompute in (True, False):
        router = (4 if recompute else 3) * 32 * 2.0 * 8 * 4096 * 4096 * 8
        assert iteration_flops(moe, 8, recompute_forward=recompute) == pytest.approx(
            iteration_flops(dense, 8, recompute_forward=recompute) + router, rel=1e-12)


def test_shared_expert_and_dense_first_layers():
    """DeepSeek-style: 3 dense layers of f=18432, then MoE layers with a shared expert."""
    shape = dataclasses.replace(mixtral(), layers=8, ffn=18432, experts=16, top_k=4,
                                moe_ffn=1024, shared_ffn=1024, dense_first=3)
    assert moe_layer_count(shape) == 5
    mlp = moe_mlp_parameters(shape)
    assert mlp.routed_split == 16 * 3 * 4096 * 1024
    assert mlp.other_split + mlp.other_replicated == 3 * 4096 * 1024 + 16 * 4096
    dense_mlp = 3 * 4096 * 18432
    all_dense = dataclasses.replace(shape, experts=0)
    assert decoder_parameters(shape) == decoder_parameters(all_dense) + 5 * (mlp.total - dense_mlp)
    assert active_parameters(shape) == (decoder_parameters(all_dense)
                                        + 5 * (4 * 3 * 4096 * 1024 + 3 * 4096 * 1024
                                               + 16 * 4096 - dense_mlp))


def test_which_layers_are_moe_and_where_they_sit():
    shape = dataclasses.replace(mixtral(), layers=8, dense_first=3, moe_freq=2)
    assert moe_layer_count(shape) == 3                   # layers 3, 5, 7
    assert rank_moe_layers(shape, 2) == [1, 2]           # layers 0-3 | 4-7
    assert rank_moe_layers(shape, 2, 2) == [1, 2]        # chunks 0-1, 4-5 | 2-3, 6-7
    assert rank_moe_layers(shape, 4) == [0, 1, 1, 1]
    assert expert_placement(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]


KWARGS = dict(p=1, t=1, v=1, m=1, b=1, schedule="1f1b", recompute="none", precision="bf16",
              attention="flash", vocab_padded=32000, reserved_gb=0.0, rank=0, d=8)


def test_each_expert_rank_holds_e_times_fewer_experts():
    shape = mixtral()
    experts = 32 * moe_mlp_parameters(shape).routed_split    # bf16 weights: 2 bytes each
    one, two, eight = (gpu_memory(shape, expert=e, **KWARGS) for e in (1, 2, 8))
    assert one.weights - two.weights == pytest.approx(experts / 2 * 2)
    assert one.weights - eight.weights == pytest.approx(experts * 7 / 8 * 2)
    assert eight.activations == one.activations          # balanced: k*T tokens either way
    # the distributed optimizer shards the experts' state over the d/e ranks that hold them
    sharded = gpu_memory(shape, expert=8, distributed_optimizer=True, **KWARGS)
    rest = decoder_parameters(shape) - experts
    assert sharded.optimizer == pytest.approx(rest * 12 / 8 + experts / 8 * 12 / 1)


def test_moe_activations_count_the_dispatched_tokens():
    """A token's k expert inputs and outputs (h each) and fc1/fc2 activations replace the
    dense MLP's; here k*f_moe = f, so only 2*k*h elements per token and the router's fp32
    scores and probabilities remain."""
    moe = dataclasses.replace(mixtral(), layers=1, ffn=2 * 14336)
    dense = dataclasses.replace(moe, experts=0)
    one = dict(KWARGS, d=1)
    extra = (gpu_memory(moe, **one).activations - gpu_memory(dense, **one).activations)
    assert extra == pytest.approx(4096 * (2 * 2 * 4096 * 2 + 2 * 8 * 4))


def test_all_to_all_time_grows_with_e_and_leaves_the_node(a100):
    work = Workload(mixtral(), 64, "bf16", 8)
    def a2a(**layout):
        return predict(a100, work, Layout(**layout)).time["expert_all_to_all"]
    assert a2a(pipeline=4, data=16, expert=1) == 0.0
    inside, across = a2a(pipeline=4, data=16, expert=8), a2a(pipeline=4, data=16, expert=16)
    assert 0 < inside < across
    assert comm.expert_link(a100, 1, 8, 8).intra_node
    assert not comm.expert_link(a100, 2, 8, 8).intra_node   # t*e = 16 ranks: two nodes
    # forward 2, backward 2, + 2 for a full recompute, per MoE layer and micro-batch
    full = a2a(pipeline=4, data=16, expert=8, recompute="full")
    assert full == pytest.approx(inside * 6 / 4)


def test_token_dropping_runs_the_kept_share_of_the_choices(a100):
    """With a capacity factor c < 1 (model.moe_capacity_factor) the experts run c of the k*T
    choices under balanced routing: the all-to-all carries c of the bytes, the experts keep c
    of their inputs, fc1 and activation outputs (tests/planner/test_memory_terms.py measures
    it) and take c of their GEMM time; c >= 1 drops nothing. The FLOPs stay the model's
    (Megatron's count ignores dropping)."""
    dropless, half = mixtral(), mixtral(capacity_factor=0.5)
    assert kept_share(dropless) == kept_share(mixtral(capacity_factor=1.25)) == 1.0
    assert all_to_all_bytes(half, 1000, 2) == all_to_all_bytes(dropless, 1000, 2) / 2
    assert moe_activation_bytes(mixtral(capacity_factor=1.25), 1000, 2, 2) == \
        moe_activation_bytes(dropless, 1000, 2, 2)
    routed = 2 * 1000 * (4096 + 3 * 14336 / 2) * 2 / 2   # half of k*T*(h + (2+g)f/t) bytes
    assert moe_activation_bytes(half, 1000, 2, 2) == \
        pytest.approx(moe_activation_bytes(dropless, 1000, 2, 2) - routed)
    work = lambda shape: Workload(shape, 64, "bf16", 8)   # noqa: E731
    lay = Layout(pipeline=4, data=16, expert=8)
    full, dropped = predict(a100, work(dropless), lay), predict(a100, work(half), lay)
    none = predict(a100, work(mixtral(capacity_factor=1e-12)), lay)   # its latencies only
    a2a = [pred.time["expert_all_to_all"] for pred in (none, dropped, full)]
    assert a2a[2] - a2a[1] == pytest.approx(a2a[1] - a2a[0]) and a2a[1] > a2a[0]   # half the bytes
    assert dropped.step_time_s < full.step_time_s
    assert dropped.memory["activations"] < full.memory["activations"]
    assert iteration_flops(half, 64, 4096) == iteration_flops(dropless, 64, 4096)
    cfg = ModelConfig(arch="gpt", preset="llama", num_layers=2, hidden_size=64, num_heads=4,
                      num_experts=4, moe_ffn_hidden_size=32, moe_capacity_factor=0.75)
    assert ModelShape.from_config(cfg).capacity_factor == 0.75
    assert ModelShape.from_config(dataclasses.replace(cfg, moe_capacity_factor=None)) \
        .capacity_factor == 0.0


def test_dense_models_have_no_expert_terms(a100):
    shape = ModelShape.from_config(ModelConfig(arch="gpt", preset="llama", num_layers=4,
                                               hidden_size=512, num_heads=8,
                                               moe_top_k=4, moe_ffn_hidden_size=64))
    assert shape.experts == 0 and shape.moe_ffn == 0 and shape.top_k == 2
    pred = predict(a100, Workload(shape, 16, "bf16", 8), Layout(data=8))
    assert "expert_all_to_all" not in pred.time


def test_the_trainers_tflops_count_active_experts_only():
    """ptdp/metrics/throughput.py reports TFLOP/s (and MFU) on the planner's active FLOPs: an
    iteration of the tiny MoE config at 1 s on 1 rank is its iteration_flops, fewer than the
    same model with every expert active."""
    from ptdp.metrics.throughput import iteration_tflops
    cfg = load_config(CONFIGS / "moe_tiny.yaml", world_size=8)
    shape = ModelShape.from_config(cfg.model)
    flops = iteration_flops(shape, cfg.train.global_batch_size, cfg.padded_vocab_size,
                            recompute_forward=False)
    assert iteration_tflops(cfg, 1.0, 1) == flops / 1e12
    every = dataclasses.replace(shape, top_k=shape.experts)
    assert flops < iteration_flops(every, cfg.train.global_batch_size, cfg.padded_vocab_size,
                                   recompute_forward=False)
