"""Smoke test of tools/bench_schedules.py (a benchmark, not a test of speed or convergence): it
runs every schedule end to end with the tiniest settings and writes its table, JSON and picture
(without matplotlib, an optional extra, a line saying there is none);
the flushing schedules and 2BW start from the same loss (same weights, same first batch)."""

import json
import subprocess
import sys
from pathlib import Path

from tests.deadline import within
from tests.optional import assert_picture

ROOT = Path(__file__).resolve().parents[1]


def test_bench_schedules_tiny(tmp_path):
    cmd = [sys.executable, str(ROOT / "tools" / "bench_schedules.py"), "--iters", "4",
           "--synthetic", "--out", str(tmp_path), "--timeout", "200"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=within(240), cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "final loss" in run.stdout and "median step ms" in run.stdout
    rows = {r["schedule"]: r for r in json.loads((tmp_path / "schedules.json").read_text())["rows"]}
    assert list(rows) == ["1f1b", "interleaved", "2bw", "pipedream"]
    for r in rows.values():
        assert len(r["losses"]) == len(r["step_times_s"]) == 4
        assert r["median_step_s"] > 0
    first = {name: r["losses"][0] for name, r in rows.items() if name != "pipedream"}
    assert len(set(first.values())) == 1, first
    for x, y in zip(rows["interleaved"]["losses"], rows["1f1b"]["losses"]):   # same updates
        assert abs(x - y) <= 1e-5 * y
    assert_picture(tmp_path / "schedules.png", run.stdout)
