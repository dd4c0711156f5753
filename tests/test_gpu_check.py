"""tools/gpu_check.sh without a GPU: its dry run (the planner's predictions and the report),
and the report's verdicts on made-up results of a GPU run."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.background import end, finish, start
from tests.deadline import within
import tools.gpu_check as gpu_check

ROOT = Path(__file__).resolve().parents[1]


def _dry_runs(mktemp) -> dict:
    """name -> (its --out, None for none; the folder its test reads; its environment beside
    PYTHON) of the tests' dry runs."""
    wheels, predicts, stages, eager = (mktemp(name) for name in
                                       ("wheels", "predicts", "stages", "eager"))
    (wheels / "wheels").mkdir()
    for name in ("pytest-8.0.0-py3-none-any.whl", "pluggy-1.5.0-py3-none-any.whl"):
        (wheels / "wheels" / name).write_bytes(b"")
    return {"predicts": (predicts, predicts, {}),
            "wheels": (wheels / "out", wheels,
                       {"WHEELS": str(wheels / "wheels"), "STAGES": "loss"}),
            "without out": (None, None, {"STAGES": "gpu_tier"}),
            "stages": (stages / "some", stages, {"STAGES": "gpu_tier,bench_bert"}),
            "misspelt stage": (stages / "bad", stages, {"STAGES": "gpu-tier"}),
            "eager": (eager / "eager", eager, {"STAGES": "bert_eager"})}


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """The tests' dry runs of tools/gpu_check.sh, started at once (each is a second or two of
    one core's work); each test waits for its own (`ran`). {name: (process, the folder its
    test reads)}."""
    runs, started = _dry_runs(tmp_path_factory.mktemp), {}
    base = {k: v for k, v in os.environ.items() if k != "OUT"}
    try:
        for name, (out, folder, env) in runs.items():
            started[name] = (start(
                ["bash", ROOT / "tools/gpu_check.sh", "--dry-run", *(["--out", out] if out else [])],
                cwd=ROOT if out is None else None,
                env={**(base if out is None else os.environ), **env, "PYTHON": sys.executable}),
                folder)
        yield started
    finally:
        end(proc for proc, _ in started.values())


def ran(dry_runs, name: str) -> tuple:
    """(CompletedProcess, the folder its test reads) of dry run `name`."""
    proc, folder = dry_runs[name]
    return finish(proc, within(120)), folder


def test_dry_run_predicts_and_reports(dry_runs):
    run, tmp_path = ran(dry_runs, "predicts")
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report["stages"]["stages"]) == {"gpu_tier", "bench_gpt", "bench_bert", "plan",
                                               "attention", "wgrad", "loss", "bert_head",
                                               "mlp_chain"}
    assert [row["layout"] for row in report["plan"]] == list(gpu_check.LAYOUTS)
    assert all(row["predicted_step_s"] > 0 and row["fits"] for row in report["plan"])
    assert "| gpt-1.3b b=8 m=4 |" in (tmp_path / "gpu_check.md").read_text()
    assert "[dry run] offline install: none (" in run.stdout   # the default .whl/ is empty here


def test_a_dry_run_shows_the_offline_install_of_the_fetched_wheels(dry_runs):
    run, tmp_path = ran(dry_runs, "wheels")
    wheels = tmp_path / "wheels"
    assert run.returncode == 0, run.stdout + run.stderr
    line = next(line for line in run.stdout.splitlines() if "offline install" in line)
    assert "--no-index" in line and f"{wheels}/*.whl (2 wheels)" in line


def test_a_dry_run_without_out_writes_outside_the_checkout(dry_runs):
    """Its files go to a temporary folder: a dry run leaves nothing untracked in the checkout
    (bench/gpu_check/ holds the recorded runs)."""
    run, _ = ran(dry_runs, "without out")
    assert run.returncode == 0, run.stdout + run.stderr
    written = ROOT / run.stderr.strip().splitlines()[-1].split()[1]   # ".../gpu_check.json"
    assert written.is_file() and ROOT not in written.parents, written
    shutil.rmtree(written.parent)


