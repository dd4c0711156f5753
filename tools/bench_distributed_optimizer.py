"""Benchmark (not a test): per-rank optimizer-state memory with and without the distributed
optimizer (train.distributed_optimizer, ptdp/optim/distributed.py), on d local CPU ranks.

For each precision and data-parallel size d (p = t = 1, the same model and global batch), one
job trains a few iterations and every rank reports:

* state_MB: the bytes of the tensors its optimizer keeps (fp32 masters held apart from 16-bit
  model weights, and Adam's two moments), counted from the tensors themselves;
* rss_step_MB: how much the process's resident memory grew over the first optimizer step,
  where AdamW allocates its moments (an independent, allocator-level view of the same thing;
  the fp32 master shard of bf16 exists before that step and is not in it). The ranks run with
  MALLOC_MMAP_THRESHOLD_=65536 so that glibc maps every block of 64 KiB or more on its own and
  returns it when freed: otherwise the moments reuse the freed activations of the backward
  and the resident set hides them;
* peak_rss_MB: the rank's peak resident set (VmHWM) over the run;
* predicted_MB: the planner's optimizer term (ptdp/planner/memory.py optimizer_state_bytes);
* step_s: median iteration time after the first (on CPU ranks sharing few cores: indicative).

The table shows the worst rank; the JSON has every rank.

    python tools/bench_distributed_optimizer.py --out bench/distributed_optimizer
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ptdp.runtime.process_memory import process_status_bytes

if __package__:      # python -m tools.bench_distributed_optimizer, or imported by a test
    from . import harness
else:                # python tools/bench_distributed_optimizer.py (tools/harness.py says why)
    import harness

MB = 2**20


def measure(overrides: list[str], iters: int) -> dict:
    """On every rank: train `iters` iterations; optimizer-state bytes, RSS growth, step time."""
    import torch.distributed as dist

    from ptdp.config import load_config
    from ptdp.planner.memory import optimizer_state_bytes
    from ptdp.training import Trainer

    cfg = load_config(None, overrides, world_size=dist.get_world_size())
    trainer = Trainer(cfg)
    rss_step = {}

    def step(it: int) -> None:
        if it > 0:
            trainer.train_step(it)
            return
        # the first step allocates Adam's moments: watch the resident set
        trainer.state.weights.zero_grads()
        result = trainer.step.forward_backward(0)
        norm = trainer.step.reduce_gradients()
        before = process_status_bytes("VmRSS")
        trainer.step.optimizer_step(0, norm)
        rss_step["bytes"] = process_status_bytes("VmRSS") - before
        result.grad_norm = norm
        result.resolve()
    warmup = min(1, iters - 1)   # the first step is timed only when it is the only one
    timed = harness.time_steps(step, iters - warmup, warmup)
    params = sum(p.numel() for p in trainer.state.params)
    return {"rank": trainer.state.grid.rank, "params": params,
            "state_bytes": trainer.state.weights.state_bytes(trainer.state.optimizer),
            "rss_step_bytes": rss_step["bytes"], "peak_rss_bytes": process_status_bytes("VmHWM"),
            "predicted_bytes": optimizer_state_bytes(params, cfg.train.precision, trainer.state.grid.d,
                                                     cfg.train.distributed_optimizer),
            "step_s": timed.median}


def model_overrides(a) -> list[str]:
    return [f"model.num_layers={a.layers}", f"model.hidden_size={a.hidden}",
            f"model.num_heads={a.heads}", f"model.seq_length={a.seq}",
            f"model.vocab_size={a.vocab}", "model.dropout=0.0", "train.micro_batch_size=1",
            f"train.global_batch_size={a.global_batch}", "train.device=cpu",
            "data.source=synthetic", "log.progress=false", f"train.timeout_s={a.timeout}",
            f"train.iters={a.iters}"]


def run(a) -> list[dict]:
    from ptdp.runtime.local_ranks import run_on_ranks
    rows = []
    for precision in a.precisions.split(","):
        for d in map(int, a.data.split(",")):
            for sharded in ((False, True) if d > 1 else (False,)):
                overrides = model_overrides(a) + [
                    f"parallel.data={d}", f"train.precision={precision}",
                    f"train.distributed_optimizer={str(sharded).lower()}"]
                ranks = run_on_ranks(d, measure, overrides, a.iters, timeout_s=a.timeout,
                                     fresh_interpreters=True)
                rows.append({"precision": precision, "d": d, "distributed_optimizer": sharded,
                             "ranks": ranks})
                print(f"measured {precision} d={d} distributed_optimizer={sharded}", flush=True)
    for row in rows:
        base = next(r for r in rows if r["precision"] == row["precision"] and r["d"] == 1)
        worst = max(r["state_bytes"] for r in row["ranks"])
        row["state_bytes_max"] = worst
        row["state_ratio_vs_d1"] = worst / max(r["state_bytes"] for r in base["ranks"])
        row["rss_step_bytes_max"] = max(r["rss_step_bytes"] for r in row["ranks"])
        row["peak_rss_bytes_max"] = max(r["peak_rss_bytes"] for r in row["ranks"])
        row["predicted_bytes"] = row["ranks"][0]["predicted_bytes"]
        row["step_s"] = max(r["step_s"] for r in row["ranks"])
    return rows


def table(rows: list[dict]) -> str:
    header = ["precision", "d", "distopt", "state_MB", "x d=1", "predicted_MB", "rss_step_MB",
              "peak_rss_MB", "step_s"]
    lines = [[r["precision"], str(r["d"]), "yes" if r["distributed_optimizer"] else "no",
              f"{r['state_bytes_max'] / MB:.1f}", f"{r['state_ratio_vs_d1']:.3f}",
              f"{r['predicted_bytes'] / MB:.1f}", f"{r['rss_step_bytes_max'] / MB:.1f}",
              f"{r['peak_rss_bytes_max'] / MB:.1f}", f"{r['step_s']:.3f}"] for r in rows]
    return harness.table(header, lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/distributed_optimizer", help="folder for the JSON")
    ap.add_argument("--data", default="1,2,4", help="data-parallel sizes")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")   # read by each spawned rank's glibc
    rows = run(a)
    print(f"GPT {a.layers} layers, h={a.hidden}, s={a.seq}, V={a.vocab}, B={a.global_batch}, "
          f"b=1, p=t=1; optimizer state per rank (worst rank)")
    print(table(rows))
    out = harness.write_json(Path(a.out) / "distributed_optimizer.json",
                             {"args": vars(a), "rows": rows}, tool=__file__, argv=argv)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
