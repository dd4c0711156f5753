"""Benchmark (not a test): uneven pipeline stages against the even split, on CPU ranks.

A GPT with a large vocabulary (default p = 4, 8 layers, h = 256, V = 32k) spends as much on
its output layer and loss as on several layers, so even stages leave the last rank slowest.
The planner's split (`ptdp plan`'s: the partitioner's program over per-layer costs with the
embedding and the head, ptdp/planner/stage_plan.py, for the hardware profile --hardware) is
timed against the even split and every split one layer away from the planner's, in the same
run: the candidates alternate for --repeats rounds (the machine's load drifts); each one's
step time is the fastest over rounds and its timed iterations (the first is warm-up), which
other processes on the machine can only slow down, with the median beside it.

    python tools/bench_uneven.py --threads 4 --out bench/uneven
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__:      # python -m tools.bench_uneven, or imported by a test
    from . import harness
else:                # python tools/bench_uneven.py (tools/harness.py says why)
    import harness


def train(overrides: list[str]) -> list[float]:
    """On every rank: train, return the step times."""
    import torch.distributed as dist
    from ptdp.config import load_config
    from ptdp.training import Trainer
    trainer = Trainer(load_config(None, overrides, world_size=dist.get_world_size()))
    return [r["step_time_s"] for r in trainer.train()]


def model_overrides(a) -> list[str]:
    return [f"model.num_layers={a.layers}", f"model.hidden_size={a.hidden}", "model.num_heads=8",
            f"model.seq_length={a.seq}", f"model.vocab_size={a.vocab}", "model.dropout=0.0"]


def planner_split(a):
    """The planner's StagePlan for this model and layout (ptdp/planner/stage_plan.py) and the
    per-layer costs it split."""
    from ptdp.config import load_config
    from ptdp.hardware import load_hardware
    from ptdp.planner.compute import ModelShape
    from ptdp.planner.cost_model import Layout, Workload, predict
    from ptdp.planner.stage_plan import layer_profiles, plan_stages
    cfg = load_config(None, model_overrides(a), world_size=1)
    hw = load_hardware(a.hardware)
    work = Workload(ModelShape.from_config(cfg.model), a.micro_batch * a.m, "fp32", a.p)
    lay = Layout(pipeline=a.p, micro_batch=a.micro_batch, schedule="1f1b")
    return plan_stages(hw, work, predict(hw, work, lay)), layer_profiles(hw, work, lay)


def neighbours(split: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every split one layer away: a layer moved from one stage to another (a middle stage
    keeps at least one, ptdp/config/stages.py)."""
    out = []
    for src in range(len(split)):
        for dst in range(len(split)):
            moved = list(split)
            moved[src] -= 1
            moved[dst] += 1
            middle = moved[1:-1]
            if src != dst and moved[src] >= 0 and all(n >= 1 for n in middle):
                out.append(tuple(moved))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=8, help="micro-batches per iteration")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--iters", type=int, default=4, help="per run; the first is warm-up")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--hardware", default="cpu-local", help="the planner's profile")
    ap.add_argument("--out", default="bench/uneven")
    a = ap.parse_args(argv)
    from ptdp.runtime.local_ranks import run_on_ranks
    plan, profiles = planner_split(a)
    even, planned = plan.even, plan.planned
    candidates = list(dict.fromkeys([even, planned, *neighbours(planned)]))
    common = model_overrides(a) + [
        f"parallel.pipeline={a.p}", "parallel.data=1", "schedule.name=1f1b",
        f"train.micro_batch_size={a.micro_batch}", f"train.global_batch_size={a.micro_batch * a.m}",
        f"train.iters={a.iters}", "train.device=cpu", "train.compile=false",
        "log.progress=false", "log.interval=1000000", "train.timeout_s=600"]
    times = {split: [] for split in candidates}
    for _ in range(a.repeats):
        for split in candidates:
            layers = ",".join(map(str, split))
            steps = run_on_ranks(a.p, train, common + [f"parallel.stage_layers=[{layers}]"],
                                 timeout_s=1800, threads=a.threads)[0]
            times[split] += steps[1:]
    rows = _rows(times, plan, profiles)
    fastest = min(rows, key=lambda r: r["step_time_s"])
    by_split = {tuple(r["stage_layers"]): r for r in rows}
    summary = {
        "even": list(even), "planned": list(planned), "fastest": fastest["stage_layers"],
        "predicted_gain": plan.saving_s / plan.step_time_s,
        "measured_gain": 1 - by_split[planned]["step_time_s"] / by_split[even]["step_time_s"],
        "planned_vs_fastest": by_split[planned]["step_time_s"] / fastest["step_time_s"] - 1}
    print(f"uneven stages on {a.p} CPU ranks ({a.threads} thread(s) each): GPT {a.layers} layers "
          f"h={a.hidden} s={a.seq} V={a.vocab} b={a.micro_batch} m={a.m}, 1f1b; fastest (and "
          f"median) step of {a.repeats} rounds x {a.iters - 1} iterations; planner's profile "
          f"{a.hardware}")
    print(harness.table(["stage_layers", "predicted slowest stage ms", "step s", "median s",
                         "vs even", ""],
                        [[str(r["stage_layers"]), f"{r['predicted_slowest_ms']:.1f}",
                          f"{r['step_time_s']:.3f}", f"{r['median_step_time_s']:.3f}",
                          f"{r['vs_even']:+.1%}", r["role"]]
                         for r in rows]))
    print(f"planner: {list(planned)}, predicted {summary['predicted_gain']:.1%} faster than "
          f"even, measured {summary['measured_gain']:.1%}; "
          f"{summary['planned_vs_fastest']:+.1%} against the fastest {fastest['stage_layers']}")
    path = harness.write_json(Path(a.out) / "uneven.json",
                              {"args": vars(a), "summary": summary, "results": rows},
                              tool=__file__, argv=argv)
    print(f"wrote {path}")
    return 0


def _rows(times: dict, plan, profiles) -> list[dict]:
    from ptdp.planner.partitioner import stage_times
    even_step = min(times[plan.even])
    rows = []
    for split, steps in times.items():
        step = min(steps)
        roles = [name for name, of in (("even", plan.even), ("planner", plan.planned))
                 if split == of]
        rows.append({"stage_layers": list(split), "step_time_s": step,
                     "median_step_time_s": statistics.median(steps), "steps": steps,
                     "vs_even": step / even_step - 1, "role": " + ".join(roles),
                     "predicted_slowest_ms": max(stage_times(profiles, list(split))) * 1e3})
    return rows


if __name__ == "__main__":
    sys.exit(main())