def test_report_judges_each_target(tmp_path):
    (tmp_path / "gpu_tier.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0" time="12.5">'
        '<testcase name="a"/><testcase name="b"><failure/></testcase><testcase name="c"/>'
        '</testsuite></testsuites>')
    row = {"model": "ptdp", "mfu": 0.6, "peak_memory_gb": 50.0, "step_ms": 1300.0}
    targets = {"speedup": 1.15, "mfu": 0.65, "memory_ratio": 1.10}   # the bench's own
    for arch, speedup, memory, paired, regions in (("gpt", 1.2, 1.05, {"rounds": 6}, None),
                                                   ("bert", 1.1, 1.2, None, 8)):
        (tmp_path / f"bench_{arch}.json").write_text(json.dumps(
            {"rows": [{**row, "compile_layers": regions}, {"model": "reference (x)"}],
             "speedup": speedup,
             "memory_ratio": memory, "paired": paired, "targets": targets,
             "speedup_sequential": 0.9 if paired else None}))
    (tmp_path / "plan.json").write_text(json.dumps([
        {"layout": "L1", "predicted_step_s": 1.05, "predicted_memory_gb": 48.0,
         "measured_step_s": 1.0, "measured_memory_gb": 50.0},
        {"layout": "L2", "predicted_step_s": 1.5, "predicted_memory_gb": 30.0,
         "measured_step_s": 1.0, "measured_memory_gb": 30.0}]))
    (tmp_path / "loss.json").write_text(json.dumps({"fused_over_eager": 0.22}))
    (tmp_path / "bert_head.json").write_text(json.dumps({"masked_over_every_token": 1.3}))
    (tmp_path / "mlp_chain.json").write_text(json.dumps({"rows_over_sbh": 0.9}))
    report = gpu_check.evaluate(tmp_path)
    met = {check["what"]: check["met"] for check in report["checks"]}
    assert met == {"gpt tokens/s vs reference (x), paired rounds (sequential 0.900x)": True,
                   "gpt MFU (3 passes)": False, "gpt peak memory vs reference": True,
                   "bert tokens/s vs reference (x), ptdp compiled in regions of 8 layers": False,
                   "bert MFU (3 passes)": False,
                   "bert peak memory vs reference": False,
                   "planner step time, L1": True, "planner memory, L1": False,
                   "planner step time, L2": False, "planner memory, L2": True,
                   "loss time, fused / eager": True,
                   "BERT heads' time, masked rows / every token": False,
                   "GPT MLP block's time, token rows / [s, b, h]": True}
    assert report["tier"]["passed"] == 2 and report["tier"]["failed"] == ["b"]
    assert "**no**" in gpu_check.markdown(report)


def test_stages_picks_stages_and_a_misspelt_one_is_one_line(dry_runs):
    """STAGES reruns what a cut-short run missed; a name that is not a stage stops the check
    before it does anything (it would otherwise run nothing, silently)."""
    run, tmp_path = ran(dry_runs, "stages")
    assert run.returncode == 0, run.stdout + run.stderr
    stages = json.loads((tmp_path / "some" / "stages.json").read_text())["stages"]
    assert stages["bench_gpt"]["rc"] == "not run" and stages["gpu_tier"]["rc"] == "dry-run"
    assert stages["bench_bert"]["rc"] == "dry-run" and stages["plan"]["rc"] == "not run"
    bad, _ = ran(dry_runs, "misspelt stage")
    assert bad.returncode == 2 and not (tmp_path / "bad").exists()
    assert bad.stderr.strip().splitlines() == [
        "gpu_check.sh: STAGES names 'gpu-tier'; the stages are gpu_tier, bench_gpt, "
        "bench_bert, plan, attention, wgrad, loss, bert_head, mlp_chain (and on request "
        "bert_eager)"]


