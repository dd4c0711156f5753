#!/usr/bin/env python
"""Validate the planner's cost model against real runs on local CPU ranks.

For each layout: predict step time and peak memory per rank from a CPU profile measured on
this machine, train a few iterations with `ptdp.training.Trainer` on gloo ranks and compare.

    python tools/validate_planner.py                          # every layout, 3 interleaved rounds
    python tools/validate_planner.py --layouts p2,t2 --check  # exit 1 if any error > 15 %
    python tools/validate_planner.py --ranking                # planner's first choice of 8 ranks
                                                              # against the fastest measured

Measuring on a shared machine: every round runs each layout once, in turn (interleaved), so a
burst of load from elsewhere hits all layouts alike instead of one; a run's step time is the
median of its iterations after the first, the layout's the median over rounds; the spread
between rounds and the load average are written with the results. Memory is each rank's VmHWM
(peak resident set), the largest over ranks and rounds.

Drift: a shared virtual machine's speed drifts by up to ~20 % within minutes (measured here:
one layer's forward+backward took 36 ms during a profile and 43-44 ms ten minutes later, steady
for minutes after). A profile taken at one speed and runs at another would show that drift as
prediction error. So before each round and after the last, the tool times the profile's
reference layer again at b = 1, 2, 4 (the same `measure_layer` call) and scales the profile's
compute times by the median ratio (over b, then over probes) before predicting; communication
stays as measured. The factor is printed and written with the rows; `--no-drift` turns the
correction off.

The profile must come from this machine: one measured elsewhere (its fingerprint differs, or
it has none) is not used; the tool measures a fresh one (`ptdp profile`, 1 thread per rank)
into --out and says so. Results: OUT/validate_planner.json (rows with `layout`, `step_error`
and `mem_error`) and OUT/validate_planner.png (predicted against measured; matplotlib, `pip
install 'ptdp[plot]'`: without it only the JSON).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from ptdp.config import config_from_dict, validate
from ptdp.hardware import foreign_profile, load_hardware, machine_fingerprint
from ptdp.planner.compute import ModelShape
from ptdp.planner.cost_model import Layout, Workload, predict
from ptdp.planner.search import search

if __package__:      # python -m tools.validate_planner, or imported by a test
    from . import harness
else:                # python tools/validate_planner.py (tools/harness.py says why)
    import harness

ROOT = Path(__file__).resolve().parents[1]   # the checkout: bench/planner/ by default

MODEL = {"arch": "gpt", "num_layers": 4, "hidden_size": 512, "num_heads": 8,
         "seq_length": 128, "vocab_size": 1000, "dropout": 0.0, "ffn_hidden_size": 2048}
GLOBAL_BATCH = 8

# name -> (p, t, d, v, b, schedule, recompute, scatter_gather[, distributed_optimizer])
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
    "d2-distopt":  Layout(1, 1, 2, 1, 2, "1f1b", "none", False, True),
    "d2t2-distopt": Layout(1, 2, 2, 1, 2, "1f1b", "none", False, True),
    "p2t2-sp":     Layout(2, 2, 1, 1, 2, "1f1b", "none", sequence_parallel=True),
    "p2-zb":       Layout(2, 1, 1, 1, 1, "zb-h1", "none", False),
    "p2t2-zb-sp":  Layout(2, 2, 1, 1, 2, "zb-h1", "none", sequence_parallel=True),
}
TOLERANCE = 0.15          # step time, either side
MEMORY_UNDER = 0.03       # memory may be over-predicted, but under by at most this
NO_PICTURE = "matplotlib missing: no picture (pip install 'ptdp[plot]')"


def config_dict(layout: Layout, iters: int) -> dict:
    return {
        "model": dict(MODEL),
        "parallel": {"tensor": layout.tensor, "pipeline": layout.pipeline, "data": layout.data,
                     "chunks": layout.chunks, "scatter_gather": layout.scatter_gather,
                     "sequence_parallel": layout.sequence_parallel},
        "schedule": {"name": layout.schedule},
        "train": {"micro_batch_size": layout.micro_batch, "global_batch_size": GLOBAL_BATCH,
                  "iters": iters, "recompute": layout.recompute, "precision": "fp32",
                  "device": "cpu", "lr_warmup_iters": 0,
                  "distributed_optimizer": layout.distributed_optimizer},
        "data": {"source": "synthetic"},
        "log": {"progress": False, "interval": 1000},
    }


def train_worker(raw: dict) -> dict:
    """Runs on every rank (module-level so spawned processes can import it)."""
    import contextlib

    import torch.distributed as dist
    from ptdp.runtime.process_memory import peak_rss_gb
    from ptdp.training import Trainer
    cfg = config_from_dict(raw)
    validate(cfg, dist.get_world_size())
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        history = Trainer(cfg).train()
    return {"history": history, "peak_gb": peak_rss_gb()}


def measure_once(layout: Layout, iters: int, timeout_s: float) -> tuple[float, float]:
    """(median step seconds after the first iteration, peak GiB over ranks) of one run.
    Memory is each rank's VmHWM: the trainer's mem_gb on CPU can inherit the launcher's
    peak across fork+exec."""
    from ptdp.runtime.local_ranks import RankFailure, run_on_ranks
    for attempt in range(3):
        try:
            results = run_on_ranks(layout.gpus, train_worker, config_dict(layout, iters),
                                   timeout_s=timeout_s, threads=1, fresh_interpreters=True)
            break
        except RankFailure as err:  # another job on the machine took the port first
            if "EADDRINUSE" not in str(err) or attempt == 2:
                raise
    steps = [record["step_time_s"] for record in results[0]["history"][1:]]
    return statistics.median(steps), max(r["peak_gb"] for r in results)


# The probe times the layer at several b: one profile row measured at a slow moment (seen:
# b = 2's forward 25 % over the line through b = 1 and 4) would otherwise skew every layout.
PROBE_BATCHES = (1, 2, 4)


def probe_worker(model: dict) -> dict:
    """b -> one layer's forward + backward at t = 1, timed as `ptdp profile` times it."""
    import torch
    from ptdp.profiler.kernels import measure_layer
    cfg = config_from_dict({"model": model}).model   # run_on_ranks gives the rank its gloo world
    rows = (measure_layer(cfg, 1, b, "fp32", torch.device("cpu"), 5) for b in PROBE_BATCHES)
    return {row["micro_batch"]: row["forward_s"] + row["backward_s"] for row in rows}


