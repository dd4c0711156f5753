"""Smoke test of tools/bench_gpu.py (a benchmark, not a test of speed): on CPU with the tiny
shape it runs ptdp's Trainer and the plain-PyTorch reference end to end, prints its table and
writes every field of its JSON; the two models have the same shape (the plain references:
the same parameter count) and both start at the loss of a uniform guess."""

import gzip
import json
import math
import sys
from pathlib import Path

import pytest

from tests.background import end, finish, start
from tests.deadline import within

ROOT = Path(__file__).resolve().parents[1]
ROW_FIELDS = {"model", "micro_batch", "micro_batches", "step_ms", "step_ms_all", "tokens_per_s",
              "tflops", "tflops_eq42", "mfu", "peak_memory_gb", "loss_first", "loss_last",
              "parameters", "vocab", "compile_layers"}


TINY_RUNS = [
    ("gpt", ["--no-tf32", "--data-workers", "1", "--rounds", "0"],
     [str(ROOT / "tools" / "bench_gpu.py")]),
    ("bert", [], ["-m", "tools.bench_gpu"])]   # both ways of running a tool (tools/harness.py)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """Both runs of the test below, started at once (each is one process: one core's work);
    each test waits for its own. {arch: (process, its folder)}."""
    started = {}
    try:
        for arch, extra, program in TINY_RUNS:
            tmp_path = tmp_path_factory.mktemp(arch)
            cmd = [sys.executable, *program, "--device", "cpu", "--tiny", "--arch", arch,
                   "--steps", "2", "--warmup", "1", "--json", str(tmp_path / "bench.json"),
                   *extra]
            if not extra:   # one profiled step of each model: its tables and its timeline
                cmd += ["--profile", str(tmp_path / "profile")]
            started[arch] = (start(cmd, cwd=ROOT), tmp_path)
        yield started
    finally:
        end(proc for proc, _ in started.values())


@pytest.mark.parametrize("arch,extra,program", TINY_RUNS)
def test_bench_gpu_tiny_on_cpu(tiny_runs, arch, extra, program):
    """Like with like: the same TF32 setting for both (ptdp's train.tf32), and both take each
    micro-batch from host memory during the step (ptdp's built ahead by data.num_workers).
    By default the two then alternate for as many rounds as timed steps (ptdp kept in memory
    while the reference is measured), and the speedup is those rounds'; `--rounds 0` skips
    them and the speedup is the sequential medians'."""
    proc, tmp_path = tiny_runs[arch]
    run = finish(proc, within(240))
    out = tmp_path / "bench.json"
    assert run.returncode == 0, run.stdout + run.stderr
    for heading in ("step ms", "tokens/s", "TFLOP/s eq4.2", "MFU", "peak GiB"):
        assert heading in run.stdout
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["compile"] is False
    assert result["environment"]["command"].startswith("python tools/bench_gpu.py --device cpu")
    assert (result["tf32"], result["data_workers"]) == ((False, 1) if extra else (True, 0))
    assert f"TF32 {'off' if extra else 'on'}, {1 if extra else 0} data worker(s)" in run.stdout
    ours, ref = result["rows"]
    assert ours["model"] == "ptdp" and ref["model"].startswith("reference")
    vocab = result["shape"]["vocab"]
    for row in (ours, ref):
        assert ROW_FIELDS <= row.keys()
        assert (row["micro_batch"], row["micro_batches"]) == (2, 2)
        assert len(row["step_ms_all"]) == 2
        for key in ("step_ms", "tokens_per_s", "tflops", "peak_memory_gb", "parameters"):
            assert row[key] > 0, key
        assert row["tflops_eq42"] > row["tflops"]  # 4 passes per layer instead of 3
        assert row["mfu"] is None  # no known peak on CPU
        # Both really trained from a fresh init: loss near ln V (BERT adds the 2-way head's ln 2)
        start = math.log(vocab) + (math.log(2) if arch == "bert" else 0.0)
        assert abs(row["loss_first"] - start) < 0.2 * start, row
    if "plain" in ref["model"]:  # same shape, same parameters (V = 512 needs no padding)
        assert ours["parameters"] == ref["parameters"]
    sequential = ours["tokens_per_s"] / ref["tokens_per_s"]
    assert result["speedup_sequential"] == pytest.approx(sequential)
    paired = result["paired"]
    if extra:
        assert paired is None and result["speedup"] == pytest.approx(sequential)
        assert "paired: not run (--rounds 0)" in run.stdout
    else:
        assert paired["rounds"] == 2
        assert len(paired["ptdp_ms_all"]) == len(paired["reference_ms_all"]) == 2
        assert result["speedup"] == pytest.approx(paired["reference_ms"] / paired["ptdp_ms"])
        assert "(medians of 2 alternating rounds; single rounds " in run.stdout
        spread = paired["round_speedups"]
        assert len(spread) == 2 and spread[0] <= result["speedup"] * (1 + 1e-9) and \
            spread == sorted(spread)
        for model in ("ptdp", "reference"):   # each model's profiled step, after the rounds
            table = (tmp_path / "profile" / f"profile_{arch}_{model}.txt").read_text()
            assert "one step" in table and "Self CPU" in table
            trace = tmp_path / "profile" / f"profile_{arch}_{model}.trace.json.gz"
            assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert result["targets"]["speedup"] > 1 and result["met"] is None  # targets are for GPUs


def test_the_json_is_written_after_each_measurement(tmp_path, monkeypatch):
    """A run cut short (the reference runs out of memory) keeps the ptdp row it measured."""
    import tools.bench_gpu as bench_gpu
    measured = []

    def run_one(make, args, s, device, vocab, peak, keep=False):
        if make is bench_gpu.PlainRunner:
            raise MemoryError("the reference ran out of memory")
        measured.append(make.name)
        return {"model": make.name}, None

    import contextlib
    monkeypatch.setattr(bench_gpu, "run_one", run_one)
    monkeypatch.setattr(bench_gpu.harness, "world_of_one", lambda device: contextlib.nullcontext())
    out = tmp_path / "bench.json"
    with pytest.raises(MemoryError):
        bench_gpu.main(["--device", "cpu", "--tiny", "--json", str(out)])
    result = json.loads(out.read_text())
    assert measured == ["ptdp"] and result["rows"] == [{"model": "ptdp"}]
    assert result["complete"] is False
    assert result["targets"] == bench_gpu.TARGETS["gpt"]   # what tools/gpu_check.py judges by


@pytest.mark.parametrize("room", [True, False])
def test_no_model_is_timed_after_a_profiled_step(room, tmp_path, monkeypatch):
    """A profiler can leave CUDA's tracing attached after it stops, slowing later launches:
    the paired rounds come before either profiled step, and where the GPU cannot hold both
    models, ptdp's profiled step is the one timing that comes before the reference's."""
    import contextlib
    import types
    import tools.bench_gpu as bench_gpu
    events = []

    def run_one(make, args, s, device, vocab, peak, keep=False):
        name = "ptdp" if make is bench_gpu.PtdpRunner else "reference"
        events.append(f"time {name}")
        row = {"model": name, "tokens_per_s": 1.0, "peak_memory_gb": None}
        return row, (types.SimpleNamespace(name=name) if keep else None)

    monkeypatch.setattr(bench_gpu, "run_one", run_one)
    monkeypatch.setattr(bench_gpu, "room_for_both", lambda device, ours: room)
    monkeypatch.setattr(bench_gpu, "paired_rounds",
                        lambda ours, ref, args, device: events.append("paired"))
    monkeypatch.setattr(bench_gpu, "compare", lambda *a: {"speedup": 1.0, "memory_ratio": None,
                                                          "speedup_sequential": 1.0, "met": None})
    monkeypatch.setattr(bench_gpu, "profile_step", lambda runner, i, device, path:
                        events.append(f"profile {runner.name.split()[0]} at {i}"))
    monkeypatch.setattr(bench_gpu, "table", lambda rows: "")
    monkeypatch.setattr(bench_gpu.harness, "world_of_one", lambda device: contextlib.nullcontext())
    bench_gpu.main(["--device", "cpu", "--tiny", "--steps", "3", "--warmup", "1", "--rounds",
                    "2", "--profile", str(tmp_path)])
    if room:
        assert events == ["time ptdp", "time reference", "paired", "profile ptdp at 6",
                          "profile reference at 6"]
    else:
        assert events == ["time ptdp", "profile ptdp at 6", "time reference",
                          "profile reference at 6"]


def test_the_targets_line_names_the_gpu_that_measured():
    from tools.bench_gpu import targets_line
    assert targets_line("gpt", "NVIDIA H100 80GB HBM3", None).startswith(
        "targets (one H100 80GB): >= 1.10x tokens/s")
    assert targets_line("gpt", "NVIDIA H200", {"mfu": False}).startswith(
        "targets (stated for one H100 80GB, measured on one NVIDIA H200): >= 1.10x")


def test_the_models_are_paired_only_where_the_gpu_holds_both(monkeypatch):
    """Twice ptdp's peak reservation with 15 % to spare: an H200 (140 GiB) holds GPT-1.3B's
    pair (ptdp reserved 51.7 GiB there) and an H100 (80 GiB) only BERT-large's (13 GiB)."""
    import types
    import torch
    from tools.bench_gpu import room_for_both
    cuda = torch.device("cuda", 0)
    for total_gib, reserved, fits in ((140, 51.7, True), (80, 51.7, False), (80, 13.0, True)):
        properties = types.SimpleNamespace(total_memory=total_gib * 2**30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
        assert room_for_both(cuda, {"peak_reserved_gb": reserved}) is fits
    assert room_for_both(torch.device("cpu"), {"peak_reserved_gb": 1e9})


DROPOUT_REFUSED = "--dropout needs --arch bert and the Hugging Face reference"


@pytest.mark.parametrize("argv, message", [
    (["--arch", "gpt", "--dropout", "0.1"], DROPOUT_REFUSED),
    (["--arch", "bert", "--reference", "plain", "--dropout", "0.1"], DROPOUT_REFUSED),
    (["--compile-layers", "0"], "--compile-layers must be >= 1 (train.compile_layers), got 0"),
    (["--device", "cpu", "--cuda-graphs"], "--cuda-graphs needs --device cuda and --compile")])
def test_options_that_cannot_work_are_refused_in_one_line(argv, message, capsys):
    """--dropout sets both models' dropout: refused where the reference (plain GPT or BERT)
    has none, rather than timing ptdp with dropout against a model without; a region length
    below 1, and CUDA graphs without compiled CUDA layers, before any model is built."""
    from tools.bench_gpu import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--tiny", *argv])
    assert message in capsys.readouterr().err


def test_the_row_names_the_compiled_regions():
    """With compile, ptdp's row says how many layers each compiled region held (the header
    line too); without, none."""
    from tools.bench_gpu import _compile_words
    assert _compile_words({"compile_layers": 8}) == "on (ptdp's regions: 8 layers)"
    assert _compile_words({"compile_layers": 1}) == "on (ptdp's regions: 1 layer)"
    assert _compile_words({"compile_layers": None}) == "off"
    assert _compile_words({"compile_layers": 8, "cuda_graphs": True}) == \
        "on (ptdp's regions: 8 layers, CUDA graphs)"
