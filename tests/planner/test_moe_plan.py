"""`ptdp plan` and `ptdp check` for mixtures of experts: e searched over the divisors of d*c
that divide E and explained, pinned with --fix e=, refused for dense models; the check's
layout, expert placement and parameters; the shipped MoE configs."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from ptdp.job_summary import summary
from ptdp.config import load_config
from ptdp.planner.compute import ModelShape
from ptdp.planner.formulas import active_parameters, decoder_parameters
from tests.planner.conftest import plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MOE = {"model": {"arch": "gpt", "preset": "llama", "num_layers": 8, "hidden_size": 1024,
                 "num_heads": 16, "num_kv_heads": 4, "ffn_hidden_size": 2816,
                 "seq_length": 1024, "vocab_size": 32000, "num_experts": 8, "moe_top_k": 2,
                 "moe_ffn_hidden_size": 1408},
       "train": {"global_batch_size": 64}}


def test_plan_searches_e_and_explains_its_choice(model_file, capsys):
    assert plan([model_file(MOE), "--hardware", "a100-80gb", "--nodes", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    choice = out["expert_choice"]
    assert set(choice) == {"1", "2", "4", "8"}          # divisors of d*c and of E = 8
    best = out["parallel"].get("expert", 1)
    assert choice[str(best)]["why_slower"] == "best"
    fastest = min((row["step_time_s"], e) for e, row in choice.items() if row["feasible"])
    assert fastest[1] == str(best)
    assert out["model"]["num_experts"] == 8
    assert out["model"]["active_parameters"] < out["model"]["parameters"]


def test_plan_table_has_an_e_column_and_a_line_per_e(model_file, capsys):
    assert plan([model_file(MOE), "--hardware", "a100-80gb", "--nodes", "1", "--fix", "e=2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^#\s+p\s+t\s+d\s+e\s+v", out, re.M)
    assert "expert parallelism: e=2 chosen" in out
    assert "  e=2: " in out and "  e=4: " not in out
    assert "8 experts, top-2" in out


def test_plan_refuses_e_for_a_dense_model(model_file, capsys):
    dense = {**MOE, "model": {**MOE["model"], "num_experts": 0}}
    assert plan([model_file(dense), "--hardware", "a100-80gb", "--fix", "e=2"]) == 2
    assert "expert parallelism needs model.num_experts > 0" in capsys.readouterr().err


def test_plan_refuses_an_e_that_does_not_divide_the_experts(model_file, capsys):
    assert plan([model_file(MOE), "--hardware", "a100-80gb", "--fix", "e=3"]) == 2
    assert "must divide d*c" in capsys.readouterr().err


def test_write_config_keeps_the_chosen_e(model_file, tmp_path, capsys):
    out = tmp_path / "planned.yaml"
    assert plan([model_file(MOE), "--hardware", "a100-80gb", "--fix", "e=4,p=1,t=1",
                 "--write-config", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["parallel"]["expert"] == 4


def test_check_prints_the_layout_placement_and_parameters():
    cfg = load_config(CONFIGS / "moe_tiny.yaml", world_size=8)
    lines = summary(cfg, 8)
    assert lines[1].startswith("layout: (p, t, c, d, e) = (2, 2, 1, 2, 2), v = 1")
    shape = ModelShape.from_config(cfg.model)
    total, active = (f(shape, cfg.padded_vocab_size) / 1e6 for f in (decoder_parameters,
                                                                      active_parameters))
    assert (f"experts: 4 of f = 96 in layers 0-3 (4 of 4), top-2 softmax routing; "
            f"{total:,.2f} M parameters in all, {active:,.2f} M active per token") in lines
    assert lines[lines.index(next(x for x in lines if x.startswith("expert placement"))) + 1:][:2] \
        == ["  expert rank 0: experts [0, 2)", "  expert rank 1: experts [2, 4)"]


# name -> (GPUs, (p, t, d), e)
MOE_CONFIGS = {"moe_tiny": (8, (2, 2, 2), 2), "mixtral_8x7b": (64, (2, 1, 32), 8),
               "qwen3_30b_a3b": (64, (1, 1, 64), 8), "deepseek_v3": (2048, (1, 8, 256), 32)}


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_moe_configs_load_with_the_layout_their_header_states(name):
    gpus, layout, e = MOE_CONFIGS[name]
    path = CONFIGS / f"{name}.yaml"
    header = " ".join(line.lstrip("# ") for line in path.read_text().splitlines()
                      if line.startswith("#"))
    p, t, d = layout
    assert re.search(rf"\(p, t, d\) = \({p}, {t}, {d}\) on {gpus} ", header)
    assert f"e = {e} expert ranks" in header
    cfg = load_config(path, world_size=gpus)
    par = cfg.parallel
    assert (par.pipeline, par.tensor, par.data, par.expert) == (p, t, d, e)
    assert cfg.model.num_experts % e == 0 and (par.data * par.context) % e == 0


def test_deepseek_shape():
    m = load_config(CONFIGS / "deepseek_v3.yaml", world_size=2048).model
    assert (m.moe_first_dense_layers, m.moe_shared_ffn_hidden_size, m.moe_score_function,
            m.moe_routed_scaling_factor, m.num_experts, m.moe_top_k) == (3, 2048, "sigmoid",
                                                                       2.5, 256, 8)
    assert m.moe_expert_bias_rate > 0
    assert (m.moe_router_groups, m.moe_router_group_top_k) == (8, 4)


def test_the_deepseek_v3_config_has_deepseek_v3s_counts():
    """configs/deepseek_v3.yaml is DeepSeek-V3 with its latent attention and its one MTP
    depth: without the depth Hugging Face's DeepseekV3ForCausalLM count, 37.6 B active (its
    "37B"); the depth adds 11,610,067,968 (tests/planner/test_mtp_planner.py), 0.69 B active."""
    m = load_config(CONFIGS / "deepseek_v3.yaml", world_size=2048).model
    assert (m.mla_kv_lora_rank, m.mla_q_lora_rank, m.head_dim, m.mla_rope_head_dim,
            m.mla_v_head_dim, m.mtp_layers) == (512, 1536, 128, 64, 128, 1)
    shape = ModelShape.from_config(m)
    assert decoder_parameters(shape) == 671_026_404_352 + 11_610_067_968
    assert round(active_parameters(shape) / 1e8) == 382
    without = dataclasses.replace(shape, mtp_layers=0)
    assert decoder_parameters(without) == 671_026_404_352
    assert round(active_parameters(without) / 1e8) == 376
