#!/usr/bin/env python
"""Validate the planner's cost model against real runs on local CPU ranks.

For each layout: predict step time and memory per rank with the measured CPU profile, then
train a few iterations with `ptdp.training.Trainer` on gloo ranks and compare with the
metrics it reports (median `step_time_s` after a warm-up iteration, peak `mem_gb` over ranks).

    python tools/validate_planner.py                      # profile if needed, run all layouts
    python tools/validate_planner.py --reprofile --iters 6 --repeat 3
    python tools/validate_planner.py --layouts p2,t2 --check   # exit 1 if any error > 15%

The profile is measured for the validation model with 1 thread per rank; ranks beyond the
machine's cores share them (the cost model scales compute by the oversubscription).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ptdp.config import config_from_dict, validate  # noqa: E402
from ptdp.planner.compute import ModelShape  # noqa: E402
from ptdp.planner.cost_model import Layout, Workload, predict  # noqa: E402
from ptdp.hardware import load_hardware  # noqa: E402

MODEL = {"arch": "gpt", "num_layers": 4, "hidden_size": 512, "num_heads": 8,
         "seq_length": 128, "vocab_size": 1000, "dropout": 0.0}
GLOBAL_BATCH = 8

# name -> (p, t, d, v, b, schedule, recompute, scatter_gather)
LAYOUTS = {
    "single":      Layout(1, 1, 1, 1, 2, "1f1b", "none", False),
    "d2":          Layout(1, 1, 2, 1, 2, "1f1b", "none", False),
    "t2":          Layout(1, 2, 1, 1, 2, "1f1b", "none", False),
    "p2":          Layout(2, 1, 1, 1, 1, "1f1b", "none", False),
    "p2-gpipe":    Layout(2, 1, 1, 1, 2, "gpipe", "none", False),
    "p2-full":     Layout(2, 1, 1, 1, 2, "1f1b", "full", False),
    "p2v2":        Layout(2, 1, 1, 2, 1, "interleaved", "none", False),
    "p2t2":        Layout(2, 2, 1, 1, 2, "1f1b", "none", False),
    "d2t2":        Layout(1, 2, 2, 1, 2, "1f1b", "none", False),
    "p2-2bw":      Layout(2, 1, 1, 1, 1, "2bw", "none", False),
    "p2-2bw-b2":   Layout(2, 1, 1, 1, 2, "2bw", "none", False),
    "p2t2-2bw":    Layout(2, 2, 1, 1, 2, "2bw", "none", False),
}
TOLERANCE = 0.15


def config_dict(layout: Layout, iters: int) -> dict:
    return {
        "model": dict(MODEL),
        "parallel": {"tensor": layout.tensor, "pipeline": layout.pipeline, "data": layout.data,
                     "chunks": layout.chunks, "scatter_gather": layout.scatter_gather},
        "schedule": {"name": layout.schedule},
        "train": {"micro_batch_size": layout.micro_batch, "global_batch_size": GLOBAL_BATCH,
                  "iters": iters, "recompute": layout.recompute, "precision": "fp32",
                  "device": "cpu", "lr_warmup_iters": 0},
        "data": {"source": "synthetic"},
        "log": {"progress": False, "interval": 1000},
    }


def train_worker(raw: dict) -> list[dict]:
    """Runs on every rank (module-level so spawned processes can import it)."""
    import contextlib
    import os

    import torch.distributed as dist
    from ptdp.training import Trainer
    cfg = config_from_dict(raw)
    validate(cfg, dist.get_world_size())
    from ptdp.profiler import peak_rss_gb
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        history = Trainer(cfg).train()
    return {"history": history, "peak_gb": peak_rss_gb()}


def measure(layout: Layout, iters: int, timeout_s: float) -> tuple[float, float]:
    """(fastest step seconds after the first iteration, peak memory GiB over ranks).

    The fastest step, like the profiler's best-of-N timings, discounts time other processes
    on a shared machine steal; the first iteration (allocations, Adam state) is skipped.
    Memory is each rank's VmHWM: the trainer's mem_gb on CPU (getrusage ru_maxrss) inherits
    the launching process's peak across fork+exec."""
    from ptdp.local_ranks import run_on_ranks
    results = run_on_ranks(layout.gpus, train_worker, config_dict(layout, iters),
                           timeout_s=timeout_s, threads=1)
    steps = [record["step_time_s"] for record in results[0]["history"][1:]]
    return min(steps), max(r["peak_gb"] for r in results)


