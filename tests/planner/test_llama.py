"""The planner on Llama-style blocks (grouped-query attention, SwiGLU, RMSNorm, rotary positions,
no biases, an untied output layer): memory terms, communication, measured profiles, and
`ptdp plan` on the shipped Llama-3 configs."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from ptdp.config import load_config
from ptdp.planner.compute import ModelShape, layer_times
from ptdp.planner.cost_model import Layout, Workload, predict
from ptdp.planner.formulas import decoder_parameters
from ptdp.planner.memory import (embedding_parameters, layer_activation_bytes,
                                 pending_weight_grad_bytes, stage_parameters)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LLAMA = ModelShape("gpt", 4, 4096, 32, 14336, 8192, 128256, False, kv_heads=8,
                   activation="swiglu", normalization="rmsnorm", position_embedding="rope",
                   bias=False, tie_embeddings=False)


def test_layer_activations_follow_the_derivation():
    # Split by t per token: Q, K, V h + 2h_kv, projection input h, SwiGLU's gate and up 2f
    # and their product f, the rotated Q and K h + h_kv; whole: the norms', QKV and fc1
    # inputs 4h; flash attention's output h/t and fp32 logsumexp (a/t per token).
    s, b, h, kv, f, a = 8192, 1, 4096, 1024, 14336, 32
    for t in (1, 2, 8):
        split = (h + 2 * kv) + h + 3 * f + (h + kv)
        expected = s * b * (4 * h * 2 + split / t * 2 + h / t * 2 + a / t * 4)
        assert layer_activation_bytes(LLAMA, b, t, "bf16", "none", "flash") == \
            pytest.approx(expected, rel=1e-12)
    mha = dataclasses.replace(LLAMA, kv_heads=32)
    gelu = dataclasses.replace(LLAMA, activation="gelu")
    learned = dataclasses.replace(LLAMA, position_embedding="learned")

    def bytes_of(shape):
        return layer_activation_bytes(shape, b, 2, "bf16", "none", "flash")

    # at t = 2 in bf16: 3 (h - h_kv) for Q, K, V and the rotated Q, K; f for SwiGLU's up
    assert bytes_of(mha) - bytes_of(LLAMA) == pytest.approx(s * b * 3 * (h - kv) / 2 * 2)
    assert bytes_of(LLAMA) - bytes_of(gelu) == pytest.approx(s * b * f / 2 * 2)
    assert bytes_of(LLAMA) - bytes_of(learned) == pytest.approx(s * b * (h + kv) / 2 * 2)
    # ZB-H1's pending closures: QKV's output gradient narrows with the K/V heads.
    pending = [pending_weight_grad_bytes(shape, b, 2, "bf16") for shape in (mha, LLAMA)]
    assert pending[0] - pending[1] == pytest.approx(s * b * 2 * (h - kv) / 2 * 2)
    # QK-norm keeps the normalised Q and K (h + h_kv); a head size of 256 (h_q = 2h, h_kv =
    # 2kv) widens Q, K, V, the projection input, the rotated Q and K and flash's output.
    qk = dataclasses.replace(LLAMA, qk_norm=True)
    assert bytes_of(qk) - bytes_of(LLAMA) == pytest.approx(s * b * (h + kv) / 2 * 2)
    wide = dataclasses.replace(LLAMA, head_dim=256)
    assert bytes_of(wide) - bytes_of(LLAMA) == pytest.approx(
        s * b * ((h + 2 * kv) + h + (h + kv) + h) / 2 * 2)


def test_stage_parameters_add_up_to_the_model():
    # Untied output layer: on the last stage, even when it is also the first; no positions.
    V, h = 128256, 4096
    assert embedding_parameters(LLAMA, 1, V) == V * h
    for t in (1, 2, 8):
        whole = stage_parameters(LLAMA, t, 1, V, True, True)
        first = stage_parameters(LLAMA, t, 2, V, True, False)
        last = stage_parameters(LLAMA, t, 2, V, False, True)
        assert first + last == pytest.approx(whole)
        if t == 1:
            assert whole == decoder_parameters(LLAMA)
    tied = dataclasses.replace(LLAMA, tie_embeddings=True)
    assert stage_parameters(LLAMA, 1, 1, V, True, True) - stage_parameters(
        tied, 1, 1, V, True, True) == V * h


def test_an_untied_output_layer_needs_no_embedding_sync(a100):
    layout = Layout(pipeline=4, tensor=8, data=1, micro_batch=1)
    untied = predict(a100, Workload(LLAMA, 64, "bf16", 8), layout)
    tied = predict(a100, Workload(dataclasses.replace(LLAMA, tie_embeddings=True), 64, "bf16", 8),
                   layout)
    assert untied.time["embedding_sync"] == 0.0 < tied.time["embedding_sync"]


def test_gqa_and_swiglu_change_the_layer_gemms(a100):
    # Fewer K/V heads: a narrower QKV GEMM, so a faster layer; SwiGLU: a wider fc1.
    mha = dataclasses.replace(LLAMA, kv_heads=32)
    fast, slow = (layer_times(a100, "bf16", s, 1, 8, "flash") for s in (LLAMA, mha))
    assert fast.forward < slow.forward and fast.backward < slow.backward
    gelu = dataclasses.replace(LLAMA, activation="gelu")
    assert layer_times(a100, "bf16", gelu, 1, 8, "flash").forward < fast.forward


def test_a_gpt_profile_row_does_not_time_a_llama_layer(a100):
    gpt = ModelShape("gpt", 4, 4096, 32, 14336, 8192, 128256, False)
    row = dict(hidden=4096, heads=32, ffn=14336, seq=8192, tensor=8, precision="bf16",
               micro_batch=1, forward_s=1.0, backward_s=2.0, activation_bytes_none=123.0)
    hw = dataclasses.replace(a100, measured={"layers": [row]})
    assert layer_times(hw, "bf16", gpt, 1, 8, "flash").forward == 1.0
    assert layer_times(hw, "bf16", LLAMA, 1, 8, "flash").forward != 1.0
    assert layer_activation_bytes(hw=hw, shape=gpt, b=1, t=8, precision="bf16",
                                  recompute="none", attention="flash") == 123.0
    assert layer_activation_bytes(hw=hw, shape=LLAMA, b=1, t=8, precision="bf16",
                                  recompute="none", attention="flash") != 123.0
    llama_row = {**row, **LLAMA.block_key(), "forward_s": 5.0}
    hw = dataclasses.replace(a100, measured={"layers": [row, llama_row]})
    assert layer_times(hw, "bf16", LLAMA, 1, 8, "flash").forward == 5.0


def test_plan_llama3_8b_memory_shrinks_with_grouped_query_attention(plan_json, tmp_path):
    fix = ["--fix", "p=2,t=2,d=2,b=1,schedule=1f1b,recompute=none,sp=false"]
    gqa = plan_json(CONFIGS / "llama3_8b.yaml", "--nodes", "1", *fix)
    assert gqa["model"]["parameters"] == 8_030_261_248
    raw = yaml.safe_load((CONFIGS / "llama3_8b.yaml").read_text())
    raw["model"]["num_kv_heads"] = 32
    mha_file = tmp_path / "mha.yaml"
    mha_file.write_text(yaml.safe_dump(raw))
    mha = plan_json(mha_file, "--nodes", "1", *fix)
    assert mha["model"]["parameters"] == 8_030_261_248 + 32 * 2 * 4096 * (4096 - 1024)
    small, big = gqa["predicted"]["memory_breakdown_gb"], mha["predicted"]["memory_breakdown_gb"]
    for kind in ("weights", "gradients", "optimizer", "activations", "total"):
        assert small[kind] < big[kind], kind
    assert gqa["predicted"]["step_time_s"] < mha["predicted"]["step_time_s"]


@pytest.mark.parametrize("name, nodes", [("llama3_8b", 1), ("llama3_8b", 8), ("llama3_70b", 8)])
def test_the_llama_configs_hold_the_planned_layout(plan_json, name, nodes):
    """docs/planner.md's table: each config's layout is what `ptdp plan` predicts fastest."""
    result = plan_json(CONFIGS / f"{name}.yaml", "--nodes", str(nodes), "--top", "1")
    cfg = load_config(CONFIGS / f"{name}.yaml", world_size=8 * nodes)
    par = result["parallel"]
    assert (par["pipeline"], par["tensor"], par["data"], par["chunks"]) == (
        cfg.parallel.pipeline, cfg.parallel.tensor, cfg.parallel.data, cfg.parallel.chunks)
    assert par["sequence_parallel"] == cfg.parallel.sequence_parallel
    assert result["schedule"] == cfg.schedule.name
    assert result["micro_batch_size"] == cfg.train.micro_batch_size
    assert result["recompute"] == cfg.train.recompute
    assert result["global_batch_size"] == cfg.train.global_batch_size == 512