def speed_probe() -> dict:
    from ptdp.runtime.local_ranks import run_on_ranks
    # A time, not a memory: a rank forked from the server will do (ptdp/runtime/local_ranks.py).
    return run_on_ranks(1, probe_worker, MODEL, timeout_s=300.0, threads=1)[0]


def profile_reference(hw) -> dict:
    """The probe's layers as the profile measured them: b -> seconds."""
    return {r["micro_batch"]: r["forward_s"] + r["backward_s"] for r in hw.measured["layers"]
            if r["tensor"] == 1 and r["micro_batch"] in PROBE_BATCHES}


def speed_ratio(probe: dict, reference: dict) -> float:
    """How much slower the machine is now than in the profile: the median over b."""
    return statistics.median(probe[b] / reference[b] for b in reference if b in probe)


def at_speed(hw, factor: float):
    """The profile with every compute time scaled by `factor` (communication as measured)."""
    import copy
    import dataclasses
    measured = copy.deepcopy(hw.measured)
    for table in ("layers", "heads"):
        for row in measured.get(table) or []:
            for key in [k for k in row if k.endswith("_s")]:
                row[key] *= factor
    measured["optimizer_s_per_param"] *= factor
    efficiency = dataclasses.replace(
        hw.efficiency, host_overhead_s=hw.efficiency.host_overhead_s * factor)
    return dataclasses.replace(
        hw, measured=measured, efficiency=efficiency,
        peak_tflops={k: v / factor for k, v in hw.peak_tflops.items()},
        memory_bandwidth_GBps=hw.memory_bandwidth_GBps / factor)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def measure_interleaved(layouts: dict, iters: int, rounds: int, timeout_s: float) -> dict:
    """name -> {"steps": [one median per round], "mem": peak GiB, "load": [...]}: round r runs
    every layout once, in an order rotated by r."""
    names = list(layouts)
    out = {n: {"steps": [], "mem": 0.0, "load": []} for n in names}
    out["probes"] = []
    for r in range(rounds):
        out["probes"].append(speed_probe())
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            step, mem = measure_once(layouts[name], iters, timeout_s)
            out[name]["steps"].append(step)
            out[name]["mem"] = max(out[name]["mem"], mem)
            out[name]["load"].append(load_average()[0])
            print(f"  round {r + 1}/{rounds} {name}: {step * 1e3:.1f} ms, {mem:.3f} GiB "
                  f"(load {out[name]['load'][-1]})", flush=True)
    out["probes"].append(speed_probe())
    return out


