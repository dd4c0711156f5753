"""Benchmark (not a test): memory per rank and step time with context parallelism
(parallel.context = c, ptdp/parallel/ring_attention.py) on c local CPU ranks, against the
planner's predictions (ptdp/planner/memory.py gpu_memory, ptdp/planner/cost_model.py predict).

For each sequence length s and context size c (p = t = d = 1 otherwise, one micro-batch of one
sequence per iteration, a tiny Llama-style model: the ring with grouped-query attention and
rotary positions), one job of c ranks trains a few iterations and every rank reports:

* saved_MB: the activations its forward keeps for backward, counted from the tensors autograd
  saves (unique storages, parameters excluded; the ring's own saved tensors included), the
  loss's included: what context parallelism divides by c;
* rss_MB: how much the rank's resident set rose above its level before the first step, to its
  peak (VmHWM), with MALLOC_MMAP_THRESHOLD_=65536 so that glibc returns every freed block of
  64 KiB or more (the resident set then follows the live tensors): activations, the ring's and
  the loss's working sets, gradients and the optimizer's first step;
* step_s: the median iteration time after the first (ranks share the machine's cores:
  indicative only);
* ring_MB: the bytes the rank sent around the ring per iteration.

Predictions for the same layout: the planner's activation term plus the last stage's loss
(logits) term (pred_saved_MB, against saved_MB); that plus the rest of its working set, the
ring's among it, gradients and optimizer state, no framework reserve (pred_step_MB, against
rss_MB); the ring's bytes (formulas.ring_blocks_per_layer); the step time of the cost model
with the `cpu-local` hardware profile. The table shows the worst rank and each measured/
predicted ratio; the JSON has every rank.

    python tools/bench_context.py --out bench/context
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ptdp.profiler.timing import saved_bytes
from ptdp.runtime.process_memory import process_status_bytes

if __package__:      # python -m tools.bench_context, or imported by a test
    from . import harness
else:                # python tools/bench_context.py (tools/harness.py says why)
    import harness

MB = 2**20


def measure(overrides: list[str], iters: int) -> dict:
    """On every rank: bytes saved by the first step's forward, resident-set rise, step time."""
    import torch.distributed as dist

    from ptdp.config import load_config
    from ptdp.training import Trainer

    trainer = Trainer(load_config(None, overrides, world_size=dist.get_world_size()))
    params = {p.untyped_storage().data_ptr() for p in trainer.state.params}
    before = process_status_bytes("VmRSS")
    saved = {}

    def step(it: int) -> None:   # the first step also counts what its forward saves
        if it == 0:
            _, saved["bytes"] = saved_bytes(lambda: trainer.train_step(it), params)
        else:
            trainer.train_step(it)
    warmup = min(1, iters - 1)   # the first step is timed only when it is the only one
    timed = harness.time_steps(step, iters - warmup, warmup)
    return {"rank": trainer.state.grid.rank, "saved_bytes": saved["bytes"],
            "rss_rise_bytes": process_status_bytes("VmHWM") - before,
            "ring_bytes_per_iter": trainer.state.ctx.cp.bytes_sent / iters,
            "step_s": timed.median}


def model_overrides(a, seq: int) -> list[str]:
    return ["model.arch=gpt", "model.preset=llama", f"model.num_layers={a.layers}",
            f"model.hidden_size={a.hidden}", f"model.num_heads={a.heads}",
            f"model.num_kv_heads={a.kv_heads}", f"model.ffn_hidden_size={a.ffn}",
            f"model.seq_length={seq}", f"model.vocab_size={a.vocab}", "model.dropout=0.0",
            "train.micro_batch_size=1", "train.global_batch_size=1", "train.device=cpu",
            "train.precision=fp32", "data.source=synthetic", "log.progress=false",
            f"train.timeout_s={a.timeout}", f"train.iters={a.iters}"]


