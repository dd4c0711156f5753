"""Benchmark (not a test): the measured pipeline bubble of zb-h1 against 1f1b on CPU ranks.

Trains a GPT on p local CPU ranks (t = d = 1) under 1f1b and under zb-h1, same model, data
and m, with `log.trace_file` on, and reads each traced iteration back the way `ptdp timeline
TRACE` does (ptdp/pipeline/gantt.py, `lane_bubbles`): per rank, compute = forwards, backwards
and weight-gradient passes minus the waits for received tensors inside them; bubble = the idle
share of the span from the first forward to the last backward, over compute. The two
schedules alternate for --repeats rounds (the machine's load drifts); the table gives the
median over rounds and traced iterations, per rank, and the median step time.

    python tools/bench_zero_bubble.py --p 2 --m 8 --repeats 3 --out bench/zero_bubble
    ptdp timeline bench/zero_bubble/zb-h1.json --out zb-h1.png   # the picture of one round
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__:      # python -m tools.bench_zero_bubble, or imported by a test
    from . import harness
else:                # python tools/bench_zero_bubble.py (tools/harness.py says why)
    import harness

SCHEDULES = ("1f1b", "zb-h1")


def train(overrides: list[str]) -> list[float]:
    """On every rank: train, return the step times (the trace file is the output)."""
    import torch.distributed as dist
    from ptdp.config import load_config
    from ptdp.training import Trainer
    trainer = Trainer(load_config(None, overrides, world_size=dist.get_world_size()))
    return [r["step_time_s"] for r in trainer.train()]


def bubbles(trace_file: Path) -> list[list[float]]:
    """[traced iteration][rank] bubble fraction."""
    from ptdp.pipeline import gantt
    trace = gantt.read_trace(trace_file)
    return [[b for _, _, b in gantt.lane_bubbles(gantt.lanes_from_trace(trace, it))]
            for it in gantt.traced_iterations(trace)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", type=int, default=2)
    ap.add_argument("--m", type=int, default=8, help="micro-batches per iteration")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/zero_bubble")
    a = ap.parse_args(argv)
    from ptdp.runtime.local_ranks import run_on_ranks
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [f"parallel.pipeline={a.p}", "parallel.tensor=1", "parallel.data=1",
              f"model.num_layers={a.layers}", f"model.hidden_size={a.hidden}", "model.num_heads=8",
              f"model.seq_length={a.seq}", "model.vocab_size=512", "model.dropout=0.0",
              f"train.micro_batch_size={a.micro_batch}",
              f"train.global_batch_size={a.micro_batch * a.m}", "train.iters=5",
              "train.device=cpu", "train.compile=false", "log.progress=false",
              "log.interval=1000000", "train.timeout_s=600"]
    results = {name: {"bubble": [], "step_time_s": []} for name in SCHEDULES}
    for _ in range(a.repeats):
        for name in SCHEDULES:
            trace = out / f"{name}.json"
            times = run_on_ranks(a.p, train, common + [f"schedule.name={name}",
                                                       f"log.trace_file={trace}"], timeout_s=900)[0]
            results[name]["bubble"] += bubbles(trace)
            results[name]["step_time_s"] += times[1:]
    print(f"measured bubble per rank (median of {a.repeats} rounds x traced iterations), "
          f"p={a.p}, m={a.m}, GPT {a.layers} layers h={a.hidden} s={a.seq} b={a.micro_batch}")
    print(f"{'schedule':>9} " + " ".join(f"{'rank ' + str(r):>8}" for r in range(a.p))
          + f" {'mean':>6} {'step s':>7}")
    summary = {}
    for name, res in results.items():
        per_rank = [statistics.median(it[r] for it in res["bubble"]) for r in range(a.p)]
        step = statistics.median(res["step_time_s"])
        summary[name] = {"bubble_per_rank": per_rank, "bubble_mean": sum(per_rank) / a.p,
                         "step_time_s": step, "samples": res}
        print(f"{name:>9} " + " ".join(f"{b:>8.3f}" for b in per_rank)
              + f" {summary[name]['bubble_mean']:>6.3f} {step:>7.3f}")
    harness.write_json(out / "zero_bubble.json", {"args": vars(a), "results": summary},
                       tool=__file__, argv=argv)
    print(f"wrote {out / 'zero_bubble.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
