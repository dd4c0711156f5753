"""Every benchmark in tools/ runs its main path at the tiniest sizes, on CPU ranks, and writes its
JSON (with the harness's environment) and its table: the numbers say nothing about speed, the
keys and the relations between them do. tools/bench_gpu.py, tools/bench_schedules.py,
tools/bench_pipeline.py (tests/pipeline/), tools/gpu_check.py and tools/make_corpus.py (tests/data/)
have their own tests. tools/harness.py itself is checked first."""

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest

import ptdp.runtime.local_ranks as local_ranks
import tools.bench_attention_backends as bench_attention_backends
import tools.bench_checkpoint as bench_checkpoint
import tools.bench_context as bench_context
import tools.bench_bert_head as bench_bert_head
import tools.bench_cross_entropy as bench_cross_entropy
import tools.bench_data_loading as bench_data_loading
import tools.bench_distributed_optimizer as bench_distributed_optimizer
import tools.bench_mlp_chain as bench_mlp_chain
import tools.bench_sequence_parallel as bench_sequence_parallel
import tools.bench_startup as bench_startup
import tools.bench_topology as bench_topology
import tools.bench_wgrad_fusion as bench_wgrad_fusion
import tools.bench_zero_bubble as bench_zero_bubble
import tools.validate_planner as validate_planner
from tests.optional import assert_picture
from tools import harness

# Each test runs in seconds; a hung rank ends it (the tools' own run_on_ranks limits are meant
# for full-size runs).
pytestmark = pytest.mark.timeout(240)

TINY = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.seq_length=16",
        "model.vocab_size=128", "model.dropout=0.0", "parallel.pipeline=2",
        "train.micro_batch_size=1", "train.global_batch_size=2", "log.progress=false",
        "log.interval=1000", "train.timeout_s=120"]


def _written(path: Path, tool: str) -> dict:
    data = json.loads(path.read_text())
    env = data["environment"]
    assert env["command"].startswith(f"python tools/{tool}.py ") and env["torch"], env
    assert env["device"] == "cpu" and env["date"].endswith("Z")
    return data


@pytest.fixture
def forked_ranks(monkeypatch):
    """The tools start fresh interpreters where they measure a rank's own memory; these tests
    check keys and relations, not resident sets, so their ranks are forked from the server
    every local test shares (ptdp/runtime/local_ranks.py): seconds less per rank."""
    real = local_ranks.run_on_ranks
    monkeypatch.setattr(local_ranks, "run_on_ranks",
                        lambda *args, fresh_interpreters=False, **kw: real(*args, **kw))


@pytest.fixture
def memory_env(monkeypatch):
    """The allocator settings bench_context / bench_distributed_optimizer give their ranks,
    undone after the test (they would otherwise reach every later test's ranks)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# ------------------------------------------------------------------------------ the harness
def test_harness_times_the_last_steps_and_keeps_every_result():
    timed = harness.time_steps(lambda i: i * i, steps=3, warmup=2)
    assert timed.results == [0, 1, 4, 9, 16] and len(timed.seconds) == 3
    assert min(timed.seconds) <= timed.median <= max(timed.seconds)


def test_harness_tables_align_every_column():
    right = harness.table(["a", "bb"], [["100", "2"], ["3", "40"]])
    assert right.splitlines() == ["  a  bb", "---  --", "100   2", "  3  40"]
    piped = harness.table(["a", "b"], [["10", "2"]], sep=" | ")
    assert piped.splitlines() == [" a | b", "---+--", "10 | 2"]
    assert harness.table(["ab", "c"], [["x", "y"]], align="<").splitlines()[2] == "x   y"


def test_harness_json_carries_the_environment(tmp_path):
    path = harness.write_json(tmp_path / "sub" / "out.json", {"rows": [1]}, tool="tools/x.py",
                              argv=["--a", "b c"])
    data = json.loads(path.read_text())
    assert data["rows"] == [1] and data["environment"]["command"] == "python tools/x.py --a 'b c'"
    with pytest.raises(ValueError, match="environment"):
        harness.write_json(tmp_path / "x.json", {"environment": 1}, tool="x.py")


# ------------------------------------------------------------------------------ one process
@pytest.fixture
def torch_threads():
    """bench_data_loading sets this process's torch threads (--threads): put them back."""
    import torch
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_bench_data_loading_waits_for_the_whole_data_time_without_workers(tmp_path, capsys,
                                                                           torch_threads):
    out = tmp_path / "dl.json"
    world = {name: os.environ.get(name) for name in harness.WORLD_VARIABLES}
    assert bench_data_loading.main(["--workers", "0", "--sample-ms", "2", "--micro-batch", "1",
                                    "--micro-batches", "2", "--hidden", "32", "--seq", "16",
                                    "--steps", "2", "--warmup", "1", "--json", str(out)]) == 0
    assert "data wait ms" in capsys.readouterr().out
    (row,) = _written(out, "bench_data_loading")["rows"]
    assert row["workers"] == 0 and len(row["steps_ms"]) == 2
    assert row["data_time_ms"] == 4.0 and row["data_wait_ms"] >= row["data_time_ms"]
    assert row["step_ms"] >= row["data_wait_ms"]
    assert {name: os.environ.get(name) for name in harness.WORLD_VARIABLES} == world   # restored