def test_bert_runs_with_cuda_graphs_and_without_only_when_named(dry_runs):
    """The BERT stage measures BERT-large as configs/bert_large.yaml trains it, its regions
    replayed as CUDA graphs; bert_eager (without them) is not in a default run's budget: named
    in STAGES it runs bench_gpu.py without --cuda-graphs, and the report has its rows."""
    default, _ = ran(dry_runs, "predicts")
    bert = next(line for line in default.stdout.splitlines() if "bench_bert " in line)
    assert "--arch bert" in bert and "--cuda-graphs" in bert, bert
    assert "bert_eager" not in default.stdout
    run, tmp_path = ran(dry_runs, "eager")
    assert run.returncode == 0, run.stdout + run.stderr
    line = next(line for line in run.stdout.splitlines() if "bert_eager" in line)
    assert "--arch bert" in line and "--cuda-graphs" not in line, line
    row = {"model": "ptdp", "mfu": 0.30, "peak_memory_gb": 13.0, "compile_layers": 8,
           "cuda_graphs": False}
    (tmp_path / "bench_bert_eager.json").write_text(json.dumps(
        {"rows": [row, {"model": "reference (HF)"}], "speedup": 0.97, "memory_ratio": 1.0,
         "paired": None, "targets": {"speedup": 1.25, "mfu": 0.4, "memory_ratio": 1.1}}))
    checks = gpu_check.evaluate(tmp_path)["checks"]
    assert checks[0]["what"] == ("bert_eager tokens/s vs reference (HF), ptdp compiled in "
                                 "regions of 8 layers")
    assert [c["met"] for c in checks] == [False, False, True]
    assert yaml.safe_load((ROOT / "configs/bert_large.yaml").read_text())["train"]["cuda_graphs"]


def test_report_keeps_a_benchmark_stopped_after_one_model(tmp_path):
    """A bench stage stopped while the reference ran leaves ptdp's row alone (bench_gpu.py
    writes each row as it goes): the report says n/a for it instead of failing (the first
    H200 run's report did)."""
    (tmp_path / "bench_bert.json").write_text(json.dumps(
        {"rows": [{"model": "ptdp", "mfu": 0.3, "peak_memory_gb": 13.0}], "complete": False,
         "targets": {"speedup": 1.25, "mfu": 0.4, "memory_ratio": 1.1}}))
    report = gpu_check.evaluate(tmp_path)
    (check,) = report["checks"]
    assert check["what"] == "bert tokens/s vs reference" and check["met"] is None
    assert check["target"] == ">= 1.25x"
    assert "| bert tokens/s vs reference | n/a |" in gpu_check.markdown(report)


def test_candidates_are_reported_without_a_verdict(tmp_path):
    """The candidate stages measure changes not yet made: their ratios go in a table of their
    own, never in the checks (no target to meet); a candidate that could not run is n/a."""
    (tmp_path / "attention.json").write_text(json.dumps(
        {"best_over_default": 0.8, "ms": {"default": 30.0, "flash": 24.0}}))
    (tmp_path / "wgrad.json").write_text(json.dumps({"fused_over_add": None}))
    report = gpu_check.evaluate(tmp_path)
    assert report["checks"] == []
    assert [row["value"] for row in report["candidates"]] == [0.8, None]
    text = gpu_check.markdown(report)
    assert ("| GPT-1.3B attention, the fastest SDPA kernel / torch's pick | 0.800x | default "
            "30.00, flash 24.00 |") in text
    assert "| GPT-1.3B weight gradients into main_grad, fused GEMM / GEMM + add | n/a | n/a |" in text


def test_a_time_share_that_is_not_whole_seconds_is_one_line(tmp_path):
    """BUDGET_S and the stage shares are bash arithmetic: '5m' would fail mid-run and a word
    would count as 0 seconds; each is refused before anything runs, by name."""
    run = subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh"), "--dry-run", "--out",
                          str(tmp_path / "x")], capture_output=True, text=True,
                         timeout=within(120),
                         env={**os.environ, "PYTHON": sys.executable, "MLP_S": "5m"})
    assert run.returncode == 2 and not (tmp_path / "x").exists()
    assert run.stderr.strip().splitlines() == [
        "gpu_check.sh: MLP_S='5m' is not a whole number of seconds"]
