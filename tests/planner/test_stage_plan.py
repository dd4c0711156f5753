"""The planner chooses stage sizes: the partitioner's split into exactly p*v stages, over
per-layer costs with the embedding and the output layer and loss, proposed (printed, written
to the YAML) only where it is predicted faster than even stages."""

import argparse
import itertools
import json
import random

import pytest
import yaml

from ptdp.commands import plan as cli
from ptdp.config import load_config
from ptdp.planner.partitioner import LayerProfile, split_stages, stage_times

LLAMA8B = {"model": {"arch": "gpt", "preset": "llama", "num_layers": 32, "hidden_size": 4096,
                     "num_heads": 32, "num_kv_heads": 8, "ffn_hidden_size": 14336,
                     "seq_length": 8192, "vocab_size": 128256},
           "train": {"global_batch_size": 64}}
SMALL_VOCAB = {"model": {"arch": "gpt", "num_layers": 32, "hidden_size": 4096, "num_heads": 32,
                         "seq_length": 2048, "vocab_size": 8192},
               "train": {"global_batch_size": 64}}


def _brute_force(costs: list[float], stages: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = list(zip((0,) + cuts, cuts + (len(costs),)))
        best = min(best, max(sum(costs[a:b]) for a, b in bounds))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_split_is_the_best_min_max_split(seed):
    rng = random.Random(seed)
    costs = [rng.uniform(0.1, 5.0) for _ in range(rng.randint(3, 9))]
    stages = rng.randint(1, len(costs))
    split = split_stages([LayerProfile(c, 0.0, 0.0) for c in costs], stages)
    assert split.time == pytest.approx(_brute_force(costs, stages))
    assert len(split.bounds) == stages and max(split.times) == pytest.approx(split.time)


def test_heavy_head_moves_layers_off_the_last_stage():
    # [embedding, 8 layers, output layer and loss costing 3 layers]
    profiles = ([LayerProfile(0.2, 0.0, 0.0)] + [LayerProfile(1.0, 0.0, 0.0)] * 8
                + [LayerProfile(3.0, 0.0, 0.0)])
    split = split_stages(profiles, 4)
    assert sum(split.stage_layers()) == 8
    assert split.stage_layers()[-1] == 0 and split.time == pytest.approx(3.0)
    assert stage_times(profiles, [2, 2, 2, 2]) == pytest.approx((2.2, 2.0, 2.0, 5.0))
    assert stage_times(profiles, split.stage_layers()) == pytest.approx(split.times)


def _plan(path, *argv) -> int:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["plan", str(path), "--hardware", "h100-80gb", "--gpus", "8",
                              *argv])
    return args.func(args)


def test_plan_proposes_and_writes_an_uneven_split(tmp_path, capsys):
    model = tmp_path / "llama.yaml"
    model.write_text(yaml.safe_dump(LLAMA8B))
    out = tmp_path / "planned.yaml"
    fix = "p=4,t=2,v=1,schedule=1f1b"
    assert _plan(model, "--fix", fix, "--write-config", str(out)) == 0
    text = capsys.readouterr().out
    assert "parallel.stage_layers = [8, 9, 8, 7] instead of even [8, 8, 8, 8]" in text
    assert "  stage 3: 7 layers + output layer and loss" in text
    written = yaml.safe_load(out.read_text())
    assert written["parallel"]["stage_layers"] == [8, 9, 8, 7]
    cfg = load_config(str(out), [], world_size=8)   # the trainer accepts it
    assert cfg.parallel.stage_layers == [8, 9, 8, 7]
    assert _plan(model, "--fix", fix, "--json") == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert stages["stage_layers"] == [8, 9, 8, 7] and stages["predicted_saving_s"] > 0


def test_plan_keeps_even_stages_when_the_split_gains_nothing(tmp_path, capsys):
    model = tmp_path / "small_vocab.yaml"
    model.write_text(yaml.safe_dump(SMALL_VOCAB))
    out = tmp_path / "planned.yaml"
    assert _plan(model, "--fix", "p=4,t=2,v=1,schedule=1f1b", "--write-config", str(out)) == 0
    assert "stage_layers" not in capsys.readouterr().out
    assert "stage_layers" not in yaml.safe_load(out.read_text())["parallel"]


def test_check_prints_each_stage_and_its_time():
    from ptdp.job_summary import summary
    from ptdp.hardware import load_hardware
    cfg = load_config("configs/gpt_tiny.yaml", ["parallel.pipeline=4",
                                                "parallel.stage_layers=[0,2,2,0]"], world_size=4)
    lines = summary(cfg, 4, load_hardware("cpu-local"))
    start = lines.index("stages (parallel.stage_layers = [0, 2, 2, 0]):")
    stages = lines[start + 1:start + 5]
    assert [line.split(",")[0] for line in stages] == [
        "  stage 0: embedding", "  stage 1: layers 0-1", "  stage 2: layers 2-3",
        "  stage 3: output layer and loss"]
    assert all("ms per micro-batch (cpu-local)" in line for line in stages)
    even = load_config("configs/gpt_tiny.yaml", ["parallel.pipeline=4"], world_size=4)
    assert not any(line.startswith("stages") for line in summary(even, 4))


def test_check_prices_each_rank_at_its_own_layers():
    from ptdp.job_summary import memory_per_stage
    uneven = load_config("configs/gpt_tiny.yaml", ["parallel.pipeline=4",
                                                   "parallel.stage_layers=[0,2,2,0]"], world_size=4)
    even = load_config("configs/gpt_tiny.yaml", ["parallel.pipeline=4"], world_size=4)
    got, was = memory_per_stage(uneven), memory_per_stage(even)
    assert got[1].activations > was[1].activations and got[0].activations < was[0].activations
    assert got[1].weights > was[1].weights and got[3].weights < was[3].weights