def test_bench_topology_compares_each_layout_with_its_prediction(tmp_path, monkeypatch, capsys):
    """The cluster (tools/simcluster.sh, root) is faked; the planner's predictions and the
    comparison are the tool's."""
    from ptdp.hardware import load_hardware
    link = {"pair_bandwidth_GBps": 0.02, "pair_latency_us": 300.0, "samples": {}}
    started = []
    monkeypatch.setattr(bench_topology.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bench_topology.signal, "signal", lambda *args: None)
    monkeypatch.setattr(bench_topology, "sim", lambda *args, **kw: started.append(args))
    monkeypatch.setattr(bench_topology, "measure_link", lambda tmp, iters: link)
    monkeypatch.setattr(bench_topology, "cluster_profile",
                        lambda tmp, link, iters: load_hardware("cpu-local"))
    monkeypatch.setattr(bench_topology, "measure", lambda layout, iters, port, tmp: 0.5)
    out = tmp_path / "topology.json"
    assert bench_topology.main(["--repeat", "2", "--json", str(out)]) == 0
    assert started[0][0] == "up" and started[-1] == ("down",)
    data = _written(out, "bench_topology")
    assert [r["layout"] for r in data["rows"]] == list(bench_topology.layouts())
    for row in data["rows"]:
        assert row["runs_s"] == [0.5, 0.5] and row["predicted_step_s"] > 0
        assert row["error"] == pytest.approx(row["predicted_step_s"] / 0.5 - 1)
    assert "worst |error|" in capsys.readouterr().out


def test_bench_topology_needs_root(monkeypatch, capsys):
    monkeypatch.setattr(bench_topology.os, "geteuid", lambda: 1000)
    assert bench_topology.main([]) == 2
    assert "needs root" in capsys.readouterr().err


# ------------------------------------------------------------------------------ local ranks
def test_bench_cross_entropy_times_both_paths_on_the_same_loss(tmp_path, capsys):
    out = tmp_path / "ce.json"
    assert bench_cross_entropy.main(["--seq", "8", "--batch", "2", "--vocab", "64", "--rounds",
                                     "1", "--warmup", "1", "--dtype", "fp32", "--json",
                                     str(out)]) == 0
    data = _written(out, "bench_cross_entropy")
    assert data["eager_ms"] > 0 and data["fused_ms"] > 0 and data["peak_gb"] is None
    assert data["loss"]["eager"] == pytest.approx(data["loss"]["fused"], rel=1e-6)
    assert "fused / eager:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        bench_cross_entropy.main(["--rounds", "0"])
    assert stop.value.code == 2 and "--rounds must be >= 1" in capsys.readouterr().err


def test_bench_bert_head_times_both_heads_on_the_same_loss(tmp_path, capsys):
    out = tmp_path / "head.json"
    assert bench_bert_head.main(["--seq", "16", "--batch", "2", "--hidden", "32", "--vocab", "64",
                                 "--rounds", "1", "--warmup", "1", "--json", str(out)]) == 0
    data = _written(out, "bench_bert_head")
    assert 0 < data["masked_rows"] < 16 * 2 and data["peak_gb"] is None
    assert data["head_rows"] == 16 * 2   # rounded up to 64, at most every token
    assert all(ms > 0 for ms in data["ms"].values())
    assert data["loss"]["masked rows"] == pytest.approx(data["loss"]["every token"], rel=1e-6)
    assert "masked rows / every token:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        bench_bert_head.main(["--masked", "0"])
    assert stop.value.code == 2 and "--masked must be in (0, 1]" in capsys.readouterr().err


def test_bench_mlp_chain_adds_the_biases_three_ways_to_the_same_mlp(tmp_path, capsys):
    out = tmp_path / "mlp.json"
    assert bench_mlp_chain.main(["--seq", "8", "--batch", "2", "--hidden", "16", "--rounds", "1",
                                 "--warmup", "1", "--no-compile", "--json", str(out)]) == 0
    data = _written(out, "bench_mlp_chain")
    assert set(data["ms"]) == {"rows", "sbh", "addmm"} and data["over_rows"]["rows"] == 1.0
    assert data["rows_over_sbh"] == pytest.approx(data["ms"]["rows"] / data["ms"]["sbh"])
    losses = data["loss"]
    assert losses["sbh"] == pytest.approx(losses["rows"], rel=1e-5, abs=1e-7)
    assert losses["addmm"] == pytest.approx(losses["rows"], rel=1e-5, abs=1e-7)
    assert "/ rows" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        bench_mlp_chain.main(["--kernels"])
    assert stop.value.code == 2 and "--kernels needs --device cuda" in capsys.readouterr().err


