"""`ptdp plan` end to end: table, JSON, --write-config, and clear errors with exit code 2."""

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ptdp.config import load_config
from ptdp.config.recompute import selective_modules
from ptdp.planner.compute import ModelShape
from ptdp.planner.cost_model import Layout, Workload, predict
from ptdp.runtime.local_ranks import free_port
from tests.planner.conftest import plan
from tools import jobs

GPT3 = {"model": {"arch": "gpt", "num_layers": 96, "hidden_size": 12288, "num_heads": 96,
                  "seq_length": 2048, "vocab_size": 51200}}
SMALL = {"model": {"arch": "bert", "num_layers": 4, "hidden_size": 256, "num_heads": 8,
                   "seq_length": 128, "vocab_size": 1000},
         "data": {"source": "synthetic"}, "train": {"global_batch_size": 32, "iters": 3}}


def test_table_names_the_best_layout_and_the_losers(model_file, capsys):
    rc = plan([model_file(GPT3), "--hardware", "a100-80gb", "--nodes", "128",
               "--gpus-per-node", "8", "--global-batch-size", "1536", "--top", "5"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "out of memory" in out and "indivisible" in out
    assert "TFLOP/s" in out and "bubble" in out
    assert len([l for l in out.splitlines() if l[:2] in ("1 ", "2 ", "3 ", "4 ", "5 ")]) == 5


def test_json_and_written_config_run_unchanged(model_file, tmp_path, capsys):
    out_yaml = tmp_path / "plan.yaml"
    rc = plan([model_file(GPT3), "--hardware", "a100-80gb", "--nodes", "128",
               "--global-batch-size", "1536", "--json", "--write-config", str(out_yaml)])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("parallel", "micro_batch_size", "schedule", "recompute", "predicted"):
        assert key in result
    for key in ("step_time_s", "tflops_per_gpu", "mfu", "memory_gb_per_gpu", "bubble_fraction"):
        assert key in result["predicted"]
    assert set(result["parallel"]) == {"tensor", "pipeline", "data", "chunks", "scatter_gather",
                                       "sequence_parallel"}
    cfg = load_config(out_yaml, world_size=1024)
    par = result["parallel"]
    assert (cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.data, cfg.parallel.chunks) == (
        par["tensor"], par["pipeline"], par["data"], par["chunks"])
    assert cfg.train.micro_batch_size == result["micro_batch_size"]
    assert cfg.schedule.name == result["schedule"] and cfg.train.recompute == result["recompute"]
    assert cfg.parallel.sequence_parallel == par["sequence_parallel"]
    trained = (selective_modules(cfg.train.recompute_modules, cfg.parallel.sequence_parallel)
               if cfg.train.recompute == "selective" else ())
    assert result["recompute_modules"] == list(trained)   # what the plan modelled, trained
    assert cfg.model.ffn_hidden_size == 4 * 12288     # the shape that was planned


def test_other_sections_survive_and_batch_comes_from_yaml(model_file, tmp_path, capsys):
    out_yaml = tmp_path / "small.yaml"
    rc = plan([model_file(SMALL), "--hardware", "v100-16gb", "--gpus", "4", "--fix", "d=2",
               "--write-config", str(out_yaml)])
    assert rc == 0, capsys.readouterr().err
    written = yaml.safe_load(out_yaml.read_text())
    assert written["data"] == {"source": "synthetic"} and written["train"]["iters"] == 3
    cfg = load_config(out_yaml, world_size=4)
    assert cfg.parallel.data == 2 and cfg.train.global_batch_size == 32
    assert cfg.train.precision == "fp16"     # V100 has no bf16


@pytest.mark.parametrize("fix,core_attn", [
    ("p=8,t=8,d=2,b=1,schedule=1f1b,recompute=selective,sg=false,sp=false", True),
    ("p=8,t=8,c=2,d=1,b=1,schedule=1f1b,recompute=selective,sg=false,sp=false", False)])
def test_a_materialized_plan_writes_the_modules_it_modelled(model_file, tmp_path, capsys, a100,
                                                           fix, core_attn):
    """Under --attention materialized the plan's selective adds core_attn to the trainer's
    default (not with context parallelism, whose ring keeps no scores): the written config
    must name the modules, so that what the trainer resolves from it (models/transformer.py's
    rule) priced as a pinned plan gives the plan's own memory, time and context ring."""
    out_yaml = tmp_path / "plan.yaml"
    assert plan([model_file(GPT3), "--hardware", "a100-80gb", "--gpus", "128",
                 "--global-batch-size", "64", "--attention", "materialized", "--fix", fix,
                 "--json", "--write-config", str(out_yaml)]) == 0
    planned = json.loads(capsys.readouterr().out)["predicted"]
    cfg = load_config(out_yaml, world_size=128)
    par, tr = cfg.parallel, cfg.train
    trained = selective_modules(tr.recompute_modules, par.sequence_parallel)
    assert ("core_attn" in trained) == core_attn
    lay = Layout(par.pipeline, par.tensor, par.data, par.chunks, tr.micro_batch_size,
                 cfg.schedule.name, tr.recompute, par.scatter_gather, context=par.context,
                 recompute_modules=trained)
    pinned = predict(a100, Workload(ModelShape.from_config(cfg.model), 64, "bf16", 8), lay,
                     attention="materialized")
    assert pinned.memory == planned["memory_breakdown_gb"]
    assert round(pinned.step_time_s, 6) == planned["step_time_s"]
    assert round(pinned.time["context_ring"], 6) == planned["time_breakdown_s"]["context_ring"]


@pytest.mark.parametrize("argv,message", [
    (["--hardware", "a100-80"], "unknown hardware 'a100-80' (did you mean 'a100-80gb'?)"),
    (["--hardware", "a100-80gb", "--fix", "p=7"], "--fix p=7: 7 does not divide the 8 GPUs"),
    (["--hardware", "a100-80gb", "--gpus", "12"], "--gpus 12 is not a whole number of 8-GPU nodes"),
    (["--hardware", "a100-80gb", "--fix", "t=16"], "does not divide the 8 GPUs"),
    (["--hardware", "v100-16gb", "--precision", "bf16"], "no peak for precision 'bf16'"),
    (["--hardware", "a100-80gb", "--fix", "t=8,p=1,recompute=none,b=64"], "no layout of 8 GPUs fits"),
])
def test_bad_input_exits_2_with_a_named_problem(model_file, capsys, argv, message):
    rc = plan([model_file(SMALL)] + argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and "Traceback" not in err


def test_missing_batch_and_bad_model(model_file, capsys):
    assert plan([model_file(GPT3), "--hardware", "a100-80gb"]) == 2
    assert "--global-batch-size is required" in capsys.readouterr().err
    bad = {"model": {**SMALL["model"], "num_heads": 7}}
    assert plan([model_file(bad), "--hardware", "a100-80gb", "--global-batch-size", "8"]) == 2
    assert "divisible by model.num_heads" in capsys.readouterr().err
    assert plan(["/no/such.yaml", "--hardware", "a100-80gb"]) == 2
    assert "not found" in capsys.readouterr().err


def test_plan_imports_no_torch(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(GPT3))
    code = ("import sys, argparse\n"
            "from ptdp.commands import plan as cli\n"
            "p = argparse.ArgumentParser(); cli.register(p.add_subparsers())\n"
            f"a = p.parse_args(['plan', {str(path)!r}, '--hardware', 'a100-80gb', '--nodes', '16',"
            " '--global-batch-size', '512', '--json'])\n"
            "assert a.func(a) == 0\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_python_dash_m_ptdp_plan(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    proc = subprocess.run([sys.executable, "-m", "ptdp", "plan", str(path), "--hardware",
                           "a100-80gb", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["parallel"]["tensor"] >= 1


def _small_model(tmp_path, iters: int) -> Path:
    model = tmp_path / "small.yaml"
    model.write_text(yaml.safe_dump({
        "model": {"arch": "gpt", "num_layers": 4, "hidden_size": 64, "num_heads": 4,
                  "seq_length": 32, "vocab_size": 256},
        "train": {"global_batch_size": 16, "iters": iters, "device": "cpu", "timeout_s": 60},
        "data": {"source": "synthetic"}, "log": {"progress": False}}))
    return model


CPU_LOCAL = str(Path(__file__).resolve().parents[2] / "configs" / "hardware" / "cpu-local.yaml")


# name -> (iterations, ranks, `ptdp plan` arguments after the model and the profile)
WRITTEN = {"2bw": (3, 2, ["--gpus", "2", "--allow-2bw"]),
           "zb-h1 sp": (2, 4, ["--gpus", "4", "--fix", "p=2,t=2,schedule=zb-h1"])}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Each of WRITTEN planned by `ptdp plan --write-config`, then the written YAML trained by
    `ptdp train` under torchrun as a user would run it, both trainings at once (they are mostly
    interpreter start-ups): {name: (the plan's table, the YAML, the iterations logged)}."""
    out, started = {}, {}
    try:
        for name, (iters, ranks, argv) in WRITTEN.items():
            folder = tmp_path_factory.mktemp("written")
            config, table = folder / "plan.yaml", io.StringIO()
            with contextlib.redirect_stdout(table):
                assert plan([str(_small_model(folder, iters)), "--hardware", CPU_LOCAL, *argv,
                             "--write-config", str(config)]) == 0
            out[name] = (table.getvalue(), yaml.safe_load(config.read_text()))
            metrics = folder / "metrics.jsonl"
            started[name] = metrics, jobs.start([
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                "--master-port", str(free_port()), "-m", "ptdp", "train", str(config),
                f"log.metrics_file={metrics}"], folder)
        for name, (metrics, job) in started.items():
            output, _ = job.communicate(timeout=300)
            assert job.returncode == 0, output[-5000:]
            out[name] += ([json.loads(line)["iter"] for line in metrics.read_text().splitlines()],)
    finally:
        for _, job in started.values():
            jobs.stop(job)
    return out


def test_allow_2bw_writes_a_layout_ptdp_train_runs_unchanged(written):
    """On two CPU ranks the measured profile makes 2BW (no flush) the best layout; the written
    config trains under torchrun as it is, one metrics record per iteration."""
    table, config, iterations = written["2bw"]
    assert "2bw" in table
    assert config["schedule"]["name"] == "2bw" and config["parallel"]["pipeline"] == 2
    assert iterations == [1, 2, 3]


def test_plan_writes_sequence_parallel_and_zero_bubble_that_train_runs(written):
    """With p = t = 2 and zb-h1 fixed on four CPU ranks (on two cores the bubble costs no
    time, so the planner alone would not split the backward), the plan adds sequence
    parallelism (no extra time, less memory); `ptdp train` runs the written YAML."""
    _, config, iterations = written["zb-h1 sp"]
    assert config["schedule"]["name"] == "zb-h1" and config["parallel"]["sequence_parallel"]
    assert iterations == [1, 2]
