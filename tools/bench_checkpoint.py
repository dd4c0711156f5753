"""Benchmark (not a test): how long training stands still per checkpoint save, synchronous
against asynchronous (`checkpoint.async_save`, ptdp/checkpoint/background.py), on CPU ranks.

One job per mode trains the same GPT of about 100 M parameters (h = 768, 12 layers, vocabulary
32,000: 110 M) with (p, t, d) = (2, 1, 1) on 2 local CPU ranks, saving every `--interval`
iterations. Every rank times, per save:

* stall_s: what the training loop spends in the save (synchronous: the whole save; async: the
  copy to host memory, plus publishing the save before when it had to wait for it);
* publish_s: the later collective that publishes a background save once every writer is done
  (metadata, rename, `latest`); wait_s: the end of the run waiting for the last writer;

and per iteration its step time, split into iterations that ran while a background write was in
flight and the others (the writer competes for the same cores). The table shows the slowest
rank; the JSON has every save. Both modes write the same files (tests/test_restart.py).

Then the cost of checksums (ptdp/checkpoint/integrity.py) on the last checkpoint written, in this
process, its files warm in the page cache (the cost that remains once the disk is out of the
way): the CRC-32 pass over every file (what a save adds to its writes, and the pass a load makes
before its memory-mapped reads), against torch.load of the same files.

    python tools/bench_checkpoint.py --out bench/checkpoint
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__:      # python -m tools.bench_checkpoint, or imported by a test
    from . import harness
else:                # python tools/bench_checkpoint.py (tools/harness.py says why)
    import harness

MODEL = ["model.num_layers=12", "model.hidden_size=768", "model.num_heads=12",
         "model.seq_length=128", "model.vocab_size=32000", "model.dropout=0.0",
         "parallel.pipeline=2", "train.micro_batch_size=1", "train.global_batch_size=2",
         "log.progress=false", "log.interval=1000", "train.timeout_s=600"]


def _timed(obj, name: str, sink: list):
    """Wrap obj.name so that each call's seconds are appended to sink."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)
    setattr(obj, name, wrapper)


def job_overrides(mode: str, directory: str, iters: int, interval: int) -> list[str]:
    return MODEL + [f"train.iters={iters}", f"checkpoint.dir={directory}/{mode}",
                    f"checkpoint.save_interval={interval}",
                    f"checkpoint.async_save={str(mode == 'async').lower()}"]


def measure(mode: str, overrides: list[str]) -> dict:
    """On every rank: train with saves; per-save stalls and per-iteration step times."""
    import torch.distributed as dist

    from ptdp.config import load_config
    from ptdp.training import Trainer

    trainer = Trainer(load_config(None, overrides, world_size=dist.get_world_size()))
    stalls, publishes, waits, in_flight = [], [], [], []
    _timed(trainer, "save_checkpoint", stalls)
    if trainer.saves is not None:
        saves = trainer.saves
        _timed(saves, "_publish", publishes)   # the collective that publishes a written save
        _timed(saves, "wait", waits)           # the end of the run (or a save catching up)
        step = trainer.train_step

        def flagged_step(*args, **kwargs):
            in_flight.append(saves.in_flight)
            return step(*args, **kwargs)
        trainer.train_step = flagged_step
    started = time.perf_counter()
    records = trainer.train()
    wall = time.perf_counter() - started
    steps = [r["step_time_s"] for r in records]
    flags = in_flight or [False] * len(steps)
    busy = [s for s, f in zip(steps[1:], flags[1:]) if f]
    quiet = [s for s, f in zip(steps[1:], flags[1:]) if not f]
    params = trainer.state.total_parameter_count()
    return {"mode": mode, "rank": dist.get_rank(), "parameters": params, "stall_s": stalls,
            "publish_s": publishes, "wait_s": waits, "wall_s": wall,
            "step_s_writing": statistics.median(busy) if busy else None,
            "step_s_quiet": statistics.median(quiet) if quiet else None}


def verification_cost(directory: Path) -> dict:
    """Seconds to checksum every file of one checkpoint against seconds to torch.load them
    (medians of 3, after a warm-up pass that brings the files into the page cache)."""
    import torch

    from ptdp.checkpoint.integrity import file_checksum
    files = sorted(p for p in directory.iterdir() if p.suffix == ".pt")
    size = sum(p.stat().st_size for p in files)
    crc = harness.time_steps(lambda i: [file_checksum(p) for p in files], steps=3, warmup=1)
    load = harness.time_steps(lambda i: [torch.load(p, weights_only=True) for p in files],
                              steps=3, warmup=1)
    return {"bytes": size, "files": len(files), "crc32_s": crc.median,
            "torch_load_s": load.median, "crc32_gb_per_s": size / crc.median / 1e9,
            "crc32_vs_load": crc.median / load.median}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=12, help="iterations per mode")
    parser.add_argument("--interval", type=int, default=4, help="checkpoint.save_interval")
    parser.add_argument("--out", default="bench/checkpoint",
                        help="output prefix: writes OUT.json")
    args = parser.parse_args(argv)

    from ptdp.runtime.local_ranks import run_on_ranks

    from ptdp.checkpoint.layout import resolve_checkpoint

    rows = []
    with tempfile.TemporaryDirectory(prefix="ptdp-bench-ckpt-") as directory:
        for mode in ("sync", "async"):
            rows += run_on_ranks(2, measure, mode,
                                 job_overrides(mode, directory, args.iters, args.interval),
                                 timeout_s=3600, fresh_interpreters=True)
        verify = verification_cost(resolve_checkpoint(Path(directory) / "sync"))
    print(f"{'mode':6} {'params':>8} {'saves':>5} {'stall/save s (median)':>22} "
          f"{'publish s':>10} {'step s writing':>15} {'step s quiet':>13} {'wall s':>7}")
    summary = {}
    for mode in ("sync", "async"):
        ranks = [r for r in rows if r["mode"] == mode]
        worst = max(ranks, key=lambda r: statistics.median(r["stall_s"]))
        stall = statistics.median(worst["stall_s"])
        publish = statistics.median(worst["publish_s"]) if worst["publish_s"] else 0.0
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"{mode:6} {worst['parameters'] / 1e6:7.0f}M {len(worst['stall_s']):5d} "
              f"{stall:22.2f} {publish:10.2f} {fmt(worst['step_s_writing']):>15} "
              f"{fmt(worst['step_s_quiet']):>13} {worst['wall_s']:7.1f}")
        summary[mode] = {"stall_s_median": stall, "publish_s_median": publish,
                         "wall_s": worst["wall_s"]}
    ratio = summary["sync"]["stall_s_median"] / max(summary["async"]["stall_s_median"], 1e-9)
    print(f"training stands still {ratio:.1f}x less per save with checkpoint.async_save=true")
    print(f"checksums: CRC-32 of one checkpoint ({verify['bytes'] / 1e6:.0f} MB in "
          f"{verify['files']} files) {verify['crc32_s']:.3f} s ({verify['crc32_gb_per_s']:.2f} "
          f"GB/s), {verify['crc32_vs_load']:.0%} of torch.load's {verify['torch_load_s']:.3f} s")
    out = harness.write_json(args.out + ".json", {
        "summary": summary, "ratio": ratio, "ranks": rows, "iters": args.iters,
        "interval": args.interval, "verification": verify}, tool=__file__, argv=argv)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
