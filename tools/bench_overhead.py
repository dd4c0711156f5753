"""Benchmark (not a test): ptdp's step against plain PyTorch and torch.distributed.pipelining on
CPU, in paired, interleaved rounds, so that a machine shared with other jobs slows both sides of
a pair alike (docs/performance.md, "Host overhead on CPU").

* **one rank**: ptdp's `Trainer` at (p, t, d) = (1, 1, 1) (tools/bench_gpu.py's `PtdpRunner`)
  against the plain-PyTorch GPT of tools/gpu_reference.py (`PlainRunner`), in one process; each
  round times one step of each, alternating which goes first. A round's figure is ptdp's
  tokens/s over the reference's (reference step time / ptdp step time), by wall clock and by
  the thread's CPU time (one torch thread, so the CPU time is the step's work without the time
  other processes took the core).
* **1F1B on 2 ranks**: tools/bench_pipeline.py's job for `1f1b` alone: every iteration runs
  ptdp's step then torch.distributed.pipelining's Schedule1F1B on the same model, weights,
  data and optimizer, each from a barrier. A round's figure is ptdp's step over torch's (below
  1 is faster), by wall clock (first rank in to last rank out) and by the CPU seconds of both
  ranks together.

Both print the median over the rounds with the quartiles and the extremes (the spread), and
the first losses of both sides (equal weights and data: they must agree).

    python tools/bench_overhead.py --rounds 9 [--json bench/overhead/cpu.json]

Shape (issue 34): 4 layers, h 256, s 128, b 4, m 4; 16 heads and V 51,200 for one rank
(bench_gpu.py's GPT), 4 heads and V 256 for the pipeline (bench_pipeline.py's); `--vocab` and
`--heads` set both.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

if __package__:      # python -m tools.bench_overhead, or imported by a test
    from . import bench_gpu, bench_pipeline, harness
    from .gpu_reference import PlainRunner
else:                # python tools/bench_overhead.py (tools/harness.py says why)
    import bench_gpu
    import bench_pipeline
    import harness
    from gpu_reference import PlainRunner


def spread(values: list[float]) -> dict:
    """Median, quartiles and extremes of the rounds' figures."""
    ordered = sorted(values)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else ordered * 3
    return {"median": statistics.median(ordered), "q1": quartiles[0], "q3": quartiles[2],
            "min": ordered[0], "max": ordered[-1], "rounds": values}


def one_rank(args) -> dict:
    """ptdp's Trainer and the plain GPT in one process, one step of each per round."""
    argv = ["--device", "cpu", "--layers", str(args.layers), "--hidden", str(args.hidden),
            "--seq", str(args.seq), "--micro-batch", str(args.micro_batch), "--micro-batches",
            str(args.m), "--vocab", str(args.vocab or 51200), "--heads", str(args.heads or 16),
            "--steps", str(args.rounds + args.warmup), "--warmup", "0"]
    opts = bench_gpu.parse_args(argv)
    device = torch.device("cpu")
    with harness.world_of_one(device):
        sides = [bench_gpu.PtdpRunner(opts, opts.shape, device),
                 PlainRunner(opts, opts.shape, device)]
        first = [side.step(0) for side in sides]
        rounds = harness.alternating({"ptdp": sides[0].step, "plain": sides[1].step},
                                     args.rounds, warmup=args.warmup - 1, swap=True, first=1)
    wall = [laps["plain"].wall / laps["ptdp"].wall for laps in rounds]
    cpu = [laps["plain"].cpu / laps["ptdp"].cpu for laps in rounds]
    return {"what": "ptdp tokens/s over plain PyTorch's (one rank)", "wall": spread(wall),
            "cpu": spread(cpu), "first_loss": first, "vocab": opts.shape["vocab"],
            "heads": opts.shape["heads"]}


def pipeline(args) -> dict:
    """bench_pipeline's 1F1B job at p = 2: ptdp's step and torch's, alternating, per round."""
    from ptdp.runtime.local_ranks import run_on_ranks
    s = {"p": 2, "m": args.m, "chunks": 1, "layers": args.layers, "hidden": args.hidden,
         "heads": args.heads or 4, "seq": args.seq, "vocab": args.vocab or 256,
         "micro_batch": args.micro_batch, "iters": args.rounds, "warmup": args.warmup, "t": 1,
         "scatter_gather": False, "schedules": ["1f1b"], "torch": True, "timeout": args.timeout}
    ranks = [rows[0] for rows in run_on_ranks(2, bench_pipeline.bench_rank, s,
                                              timeout_s=args.timeout, threads=1)]
    if any(r["torch_error"] for r in ranks):
        raise RuntimeError(f"torch.distributed.pipelining failed: {ranks[0]['torch_error']}")
    wall, cpu = [], []
    for i in range(args.rounds):
        ours, theirs = [r["ours"][i] for r in ranks], [r["theirs"][i] for r in ranks]
        span = lambda its: max(x["t_end"] for x in its) - min(x["t0"] for x in its)  # noqa: E731
        wall.append(span(ours) / span(theirs))
        cpu.append(sum(x["cpu"] for x in ours) / sum(x["cpu"] for x in theirs))
    last = next(r for r in ranks if r["theirs_loss"] and r["theirs_loss"][0] == r["theirs_loss"][0])
    return {"what": "ptdp 1F1B step over torch.distributed.pipelining's (p = 2)",
            "wall": spread(wall), "cpu": spread(cpu),
            "first_loss": [last["ours_loss"][0], last["theirs_loss"][0]], "vocab": s["vocab"],
            "heads": s["heads"]}


def format_row(name: str, result: dict) -> list[str]:
    f = lambda x: format(x, ".3f")  # noqa: E731
    w, c = result["wall"], result["cpu"]
    return [name, f(w["median"]), f"{f(w['q1'])}-{f(w['q3'])}", f"{f(w['min'])}-{f(w['max'])}",
            f(c["median"]), f"{f(c['q1'])}-{f(c['q3'])}",
            " / ".join(format(x, ".6f") for x in result["first_loss"])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9, help="paired rounds (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each side first")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--m", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--heads", type=int, help="default: 16 for one rank, 4 for the pipeline")
    ap.add_argument("--vocab", type=int, help="default: 51200 for one rank, 256 for the pipeline")
    ap.add_argument("--only", choices=("one-rank", "pipeline"), help="run one comparison")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the 2-rank job")
    ap.add_argument("--json", help="write the rounds and summaries here")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 1:
        ap.error("--rounds and --warmup must be >= 1")
    torch.set_num_threads(1)
    results = {}
    if args.only != "pipeline":
        results["one_rank"] = one_rank(args)
    if args.only != "one-rank":
        results["pipeline_1f1b"] = pipeline(args)
    print(f"{args.layers} layers, h {args.hidden}, s {args.seq}, b {args.micro_batch}, "
          f"m {args.m}; {args.rounds} paired rounds after {args.warmup} warm-up, 1 thread")
    head = ["comparison", "wall median", "wall IQR", "wall range", "CPU median", "CPU IQR",
            "first loss ptdp / other"]
    names = {"one_rank": "1 rank: ptdp tokens/s / plain PyTorch (goal >= 1.0)",
             "pipeline_1f1b": "p=2 1F1B: ptdp step / pipelining (goal <= 0.95)"}
    print(harness.table(head, [format_row(names[k], v) for k, v in results.items()],
                        sep=" | ", align="<"))
    if args.json:
        harness.write_json(args.json, {"settings": vars(args), **results}, tool=__file__,
                           argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
