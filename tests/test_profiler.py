"""`ptdp profile` on this machine's CPU, and the fits it uses."""

import subprocess
import sys

import pytest
import yaml

from ptdp.planner.compute import ModelShape, layer_times
from ptdp.planner.cost_model import Layout, Workload, predict
from ptdp.hardware import foreign_profile, load_hardware, machine_fingerprint
from ptdp.planner.memory import layer_activation_bytes
from ptdp.profiler.calibration import RESERVE_RUNS
from ptdp.profiler.build import _assemble
from ptdp.profiler.kernels import fit_half_dim
from ptdp.profiler.collectives import fit_latency_bandwidth
from tests.deadline import within

TINY = {"model": {"arch": "gpt", "num_layers": 2, "hidden_size": 64, "num_heads": 4,
                  "seq_length": 32, "vocab_size": 100, "ffn_hidden_size": 256}}


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    """`ptdp profile`'s command (ptdp.cli.main) in this process, which has torch imported and
    usually a fork server for its ranks running already (seconds of CPU each as a fresh
    `python -m ptdp`; test_bad_profile_arguments runs that). What the command changes in its
    process is put back: torch's threads, the environment; its
    one-process group it destroys itself. A group left by another test would be taken over
    and destroyed: then it runs as its own process, as before."""
    import os

    import torch
    import torch.distributed as dist

    from ptdp.cli import main
    tmp = tmp_path_factory.mktemp("profile")
    model = tmp / "tiny.yaml"
    model.write_text(yaml.safe_dump(TINY))
    out = tmp / "cpu-test.yaml"
    args = ["profile", str(model), "--out", str(out), "--micro-batches", "1,2", "--tensor", "1,2",
            "--ranks", "2", "--iters", "2", "--memory-repeats", "1"]
    if dist.is_initialized():
        proc = subprocess.run([sys.executable, "-m", "ptdp", *args], capture_output=True,
                              text=True, timeout=within(240))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out
    environ, threads = dict(os.environ), torch.get_num_threads()
    try:
        assert main(args) == 0
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
    assert not dist.is_initialized()
    return out


@pytest.mark.timeout(300)
def test_profile_is_a_usable_hardware_profile(profile_path):
    hw = load_hardware(str(profile_path))
    assert hw.source == "measured" and hw.device == "cpu" and hw.compute_units >= 1
    rows = hw.measured["layers"]
    assert {(r["tensor"], r["micro_batch"]) for r in rows} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in rows)
    assert hw.measured["p2p"]["bandwidth_GBps"] > 0 and hw.intra_node_bandwidth_GBps > 0
    assert hw.fingerprint == machine_fingerprint() and foreign_profile(hw) is None
    # The cost model uses the measured rows for this exact shape.
    shape = ModelShape("gpt", 2, 64, 4, 256, 32, 100, False)
    row = next(r for r in rows if r["tensor"] == 2 and r["micro_batch"] == 2)
    assert layer_times(hw, "fp32", shape, 2, 2, "flash").forward == pytest.approx(row["forward_s"])
    pred = predict(hw, Workload(shape, 8, "fp32", hw.gpus_per_node), Layout(2, 1, 1, micro_batch=2))
    assert pred.fits and pred.step_time_s > 0


@pytest.mark.timeout(300)
def test_profile_measures_what_cpu_ranks_pay_beyond_compute(profile_path):
    hw = load_hardware(str(profile_path))
    # The trainer's own cost beyond the kernels, and its split backward's, on one rank.
    assert hw.measured["layer_overhead_s"] >= 0 and hw.measured["split_backward_overhead_s"] >= 0
    # zb-h1's split backward, for layers, embedding and head.
    assert all(r["backward_split_s"] > 0 for r in hw.measured["layers"])
    assert all(r["head_backward_split_s"] > 0 and r["embed_backward_split_s"] > 0
               for r in hw.measured["heads"])
    # Each collective the trainer calls, fitted on its own, on every busy world.
    for row in hw.measured["busy"]:
        for kind in ("all_reduce", "reduce_scatter", "all_gather"):
            assert [fit["group"] for fit in row[kind]] == [2] and row[kind][0]["bandwidth_GBps"] > 0
    # A t = 2 layer on 2 busy ranks, with and without sequence parallelism, for each b.
    rows = hw.measured["tensor_layers"]
    assert {(r["tensor"], r["world"], r["micro_batch"], r["sequence_parallel"]) for r in rows} == {
        (2, 2, b, sp) for b in (1, 2) for sp in (False, True)}
    assert all(r["layer_s"] > 0 and r["comm_s"] >= 0 for r in rows)
    # The reserve and the heap's growth with a micro-batch's activations, from real runs
    # (the 2-layer model cannot be split into p2v2's 4 chunks).
    calibration = hw.measured["memory_calibration"]
    assert set(calibration["runs"]) == set(RESERVE_RUNS) - {"p2v2"}
    assert hw.memory_reserved_gb == pytest.approx(calibration["reserve_gb"], abs=1e-4)
    assert hw.memory_reserved_gb > 0
    assert hw.measured["heap_retention"] == pytest.approx(calibration["heap_retention"], abs=1e-4)
    assert calibration["runs"]["p2-2bw-b4"]["activations_gb"] == pytest.approx(
        4 * calibration["runs"]["p2-2bw"]["activations_gb"])


