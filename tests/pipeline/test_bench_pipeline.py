"""Smoke test of tools/bench_pipeline.py (a benchmark, not a test of speed): it runs end to end
with the tiniest settings, writes its table and JSON, and its side-by-side torch model really is
the same GPT (same first loss; 2BW's first batch runs with the initial weights too), with the
boundary bytes of the formula."""

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.deadline import within

ROOT = Path(__file__).resolve().parents[2]


def test_bench_pipeline_tiny(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench_pipeline.py"), "--p", "2", "--m", "2",
           "--layers", "4", "--hidden", "16", "--heads", "2", "--seq", "8", "--micro-batch", "1",
           "--iters", "1", "--warmup", "1", "--timeout", "120", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=within(180), cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "measured bubble" in run.stdout and "interleaved" in run.stdout
    assert "2bw vs torch's 1F1B" in run.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["schedule"] for r in rows] == ["gpipe", "1f1b", "interleaved", "2bw"]
    assert [r["torch_schedule"] for r in rows] == ["gpipe", "1f1b", "interleaved", "1f1b"]
    for r in rows:
        assert r["torch_error"] is None, r["torch_error"]
        assert r["bytes_per_msg"] == r["bytes_per_msg_formula"] == 1 * 8 * 16 * 4
        assert r["bytes_per_boundary_per_iter"] == r["bytes_per_boundary_per_iter_formula"]
        assert r["formula_bubble"] == (0 if r["schedule"] == "2bw" else 1 / (r["v"] * 2))
        assert r["ours_step_s"] > 0 and r["torch_step_s"] > 0
        assert math.isclose(r["ours_losses"][0], r["torch_losses"][0], rel_tol=1e-5)