def test_bench_attention_backends_times_each_kernel_torch_runs(tmp_path, capsys):
    """On CPU only flash runs of the three pinned kernels (cuDNN and memory-efficient are CUDA
    kernels): it and torch's own pick are timed, their errors against fp32 math are bf16's,
    and the others are listed as unavailable."""
    out = tmp_path / "attention.json"
    assert bench_attention_backends.main(["--batch", "1", "--heads", "2", "--seq", "32",
                                          "--head-dim", "16", "--rounds", "1", "--warmup", "0",
                                          "--json", str(out)]) == 0
    data = _written(out, "bench_attention_backends")
    assert list(data["ms"]) == ["default", "flash"] and data["over_default"]["default"] == 1.0
    assert data["best_over_default"] == min(data["over_default"].values())
    assert data["unavailable"] == ["cudnn", "efficient"]
    for name in ("default", "flash"):
        errors = data["max_error_vs_fp32_math"][name]
        assert set(errors) == {"out", "dq", "dk", "dv"}
        assert all(0 < e < 0.1 for e in errors.values()), errors   # bf16 round-off only
    assert "fastest / default:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        bench_attention_backends.main(["--seq", "0"])
    assert stop.value.code == 2 and "--seq must be >= 1" in capsys.readouterr().err


def test_bench_wgrad_fusion_accumulates_the_same_sums_both_ways(tmp_path, capsys):
    """Both paths add the same weight gradients into fp32 main_grad; the fused one (on CPU an
    fp32 GEMM) skips the bf16 rounding of each gradient, so it lies far closer to fp64."""
    out = tmp_path / "wgrad.json"
    assert bench_wgrad_fusion.main(["--tokens", "64", "--hidden", "16", "--rounds", "2",
                                    "--warmup", "1", "--json", str(out)]) == 0
    data = _written(out, "bench_wgrad_fusion")
    assert data["shape"]["linears"] == {"qkv": [48, 16], "proj": [16, 16], "fc1": [64, 16],
                                        "fc2": [16, 64]}
    assert data["fused_over_add"] == pytest.approx(data["ms"]["fused"] / data["ms"]["add"])
    error = data["max_error_vs_fp64"]
    assert error["fused"] < 1e-3 < error["add"] < 1.0, error
    assert "fused / add:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        bench_wgrad_fusion.main(["--tokens", "0"])
    assert stop.value.code == 2 and "--tokens must be >= 1" in capsys.readouterr().err


def test_bench_sequence_parallel_shards_by_t(tmp_path):
    assert bench_sequence_parallel.main(["--tensor", "2", "--hidden", "32", "--heads", "4",
                                         "--seq", "16", "--batch", "2", "--out",
                                         str(tmp_path)]) == 0
    rows = _written(tmp_path / "activation_memory.json", "bench_sequence_parallel")["rows"]
    assert [(r["t"], r["sequence_parallel"]) for r in rows] == [(2, False), (2, True)]
    assert rows[0]["sharded_ratio"] == 1.0 and rows[1]["sharded_ratio"] > 2.0
    assert all(r["ranks_equal"] for r in rows)


def test_bench_zero_bubble_measures_both_schedules(tmp_path):
    assert bench_zero_bubble.main(["--p", "2", "--m", "2", "--layers", "2", "--hidden", "32",
                                   "--seq", "16", "--micro-batch", "1", "--repeats", "1",
                                   "--out", str(tmp_path)]) == 0
    results = _written(tmp_path / "zero_bubble.json", "bench_zero_bubble")["results"]
    assert list(results) == ["1f1b", "zb-h1"]
    for r in results.values():
        assert len(r["bubble_per_rank"]) == 2 and r["step_time_s"] > 0
        assert r["bubble_mean"] == pytest.approx(sum(r["bubble_per_rank"]) / 2)
    assert (tmp_path / "zb-h1.json").is_file()   # the trace, for `ptdp timeline`


