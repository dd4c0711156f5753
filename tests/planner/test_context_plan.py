"""The planner and context parallelism: memory per rank, the ring's bytes and time, the search
(c only when pinned), `ptdp check`'s summary."""

import pytest

from ptdp.job_summary import summary
from ptdp.config import ModelConfig, load_config
from ptdp.hardware import load_hardware
from ptdp.planner.compute import ModelShape
from ptdp.planner.cost_model import Layout, Workload, predict
from ptdp.planner.errors import PlanError
from ptdp.planner.formulas import ring_block_bytes, ring_blocks_per_layer
from ptdp.planner.memory import gpu_memory, ring_working_bytes
from ptdp.planner.search import parse_fix, search

LLAMA = ModelConfig(arch="gpt", preset="llama", num_layers=32, hidden_size=4096, num_heads=32,
                    num_kv_heads=8, ffn_hidden_size=14336, seq_length=32768, vocab_size=128256)
KWARGS = dict(p=1, t=1, v=1, m=4, b=1, schedule="1f1b", recompute="none", precision="bf16",
              attention="flash", vocab_padded=128256, reserved_gb=0.0, rank=0, d=1)


def test_activations_fall_by_c_and_the_state_stays():
    shape = ModelShape.from_config(LLAMA)
    one, two, four = (gpu_memory(shape, c=c, **KWARGS) for c in (1, 2, 4))
    assert two.activations == pytest.approx(one.activations / 2)
    assert four.activations == pytest.approx(one.activations / 4)
    assert (four.weights, four.gradients, four.optimizer) == (one.weights, one.gradients,
                                                              one.optimizer)
    assert four.total < two.total < one.total
    sharded = gpu_memory(shape, c=4, distributed_optimizer=True, **KWARGS)
    assert sharded.optimizer == pytest.approx(one.optimizer / 4)   # over the d*c replicas


def test_the_rings_bytes():
    shape = ModelShape.from_config(LLAMA)
    # 2 * b * (s/c) * h_kv / t elements: K and V of 8 K/V heads of 128 for 8192 tokens
    assert ring_block_bytes(shape, 1, 1, 4, 2) == 2 * 8192 * 1024 * 2
    assert ring_blocks_per_layer(1) == (0, 0, 0)
    assert ring_blocks_per_layer(4) == (3, 3, 4)
    assert ring_blocks_per_layer(4, "selective") == (3, 6, 4)
    assert ring_working_bytes(shape, 1, 1, 1, "bf16") == 0.0
    assert ring_working_bytes(shape, 1, 2, 4, "bf16") > 0.0


def test_the_ring_is_timed_and_gradients_reduce_over_d_times_c():
    hw = load_hardware("h100-80gb")
    work = Workload(ModelShape.from_config(LLAMA), 16, "bf16", 8)
    plain = predict(hw, work, Layout(pipeline=2, tensor=4, data=2, micro_batch=1))
    ring = predict(hw, work, Layout(pipeline=2, tensor=2, data=2, micro_batch=1, context=2))
    assert plain.time["context_ring"] == 0.0 and ring.time["context_ring"] > 0.0
    assert ring.layout.gpus == plain.layout.gpus == 16
    # c splits every activation; t leaves the norms' and GEMM inputs whole (without SP)
    assert ring.memory["activations"] < plain.memory["activations"]


def test_search_keeps_c_1_unless_pinned():
    hw = load_hardware("h100-80gb")
    work = Workload(ModelShape.from_config(LLAMA), 16, "bf16", 8)
    free = search(hw, work, 16, parse_fix("p=2,b=1"))
    assert {p.layout.context for p in free.ranked} == {1}
    pinned = search(hw, work, 16, parse_fix("p=2,b=1,c=4"))
    assert pinned.ranked and {p.layout.context for p in pinned.ranked} == {4}
    assert all(p.layout.gpus == 16 for p in pinned.ranked)
    with pytest.raises(PlanError, match="c=3: 3 does not divide the 16 GPUs"):
        search(hw, work, 16, parse_fix("c=3"))
    bert = Workload(ModelShape.from_config(ModelConfig(arch="bert", seq_length=512)), 16,
                    "bf16", 8)
    rejected = search(hw, bert, 16, parse_fix("c=2"))
    assert not rejected.ranked
    assert "gpt only" in rejected.rejected.examples["indivisible"]


def test_ptdp_check_summary_names_c_and_the_local_sequence():
    cfg = load_config(None, ["parallel.context=2", "parallel.tensor=2", "model.seq_length=64",
                             "model.num_layers=2"], world_size=8)
    lines = summary(cfg, 8)
    assert "layout: (p, t, c, d) = (1, 2, 2, 2), each rank 32 of 64 tokens per sequence" in lines[1]