@pytest.mark.timeout(300)
def test_measured_activations_match_the_memory_formula(profile_path):
    # Saved-tensor bytes of the real layer vs memory.py's breakdown (flash attention on CPU,
    # no dropout): the formula should be within 15% of what autograd actually keeps.
    hw = load_hardware(str(profile_path))
    shape = ModelShape("gpt", 2, 64, 4, 256, 32, 100, False)
    for row in hw.measured["layers"]:
        t, b = row["tensor"], row["micro_batch"]
        for mode in ("none", "full"):
            formula = layer_activation_bytes(shape, b, t, "fp32", mode, "flash")
            assert row[f"activation_bytes_{mode}"] == pytest.approx(formula, rel=0.15), (t, b, mode)


@pytest.mark.timeout(300)
def test_plan_runs_on_the_measured_profile(profile_path, tmp_path):
    model = tmp_path / "tiny.yaml"
    model.write_text(yaml.safe_dump(TINY))
    proc = subprocess.run([sys.executable, "-m", "ptdp", "plan", str(model), "--hardware",
                           str(profile_path), "--gpus", "4", "--global-batch-size", "8", "--json"],
                          capture_output=True, text=True, timeout=within(120))
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["precision"] == "fp32"
    assert "warning" not in proc.stderr     # measured here: not foreign


def test_a_gpu_profile_keeps_the_datasheet_peak():
    # One peak per device: the planner's MFU and the trainer's `mfu` divide by the same
    # (datasheet) number; the measured GEMM rate becomes the achievable share, gemm_max.
    dev = {"peak_flops": 700e12, "half_dim": 32, "launch_s": 5e-6, "memory_Bps": 3.0e12}
    profile = _assemble("h100-here", None, "bf16", dev, None, {"layers": []}, 8, "h100-80gb")
    assert profile.peak_tflops["bf16"] == load_hardware("h100-80gb").peak_tflops["bf16"] == 989
    assert profile.efficiency.gemm_max == pytest.approx(700 / 989)
    assert profile.fingerprint == machine_fingerprint()


def test_fits_recover_known_parameters():
    points = [(n, 1e-4 + n / 2e9) for n in (1e3, 1e5, 1e6, 1e7)]
    per_byte, latency = fit_latency_bandwidth(points)
    assert 1 / per_byte == pytest.approx(2e9, rel=1e-6) and latency == pytest.approx(1e-4, rel=1e-3)
    peak, half = 1e11, 64
    samples = []
    for shape in [(32, 32, 32), (128, 64, 256), (512, 512, 512), (1024, 32, 256)]:
        m, n, k = shape
        sat = (m / (m + half)) * (n / (n + half)) * (k / (k + half))
        samples.append((shape, 2 * m * n * k / (peak * sat) + 5e-6))
    assert fit_half_dim(samples, peak, 5e-6) == half


def test_bad_profile_arguments(tmp_path):
    model = tmp_path / "tiny.yaml"
    model.write_text(yaml.safe_dump(TINY))
    proc = subprocess.run([sys.executable, "-m", "ptdp", "profile", str(model), "--out",
                           str(tmp_path / "x.yaml"), "--tensor", "3"],
                          capture_output=True, text=True, timeout=within(120))
    assert proc.returncode == 2 and "--tensor 3" in proc.stderr and "Traceback" not in proc.stderr


def test_memory_repeats_below_one_is_refused_before_any_measurement():
    from pathlib import Path
    from types import SimpleNamespace

    from ptdp.planner.errors import PlanError
    from ptdp.profiler.build import _profile_from_args
    with pytest.raises(PlanError, match="--memory-repeats 0: run each memory calibration"):
        _profile_from_args(None, SimpleNamespace(memory_repeats=0), Path("x.yaml"))


def test_the_one_process_group_needs_no_free_port():
    """Four GPU tests at once once lost a port found free to another process before the
    profiler's store could listen on it (EADDRINUSE). Its group's store lives in the process:
    here every port the old way could pick is taken, and the group still forms."""
    script = """
import socket
import torch, torch.distributed as dist
import ptdp.runtime.local_ranks as local_ranks
taken = socket.socket(); taken.bind(("127.0.0.1", 0)); taken.listen()
local_ranks.free_port = lambda: taken.getsockname()[1]   # the race, lost every time
from ptdp.profiler.timing import ensure_process_group
ensure_process_group()
x = torch.ones(2); dist.all_reduce(x); dist.destroy_process_group()
print("formed", x.tolist())
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "formed [1.0, 1.0]" in run.stdout, run.stderr[-2000:]
