"""tools/validate_planner.py without running ranks: it refuses a profile from elsewhere and
measures this machine instead, its ranking candidates hold the planner's first choice, and it
writes the JSON rows and the picture (without matplotlib, an optional extra, says there is
none)."""

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from ptdp.hardware import load_hardware, machine_fingerprint, save_hardware
from tests.optional import assert_picture

ROOT = Path(__file__).resolve().parents[1]
import tools.validate_planner as vp  # noqa: E402 (tools/ is found from the repository root)


def test_a_foreign_profile_is_measured_again(tmp_path, monkeypatch):
    path = tmp_path / "cpu.yaml"
    foreign = dataclasses.replace(load_hardware("cpu-local"),
                                  fingerprint={**machine_fingerprint(), "cpu": "Elsewhere 9000"})
    save_hardware(foreign, path)
    calls = []

    def fake_profile(cmd, **kwargs):   # stands in for `ptdp profile`: writes a local profile
        calls.append(cmd)
        here = dataclasses.replace(foreign, name="measured-here", fingerprint=machine_fingerprint())
        save_hardware(here, cmd[cmd.index("--out") + 1])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(vp.subprocess, "run", fake_profile)
    hw = vp.profile_here(path, iters=1, ranks=8)
    assert len(calls) == 1 and "profile" in calls[0] and hw.name == "measured-here"
    assert vp.profile_here(path, iters=1, ranks=8).name == "measured-here" and len(calls) == 1


def test_ranking_candidates_hold_the_first_choice():
    hw = load_hardware("cpu-local")
    first, candidates = vp.ranking_layouts(hw, 8)
    assert first in candidates.values()
    assert all(lay.gpus == 8 for lay in candidates.values())
    assert len({(lay.pipeline, lay.tensor, lay.data) for lay in candidates.values()}) == len(candidates)


def test_results_are_written_as_json_and_png(tmp_path, capsys):
    rows = [{"layout": name, "ranks": 2, "predicted_step": 0.1 * (i + 1), "measured_step": 0.11 * (i + 1),
             "step_error": -0.09, "predicted_mem": 0.5, "measured_mem": 0.51, "mem_error": -0.02}
            for i, name in enumerate(("p2", "t2"))]
    vp.write(rows, tmp_path / "validate_planner", load_hardware("cpu-local"))
    data = json.loads((tmp_path / "validate_planner.json").read_text())
    assert [r["layout"] for r in data["rows"]] == ["p2", "t2"]
    assert {"step_error", "mem_error"} <= set(data["rows"][0]) and data["fingerprint"]
    assert_picture(tmp_path / "validate_planner.png", capsys.readouterr().out)
    yaml.safe_dump(data)   # plain data


def test_drift_scales_compute_not_communication():
    hw = load_hardware("cpu-local")
    measured = {"threads": 1, "optimizer_s_per_param": 1e-9,
                "layers": [{"tensor": 1, "micro_batch": 2, "forward_s": 0.01, "backward_s": 0.02,
                            "hidden": 64}],
                "heads": [{"micro_batch": 2, "head_forward_s": 0.004}],
                "busy": [{"ranks": 2, "slowdown": 1.0, "p2p": {"bandwidth_GBps": 3.0}}]}
    hw = dataclasses.replace(hw, measured=measured)
    slow = vp.at_speed(hw, 1.25)
    assert vp.profile_reference(hw) == {2: 0.03}
    assert vp.profile_reference(slow) == {2: pytest.approx(0.0375)}
    assert slow.measured["heads"][0]["head_forward_s"] == pytest.approx(0.005)
    assert slow.measured["optimizer_s_per_param"] == pytest.approx(1.25e-9)
    assert slow.peak_tflops["fp32"] == pytest.approx(hw.peak_tflops["fp32"] / 1.25)
    assert slow.measured["busy"] == measured["busy"] and slow.measured["layers"][0]["hidden"] == 64
    assert hw.measured["layers"][0]["forward_s"] == 0.01   # the original is untouched


def test_speed_is_the_median_over_micro_batches():
    reference = {1: 0.02, 2: 0.05, 4: 0.08}   # b = 2 profiled at a slow moment
    probe = {1: 0.022, 2: 0.044, 4: 0.088}    # the machine 10 % slower now
    assert vp.speed_ratio(probe, reference) == pytest.approx(1.1)
    assert vp.speed_ratio({2: 0.055}, reference) == pytest.approx(1.1)   # only what both have
