"""Benchmark (not a test): what a test or a tool pays before any training, measured here.

* Starting N local ranks (ptdp/runtime/local_ranks.py): forked from the server that has torch
  and ptdp.training imported, against fresh interpreters (`fresh_interpreters=True`, as
  torchrun starts them), each rank importing the trainer: median wall seconds of a run.
* The peak resident memory (VmHWM) such a rank reports in both cases: why memory measurements
  ask for fresh interpreters.
* Simulating a schedule's timeline, as planning does at every trainer's start-up
  (ptdp/pipeline/simulation.py): whole-number times (`exact_times`) against Fractions.
* Drawing the initial weights (ptdp/parallel/initial_weights.py): a GPT layer's four linears
  at a reduced width, for the last tensor rank of t = 8 (the one that skips the most), drawing
  only its slices against drawing every full tensor (as before) and checking they are equal;
  then, from the measured rates of drawing normals and of skipping the stream, the time per
  rank at GPT-175B (p = t = 8: 12 layers of h 12,288 per stage, the first stage's embedding of
  V 51,200), on 1 thread and on `--init-threads`.

    python tools/bench_startup.py --out bench/startup [--only init]

prints the tables and writes startup.json.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from fractions import Fraction
from pathlib import Path

import torch

if __package__:      # python -m tools.bench_startup, or imported by a test
    from . import harness
else:                # python tools/bench_startup.py (tools/harness.py says why)
    import harness


def rank_job() -> float:
    """What a rank does before its first iteration that does not depend on the model: import
    the trainer. Returns its peak resident set in MiB."""
    import ptdp.training  # noqa: F401
    from ptdp.runtime.process_memory import peak_rss_gb
    return peak_rss_gb() * 1024


def _median_seconds(fn, repeats: int) -> float:
    return harness.time_steps(lambda _: fn(), repeats).median


def bench_ranks(worlds: list[int], repeats: int) -> list[dict]:
    from ptdp.runtime.local_ranks import run_on_ranks
    run_on_ranks(1, rank_job)   # the fork server starts once per process, as in a test session
    rows = []
    for world in worlds:
        row = {"ranks": world}
        for label, fresh in (("forked", False), ("fresh", True)):
            peaks = []

            def run():
                peaks.extend(run_on_ranks(world, rank_job, fresh_interpreters=fresh))
            row[f"{label}_s"] = _median_seconds(run, repeats)
            row[f"{label}_peak_mib"] = statistics.median(peaks)
        rows.append(row)
    return rows


def bench_simulation(cases: list[tuple], repeats: int) -> list[dict]:
    from ptdp.pipeline.schedules import build_all
    from ptdp.pipeline.simulation import exact_times, simulate_lists
    rows = []
    for name, p, v, m, batches in cases:
        lists = build_all(name, p, v, m, batches)
        n = m * batches
        exact = _median_seconds(lambda: simulate_lists(lists, p, v, n, **exact_times(v)), repeats)
        frac = _median_seconds(lambda: simulate_lists(lists, p, v, n, t_f=Fraction(1),
                                                      t_b=Fraction(2)), repeats)
        rows.append({"schedule": name, "p": p, "v": v, "m": m, "batches": batches,
                     "exact_s": exact, "fraction_s": frac, "speedup": frac / exact})
    return rows


def gpt_linears(h: int) -> list[tuple[tuple, int]]:
    """A GPT layer's weights as (full shape, split dim): QKV, projection, fc1, fc2."""
    return [((3 * h, h), 0), ((h, h), 1), ((4 * h, h), 0), ((h, 4 * h), 1)]


def stream_cost(shape: tuple, split_dim: int | None, t: int, rank: int) -> tuple[int, int]:
    """(numbers skipped, normals drawn) for one rank's slice, as initial_weights draws it."""
    from ptdp.parallel.initial_weights import _segments
    numel = math.prod(shape)
    segments = _segments(shape, split_dim, t, rank) if split_dim is not None else [(0, numel)]
    if segments is None:
        return 0, numel
    return segments[-1][0] - sum(b - a for a, b in segments[:-1]), sum(b - a for a, b in segments)


def rates() -> dict:
    """Normals drawn per second and stream numbers skipped per second, on this thread."""
    from ptdp.parallel.initial_weights import _skip
    n = 1 << 24
    draw = harness.time_steps(lambda _: torch.randn(n, generator=torch.Generator()), 3).median
    skip = harness.time_steps(lambda _: _skip(torch.Generator(), n, []), 3).median
    return {"draw_per_s": n / draw, "skip_per_s": n / skip}


def bench_init(hidden: int, t: int, threads: int, rate: dict, repeats: int) -> dict:
    """One layer's linears at `hidden` for tensor rank t - 1: measured old and new, predicted."""
    from ptdp.parallel.initial_weights import drawing_in_threads
    from ptdp.parallel.layers import full_normal, normal_param
    from ptdp.parallel.mappings import TensorParallel
    tp = TensorParallel(None, t - 1, t)
    shapes = gpt_linears(hidden)

    def new():
        return [normal_param(shape, 0.02, 1, f"w{i}", dim, tp) for i, (shape, dim) in enumerate(shapes)]

    def old():
        return [full_normal(shape, 0.02, 1, f"w{i}").chunk(t, dim)[t - 1] for i, (shape, dim) in enumerate(shapes)]

    def threaded():
        with drawing_in_threads(threads):
            return new()

    assert all(torch.equal(a, b) for a, b in zip(new(), old())), "slices differ from the full draws"
    costs = [stream_cost(shape, dim, t, t - 1) for shape, dim in shapes]
    predicted = sum(skip / rate["skip_per_s"] + draw / rate["draw_per_s"] for skip, draw in costs)
    return {"hidden": hidden, "t": t, "old_s": _median_seconds(old, repeats),
            "new_s": _median_seconds(new, repeats), "threaded_s": _median_seconds(threaded, repeats),
            "threads": threads, "predicted_new_s": predicted,
            "predicted_old_s": sum(math.prod(shape) for shape, _ in shapes) / rate["draw_per_s"]}