def profile_here(path: Path, iters: int, ranks: int):
    """Load the profile at `path` when it was measured on this machine, else measure one."""
    if path.is_file():
        hw = load_hardware(str(path))
        foreign = foreign_profile(hw)
        if not foreign:
            return hw
        print(f"warning: {foreign}; measuring this machine instead (into {path})", flush=True)
    micro_batches = sorted({lay.micro_batch for lay in LAYOUTS.values()} | {4})
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as model_file:
        yaml.safe_dump({"model": MODEL}, model_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "ptdp", "profile", model_file.name, "--out",
                        str(path), "--micro-batches", ",".join(map(str, micro_batches)),
                        "--tensor", "1,2,4,8", "--ranks", str(ranks), "--ranks-per-node", "8",
                        "--threads", "1", "--iters", str(iters)], check=True, cwd=ROOT)
    finally:
        os.unlink(model_file.name)
    return load_hardware(str(path))


def workload(hw) -> Workload:
    shape = ModelShape.from_config(config_from_dict({"model": MODEL}).model)
    return Workload(shape, GLOBAL_BATCH, "fp32", hw.gpus_per_node)


def ranking_layouts(hw, ranks: int) -> tuple[Layout, dict]:
    """The planner's first choice for `ranks` ranks, and for every (p, t, d) the planner's
    best layout with that (p, t, d): the candidates the measurement ranks."""
    work = workload(hw)
    best = search(hw, work, ranks, {}).best.layout
    candidates = {}
    for p, t in itertools.product((1, 2, 4), (1, 2, 4, 8)):
        if ranks % (p * t):
            continue
        result = search(hw, work, ranks, {"pipeline": p, "tensor": t})
        if result.ranked:
            lay = result.best.layout
            candidates[f"p{p}t{t}d{lay.data}"] = lay
    return best, candidates