def test_bench_startup_starts_forked_and_fresh_ranks(tmp_path):
    assert bench_startup.main(["--ranks", "1", "--repeats", "1", "--out", str(tmp_path)]) == 0
    data = _written(tmp_path / "startup.json", "bench_startup")
    (row,) = data["ranks"]
    assert row["ranks"] == 1 and row["forked_s"] > 0 and row["fresh_s"] > 0
    assert row["fresh_peak_mib"] > 0 and row["forked_peak_mib"] > 0
    assert [r["schedule"] for r in data["simulation"]] == ["1f1b", "interleaved", "2bw",
                                                           "pipedream"]
    assert all(r["speedup"] == r["fraction_s"] / r["exact_s"] for r in data["simulation"])


def test_bench_context_saves_and_sends_per_rank(tmp_path, memory_env, forked_ranks, capsys):
    assert bench_context.main(["--out", str(tmp_path), "--seqs", "32", "--contexts", "2",
                               "--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads",
                               "2", "--ffn", "64", "--vocab", "128", "--iters", "2",
                               "--timeout", "120"]) == 0
    assert "pred_step_MB" in capsys.readouterr().out
    (row,) = _written(tmp_path / "context.json", "bench_context")["rows"]
    assert (row["seq"], row["c"], len(row["ranks"])) == (32, 2, 2)
    assert row["saved_bytes"] > 0 and row["ring_bytes_per_iter"] > 0 and row["step_s"] > 0
    assert row["saved_vs_c1"] == row["pred_saved_vs_c1"] == 1.0   # c = 2 is its own base


def test_bench_distributed_optimizer_counts_adams_state(tmp_path, memory_env, forked_ranks,
                                                        capsys):
    assert bench_distributed_optimizer.main([
        "--out", str(tmp_path), "--data", "1", "--precisions", "fp32", "--layers", "1",
        "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "128", "--global-batch", "2",
        "--iters", "2", "--timeout", "120"]) == 0
    assert "predicted_MB" in capsys.readouterr().out
    (row,) = _written(tmp_path / "distributed_optimizer.json",
                      "bench_distributed_optimizer")["rows"]
    (rank,) = row["ranks"]
    assert row["state_bytes_max"] == 8 * rank["params"]   # fp32: Adam's two moments, no masters
    assert row["predicted_bytes"] == row["state_bytes_max"] and row["state_ratio_vs_d1"] == 1.0


def test_bench_checkpoint_times_sync_and_async_saves(tmp_path, monkeypatch, forked_ranks, capsys):
    monkeypatch.setattr(bench_checkpoint, "MODEL", TINY)
    assert bench_checkpoint.main(["--iters", "4", "--interval", "2", "--out",
                                  str(tmp_path / "ckpt")]) == 0
    assert "stall/save s (median)" in capsys.readouterr().out
    data = _written(tmp_path / "ckpt.json", "bench_checkpoint")
    assert set(data["summary"]) == {"sync", "async"} and data["ratio"] > 0
    assert sorted((r["mode"], r["rank"]) for r in data["ranks"]) == [
        ("async", 0), ("async", 1), ("sync", 0), ("sync", 1)]
    for r in data["ranks"]:
        assert len(r["stall_s"]) == 2 and all(s > 0 for s in r["stall_s"])   # iterations 2, 4
        assert len(r["publish_s"]) == (2 if r["mode"] == "async" else 0)
    verify = data["verification"]   # checksums: the files of iteration 4 (2 shards, 2 RNG files)
    assert verify["files"] == 4 and verify["bytes"] > 0 and verify["crc32_s"] > 0


def test_validate_planner_probes_the_speed_and_compares(tmp_path, monkeypatch, forked_ranks,
                                                       capsys):
    """Its whole path on one layout, the speed probe included, with a profile of this machine
    (the planner's profile for the test model, said to be measured here) and a tiny model."""
    from ptdp.hardware import load_hardware, machine_fingerprint, save_hardware
    profile = tmp_path / "cpu-here.yaml"
    save_hardware(dataclasses.replace(load_hardware("cpu-local"),
                                      fingerprint=machine_fingerprint()), profile)
    monkeypatch.setattr(validate_planner, "MODEL", {
        "arch": "gpt", "num_layers": 2, "hidden_size": 32, "num_heads": 2, "seq_length": 16,
        "vocab_size": 128, "dropout": 0.0, "ffn_hidden_size": 64})
    assert validate_planner.main(["--profile", str(profile), "--layouts", "single", "--iters",
                                  "2", "--rounds", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "speed probe (one layer fwd+bwd, b=1/2/4)" in out
    data = _written(tmp_path / "validate_planner.json", "validate_planner")
    (row,) = data["rows"]
    assert row["layout"] == "single" and row["measured_step"] > 0 and row["measured_mem"] > 0
    assert math.isfinite(row["step_error"]) and 0 < row["speed_drift"] < 1   # a tinier layer
    assert_picture(tmp_path / "validate_planner.png", out)   # or why there is none