def extrapolate_175b(rate: dict, threads: int, h: int = 12288, layers: int = 12, t: int = 8,
                     vocab: int = 51200) -> dict:
    """Seconds per rank to draw the initial weights of one GPT-175B stage at p = t = 8 (the
    first: its layers and the embedding), tensor rank t - 1; threads share the tensors, so a
    rank takes at least its largest tensor's time."""
    tensors = [cost for _ in range(layers) for cost in
               (stream_cost(shape, dim, t, t - 1) for shape, dim in gpt_linears(h))]
    per = vocab // t   # the embedding's rows of rank t - 1
    tensors.append((per * (t - 1) * h, per * h))
    seconds = [skip / rate["skip_per_s"] + draw / rate["draw_per_s"] for skip, draw in tensors]
    full = (layers * 12 * h * h + vocab * h) / rate["draw_per_s"]
    return {"full_draws_s": full, "slices_1_thread_s": sum(seconds),
            "slices_threads_s": max(sum(seconds) / threads, max(seconds)), "threads": threads}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/startup", help="folder for startup.json")
    parser.add_argument("--ranks", default="1,2,4,8", help="world sizes to start")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=("ranks", "init"), help="run one part")
    parser.add_argument("--init-hidden", type=int, default=2048, help="width of the measured layer")
    parser.add_argument("--init-threads", type=int, default=8,
                        help="threads per rank for the initial weights (a GPU node's cores / 8)")
    args = parser.parse_args(argv)
    if args.only == "init":
        return _main_init(args, argv)
    worlds = [int(w) for w in args.ranks.split(",")]
    ranks = bench_ranks(worlds, args.repeats)
    print("starting local ranks that import the trainer (median of "
          f"{args.repeats}; peak resident MiB per rank)")
    print(f"{'ranks':>5}  {'forked s':>9}  {'fresh s':>8}  {'ratio':>6}  {'forked MiB':>10}  "
          f"{'fresh MiB':>9}")
    for r in ranks:
        print(f"{r['ranks']:>5}  {r['forked_s']:>9.2f}  {r['fresh_s']:>8.2f}  "
              f"{r['fresh_s'] / r['forked_s']:>6.1f}  {r['forked_peak_mib']:>10.0f}  "
              f"{r['fresh_peak_mib']:>9.0f}")
    cases = [("1f1b", 8, 1, 32, 1), ("interleaved", 8, 4, 32, 1), ("2bw", 8, 2, 16, 6),
             ("pipedream", 8, 1, 16, 6)]
    sims = bench_simulation(cases, args.repeats)
    print("\nsimulating a schedule's timeline (median seconds)")
    print(f"{'schedule':>11}  {'p':>2} {'v':>2} {'m':>3} {'batches':>7}  {'exact':>7}  "
          f"{'Fraction':>8}  {'speedup':>7}")
    for r in sims:
        print(f"{r['schedule']:>11}  {r['p']:>2} {r['v']:>2} {r['m']:>3} {r['batches']:>7}  "
              f"{r['exact_s']:>7.3f}  {r['fraction_s']:>8.3f}  {r['speedup']:>7.1f}")
    out = harness.write_json(Path(args.out) / "startup.json",
                             {"ranks": ranks, "simulation": sims}, tool=__file__, argv=argv)
    print(f"wrote {out}")
    return 0


def _main_init(args, argv) -> int:
    torch.set_num_threads(1)
    rate = rates()
    measured = bench_init(args.init_hidden, 8, args.init_threads, rate, args.repeats)
    at_scale = {n: extrapolate_175b(rate, n) for n in (1, args.init_threads)}
    print(f"drawing normals {rate['draw_per_s'] / 1e6:.0f} M/s, skipping the stream "
          f"{rate['skip_per_s'] / 1e6:.0f} M/s (one thread)")
    m = measured
    print(f"one GPT layer's linears, h {m['hidden']}, tensor rank 7 of 8 (median seconds): full "
          f"tensors {m['old_s']:.3f} (predicted {m['predicted_old_s']:.3f}), my slices "
          f"{m['new_s']:.3f} (predicted {m['predicted_new_s']:.3f}), on {m['threads']} threads "
          f"{m['threaded_s']:.3f}; equal to the full draws' slices")
    x1, xn = at_scale[1], at_scale[args.init_threads]
    print(f"GPT-175B at p = t = 8, first stage, tensor rank 7, predicted per rank: full tensors "
          f"{x1['full_draws_s']:.0f} s; slices {x1['slices_1_thread_s']:.0f} s on 1 thread, "
          f"{xn['slices_threads_s']:.0f} s on {xn['threads']} threads")
    out = harness.write_json(Path(args.out) / "init.json",
                             {"rates": rate, "layer": measured, "gpt_175b": at_scale},
                             tool=__file__, argv=argv)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