def ensure_profile(path: Path, reprofile: bool, iters: int):
    """Load the profile, measuring it first (in a child process, `ptdp profile`) if asked."""
    if path.is_file() and not reprofile:
        return load_hardware(str(path))
    import subprocess
    import tempfile
    micro_batches = sorted({lay.micro_batch for lay in LAYOUTS.values()} | {4})
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as model_file:
        yaml.safe_dump({"model": {**MODEL, "ffn_hidden_size": 4 * MODEL["hidden_size"]}}, model_file)
    subprocess.run([sys.executable, "-m", "ptdp", "profile", model_file.name, "--out", str(path),
                    "--micro-batches", ",".join(map(str, micro_batches)), "--tensor", "1,2",
                    "--ranks", "2", "--ranks-per-node", "8", "--threads", "1",
                    "--iters", str(iters)], check=True, cwd=ROOT)
    os.unlink(model_file.name)
    return load_hardware(str(path))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(ROOT / "configs" / "hardware" / "cpu-local.yaml"))
    parser.add_argument("--reprofile", action="store_true", help="measure the profile again")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated subset of {', '.join(LAYOUTS)}")
    parser.add_argument("--iters", type=int, default=5, help="training iterations per run")
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs per layout; the fastest step over all runs is compared")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per layout")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if any error > {TOLERANCE:.0%}")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    hw = ensure_profile(Path(args.profile), args.reprofile, iters=7)
    shape = ModelShape.from_config(config_from_dict({"model": {**MODEL, "ffn_hidden_size": 4 * MODEL["hidden_size"]}}).model)
    work = Workload(shape, GLOBAL_BATCH, "fp32", hw.gpus_per_node)
    header = (f"{'layout':<10} {'ranks':>5} {'pred_s':>8} {'meas_s':>8} {'err':>7} "
              f"{'pred_GB':>8} {'meas_GB':>8} {'err':>7}")
    print(f"profile {hw.name} ({hw.description}); model {MODEL}, B={GLOBAL_BATCH}")
    print(header)
    rows, worst = [], 0.0
    for name in names:
        layout = LAYOUTS[name]
        pred = predict(hw, work, layout)
        runs = [measure(layout, args.iters, args.timeout) for _ in range(max(1, args.repeat))]
        step, mem = min(r[0] for r in runs), max(r[1] for r in runs)
        t_err = pred.step_time_s / step - 1
        m_err = pred.memory_gb_per_gpu / mem - 1
        worst = max(worst, abs(t_err), abs(m_err))
        rows.append({"layout": name, "ranks": layout.gpus, "predicted_step_s": pred.step_time_s,
                     "measured_step_s": step, "step_error": t_err,
                     "predicted_mem_gb": pred.memory_gb_per_gpu, "measured_mem_gb": mem,
                     "mem_error": m_err})
        print(f"{name:<10} {layout.gpus:>5} {pred.step_time_s:>8.3f} {step:>8.3f} {t_err:>+7.1%} "
              f"{pred.memory_gb_per_gpu:>8.3f} {mem:>8.3f} {m_err:>+7.1%}", flush=True)
    mean_t = statistics.mean(abs(r["step_error"]) for r in rows)
    mean_m = statistics.mean(abs(r["mem_error"]) for r in rows)
    print(f"mean |error|: step {mean_t:.1%}, memory {mean_m:.1%}; worst {worst:.1%} "
          f"(target {TOLERANCE:.0%})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 1 if args.check and worst > TOLERANCE else 0


if __name__ == "__main__":
    sys.exit(main())
