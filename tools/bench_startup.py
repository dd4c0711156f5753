"""Benchmark (not a test): what a test or a tool pays before any training, measured here.

* Starting N local ranks (ptdp/runtime/local_ranks.py): forked from the server that has torch
  and ptdp.training imported, against fresh interpreters (`fresh_interpreters=True`, as
  torchrun starts them), each rank importing the trainer: median wall seconds of a run.
* The peak resident memory (VmHWM) such a rank reports in both cases: why memory measurements
  ask for fresh interpreters.
* Simulating a schedule's timeline, as planning does at every trainer's start-up
  (ptdp/pipeline/simulation.py): whole-number times (`exact_times`) against Fractions.

    python tools/bench_startup.py --out bench/startup

prints the tables and writes startup.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from fractions import Fraction
from pathlib import Path

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/startup", help="folder for startup.json")
    parser.add_argument("--ranks", default="1,2,4,8", help="world sizes to start")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
