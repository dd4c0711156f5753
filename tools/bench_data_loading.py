"""Benchmark (not a test): does `data.num_workers` take data time off the critical path?

One process (a world of one, gloo on CPU or NCCL on CUDA) trains a small GPT through the real
`Trainer` on synthetic data whose samples each take `--sample-ms` to read (a stand-in for a
slow file system or an on-the-fly tokenizer: the time is spent sleeping, as in I/O), with
`data.num_workers` = 0, 1, 2, ... For each it reports the median step time and the time the
training thread waited for micro-batches per step (inside `get`). With 0 workers the wait is
the whole data time (m x b x sample time); with enough workers it drops to about nothing and
the step time to the compute time.

    python tools/bench_data_loading.py                      # CPU, defaults below
    python tools/bench_data_loading.py --workers 0 2 --sample-ms 10 --json bench/data_loading.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

if __package__:      # python -m tools.bench_data_loading, or imported by a test
    from . import harness
else:                # python tools/bench_data_loading.py (tools/harness.py says why)
    import harness


class SlowSamples:
    """A dataset whose every sample costs `delay` seconds (sleeping: I/O-like)."""

    def __init__(self, dataset, delay: float):
        self.dataset, self.delay = dataset, delay

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        time.sleep(self.delay)
        return self.dataset[index]


class TimedSource:
    """Wraps a micro-batch source: the training thread's seconds inside `get`."""

    def __init__(self, source):
        self.source, self.seconds = source, 0.0

    def get(self, iteration, mb):
        start = time.perf_counter()
        batch = self.source.get(iteration, mb)
        self.seconds += time.perf_counter() - start
        return batch


def run(workers: int, args, device: str) -> dict:
    from ptdp.config import load_config
    from ptdp.training import Trainer
    cfg = load_config(None, [
        "model.num_layers=2", f"model.hidden_size={args.hidden}", "model.num_heads=4",
        f"model.seq_length={args.seq}", "model.vocab_size=512", "model.dropout=0.0",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch * args.micro_batches}",
        f"train.iters={args.warmup + args.steps}", f"train.device={device}",
        f"data.num_workers={workers}", "log.progress=false", "log.interval=100000"], world_size=1)
    trainer = Trainer(cfg)
    source = trainer.batches["train"]
    inner = getattr(source, "batches", source)        # the MicroBatches under a loader
    inner.dataset = SlowSamples(inner.dataset, args.sample_ms / 1e3)
    timed = TimedSource(source)
    trainer.step.batches = timed

    def step(it: int) -> float:   # the seconds this step waited for its micro-batches
        timed.seconds = 0.0
        trainer.train_step(it)
        return timed.seconds
    timings = harness.time_steps(step, args.steps, args.warmup, device)
    steps, waits = timings.seconds, timings.results[args.warmup:]
    getattr(source, "close", lambda: None)()
    data_per_step = args.micro_batches * args.micro_batch * args.sample_ms / 1e3
    return {"workers": workers, "step_ms": statistics.median(steps) * 1e3,
            "data_wait_ms": statistics.median(waits) * 1e3,
            "data_time_ms": data_per_step * 1e3, "steps_ms": [s * 1e3 for s in steps]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sample-ms", type=float, default=5.0, help="time per sample")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with harness.world_of_one(args.device):
        rows = [run(w, args, args.device) for w in args.workers]
    print(f"data.num_workers on {args.device}: {args.micro_batches} micro-batches of "
          f"{args.micro_batch} samples per step, {args.sample_ms:g} ms per sample "
          f"({rows[0]['data_time_ms']:.0f} ms of data per step); median of {args.steps} steps")
    print(f"{'workers':>7}  {'step ms':>8}  {'data wait ms':>12}")
    for r in rows:
        print(f"{r['workers']:>7}  {r['step_ms']:>8.1f}  {r['data_wait_ms']:>12.1f}")
    if args.json:
        harness.write_json(args.json, {"args": vars(args), "rows": rows}, tool=__file__,
                           argv=argv, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