def plot(rows: list[dict], path: Path) -> bool:
    """Predicted against measured, to `path`; False (no picture) without matplotlib, an
    optional extra: the JSON holds the results."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    for ax, key, unit, scale in ((axes[0], "step", "ms", 1e3), (axes[1], "mem", "GiB", 1.0)):
        measured = [r[f"measured_{key}"] * scale for r in rows]
        predicted = [r[f"predicted_{key}"] * scale for r in rows]
        ax.scatter(measured, predicted, s=18)
        for r, x, y in zip(rows, measured, predicted):
            ax.annotate(r["layout"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        hi = max(measured + predicted) * 1.1
        lo = min(measured + predicted) * 0.9
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        band = TOLERANCE if key == "step" else MEMORY_UNDER
        ax.plot([lo, hi], [lo * (1 + band), hi * (1 + band)], "k:", lw=0.6)
        ax.plot([lo, hi], [lo * (1 - band), hi * (1 - band)], "k:", lw=0.6)
        if key == "step":   # layouts span an order of magnitude
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.set_title({"step": "step time", "mem": "peak memory per rank"}[key])
    fig.suptitle("ptdp plan against runs on local CPU ranks (dotted: "
                 f"±{TOLERANCE:.0%} time, ±{MEMORY_UNDER:.0%} memory)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(ROOT / "bench" / "planner" / "cpu-here.yaml"),
                        help="profile of this machine; measured there when missing or foreign")
    parser.add_argument("--reprofile", action="store_true", help="measure the profile again")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated subset of {', '.join(LAYOUTS)}")
    parser.add_argument("--ranking", action="store_true",
                        help="instead: each (p, t, d) of --ranks ranks at the planner's best "
                             "(b, schedule, recompute); is the first choice the fastest?")
    parser.add_argument("--ranks", type=int, default=8, help="ranks for --ranking")
    parser.add_argument("--iters", type=int, default=5, help="training iterations per run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs per layout")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--no-drift", dest="drift", action="store_false",
                        help="do not scale the profile's compute times to the machine's speed "
                             "during the runs (see 'Drift' above)")
    parser.add_argument("--check", action="store_true",
                        help=(f"exit 1 if a step error exceeds {TOLERANCE:.0%} or memory is "
                              f"under-predicted by more than {MEMORY_UNDER:.0%}").replace("%", "%%"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "planner"),
                        help="folder for the JSON and PNG")
    args = parser.parse_args(argv)
    profile_path = Path(args.profile)
    if args.reprofile and profile_path.is_file():
        profile_path.unlink()
    hw = profile_here(profile_path, iters=7, ranks=8)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.ranking:
        return rank_check(hw, args, out, argv)
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    rows = compare(hw, {n: LAYOUTS[n] for n in names}, args)
    write(rows, out / "validate_planner", hw, argv)
    worst_step = max(abs(r["step_error"]) for r in rows)
    worst_under = -min(min(r["mem_error"] for r in rows), 0.0)
    return 1 if args.check and (worst_step > TOLERANCE or worst_under > MEMORY_UNDER) else 0


def compare(hw, layouts: dict, args) -> list[dict]:
    work = workload(hw)
    print(f"profile {hw.name} ({hw.description}); model {MODEL}, B={GLOBAL_BATCH}; "
          f"load average {load_average()}", flush=True)
    measured = measure_interleaved(layouts, args.iters, args.rounds, args.timeout)
    reference = profile_reference(hw)
    ratios = [speed_ratio(probe, reference) for probe in measured["probes"]]
    drift = statistics.median(ratios)
    print(f"speed probe (one layer fwd+bwd, b={'/'.join(map(str, reference))}): profile "
          + "/".join(f"{s * 1e3:.1f}" for s in reference.values()) + " ms, during the runs "
          + ", ".join("/".join(f"{probe[b] * 1e3:.1f}" for b in reference)
                      for probe in measured["probes"])
          + f" ms (x{', x'.join(f'{r:.3f}' for r in ratios)}): "
          + (f"compute times scaled by {drift:.3f}" if args.drift else
             f"x{drift:.3f}, not corrected (--no-drift)"), flush=True)
    if args.drift:
        hw = at_speed(hw, drift)
    rows = []
    print(f"{'layout':<10} {'ranks':>5} {'pred_ms':>8} {'meas_ms':>8} {'spread':>7} {'err':>7} "
          f"{'pred_GiB':>8} {'meas_GiB':>8} {'err':>7}")
    for name, layout in layouts.items():
        pred = predict(hw, work, layout)
        steps = measured[name]["steps"]
        step, mem = statistics.median(steps), measured[name]["mem"]
        spread = (max(steps) - min(steps)) / step
        row = {"layout": name, "ranks": layout.gpus, "predicted_step": pred.step_time_s,
               "measured_step": step, "step_runs": steps, "step_error": pred.step_time_s / step - 1,
               "predicted_mem": pred.memory_gb_per_gpu, "measured_mem": mem,
               "mem_error": pred.memory_gb_per_gpu / mem - 1, "load": measured[name]["load"],
               "speed_drift": drift if args.drift else 1.0}
        rows.append(row)
        print(f"{name:<10} {layout.gpus:>5} {pred.step_time_s * 1e3:>8.1f} {step * 1e3:>8.1f} "
              f"{spread:>7.0%} {row['step_error']:>+7.1%} {pred.memory_gb_per_gpu:>8.3f} "
              f"{mem:>8.3f} {row['mem_error']:>+7.1%}", flush=True)
    abs_step = [abs(r["step_error"]) for r in rows]
    print(f"step |error| mean {statistics.mean(abs_step):.1%}, worst {max(abs_step):.1%} "
          f"(target {TOLERANCE:.0%}); memory error from {min(r['mem_error'] for r in rows):+.1%} "
          f"to {max(r['mem_error'] for r in rows):+.1%} (target: under by at most "
          f"{MEMORY_UNDER:.0%}); load average now {load_average()}")
    return rows


def write(rows: list[dict], stem: Path, hw, argv=None) -> None:
    meta = {"profile": hw.name, "fingerprint": machine_fingerprint(), "model": MODEL,
            "global_batch": GLOBAL_BATCH, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                    time.gmtime())}
    harness.write_json(stem.with_suffix(".json"), {**meta, "rows": rows}, tool=__file__,
                       argv=argv)
    drawn = plot(rows, stem.with_suffix(".png"))
    print(f"wrote {stem.with_suffix('.json')}" + (f" and {stem.with_suffix('.png')}" if drawn
                                                   else f"; {NO_PICTURE}"))


def rank_check(hw, args, out: Path, argv=None) -> int:
    first, candidates = ranking_layouts(hw, args.ranks)
    rows = compare(hw, candidates, args)
    fastest = min(rows, key=lambda r: r["measured_step"])
    chosen = next((r for r in rows if candidates[r["layout"]] == first), None)
    if chosen is None:   # the first choice is the best of its (p, t, d) by construction
        raise RuntimeError(f"planner's first choice {first.describe()} is not among the candidates")
    gap = chosen["measured_step"] / fastest["measured_step"] - 1
    print(f"planner's first choice {first.describe()}: measured {chosen['measured_step'] * 1e3:.1f}"
          f" ms; fastest measured {fastest['layout']} {fastest['measured_step'] * 1e3:.1f} ms "
          f"({gap:+.1%}; target within 10%)")
    for row in rows:
        row["describe"] = candidates[row["layout"]].describe()
    harness.write_json(out / "ranking.json", {
        "first_choice": first.describe(), "fastest_measured": fastest["layout"], "gap": gap,
        "fingerprint": machine_fingerprint(), "rows": rows}, tool=__file__, argv=argv)
    if not plot(rows, out / "ranking.png"):
        print(f"wrote {out / 'ranking.json'}; {NO_PICTURE}")
    return 1 if args.check and gap > 0.10 else 0


if __name__ == "__main__":
    sys.exit(main())