def predict_row(a, seq: int, c: int) -> dict:
    """The planner's memory (activations + loss, and the whole step without the framework's
    reserve), the ring's bytes and the cost model's step time for this layout."""
    from ptdp.config import ModelConfig, padded_vocab_size
    from ptdp.hardware import load_hardware
    from ptdp.planner.compute import ModelShape
    from ptdp.planner.cost_model import Layout, Workload, predict
    from ptdp.planner.formulas import ring_block_bytes, ring_blocks_per_layer
    from ptdp.planner.memory import gpu_memory

    shape = ModelShape.from_config(ModelConfig(
        arch="gpt", preset="llama", num_layers=a.layers, hidden_size=a.hidden, num_heads=a.heads,
        num_kv_heads=a.kv_heads, ffn_hidden_size=a.ffn, seq_length=seq, vocab_size=a.vocab))
    vocab = padded_vocab_size(a.vocab, 1)
    mem = gpu_memory(shape, p=1, t=1, v=1, m=1, b=1, schedule="1f1b", recompute="none",
                     precision="fp32", attention="flash", vocab_padded=vocab, reserved_gb=0.0,
                     rank=0, d=1, c=c)
    logits = seq / c * vocab * (2 * 4 + 4)   # the loss's term of the planner's working set
    forward, backward_kv, backward_grad = ring_blocks_per_layer(c)
    ring = a.layers * ((forward + backward_kv) * ring_block_bytes(shape, 1, 1, c, 4)
                       + backward_grad * ring_block_bytes(shape, 1, 1, c, 4))
    hw = load_hardware("cpu-local")
    step = predict(hw, Workload(shape, 1, "fp32", 8), Layout(context=c)).step_time_s
    return {"pred_saved_bytes": mem.activations + logits, "pred_step_bytes": mem.total,
            "pred_ring_bytes": ring, "pred_step_s": step}


def run(a) -> list[dict]:
    from ptdp.runtime.local_ranks import run_on_ranks
    rows = []
    for seq in map(int, a.seqs.split(",")):
        for c in map(int, a.contexts.split(",")):
            overrides = model_overrides(a, seq) + [f"parallel.context={c}"]
            ranks = run_on_ranks(c, measure, overrides, a.iters, timeout_s=a.timeout,
                                 fresh_interpreters=True)
            row = {"seq": seq, "c": c, "ranks": ranks, **predict_row(a, seq, c)}
            for key in ("saved_bytes", "rss_rise_bytes", "ring_bytes_per_iter", "step_s"):
                row[key] = max(r[key] for r in ranks)
            rows.append(row)
            print(f"measured s={seq} c={c}: saved {row['saved_bytes'] / MB:.1f} MB "
                  f"(predicted {row['pred_saved_bytes'] / MB:.1f}), step {row['step_s']:.2f} s",
                  flush=True)
    for row in rows:
        base = next(r for r in rows if r["seq"] == row["seq"] and r["c"] == min(
            x["c"] for x in rows if x["seq"] == row["seq"]))
        row["saved_vs_c1"] = row["saved_bytes"] / base["saved_bytes"]
        row["pred_saved_vs_c1"] = row["pred_saved_bytes"] / base["pred_saved_bytes"]
    return rows


def table(rows: list[dict]) -> str:
    header = ["s", "c", "saved_MB", "pred_MB", "ratio", "x c=1", "pred x c=1", "rss_MB",
              "pred_step_MB", "ratio", "ring_MB", "pred_ring_MB", "step_s", "pred_step_s"]
    lines = [[str(r["seq"]), str(r["c"]), f"{r['saved_bytes'] / MB:.1f}",
              f"{r['pred_saved_bytes'] / MB:.1f}",
              f"{r['saved_bytes'] / r['pred_saved_bytes']:.3f}", f"{r['saved_vs_c1']:.3f}",
              f"{r['pred_saved_vs_c1']:.3f}", f"{r['rss_rise_bytes'] / MB:.1f}",
              f"{r['pred_step_bytes'] / MB:.1f}",
              f"{r['rss_rise_bytes'] / r['pred_step_bytes']:.3f}",
              f"{r['ring_bytes_per_iter'] / MB:.1f}", f"{r['pred_ring_bytes'] / MB:.1f}",
              f"{r['step_s']:.2f}", f"{r['pred_step_s']:.2f}"] for r in rows]
    return harness.table(header, lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/context", help="folder for the JSON")
    ap.add_argument("--seqs", default="2048,8192,32768", help="sequence lengths s")
    ap.add_argument("--contexts", default="1,2,4", help="context-parallel sizes c")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800.0)
    a = ap.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")   # read by each spawned rank's glibc
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = run(a)
    print(f"Llama-style {a.layers} layers, h={a.hidden}, {a.heads} heads ({a.kv_heads} K/V), "
          f"f={a.ffn}, V={a.vocab}, b=1, fp32, p=t=d=1; per rank (worst rank)")
    print(table(rows))
    out = harness.write_json(Path(a.out) / "context.json", {"args": vars(a), "rows": rows},
                             tool=__file__, argv=argv)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
