"""Benchmark (not a test): convergence and speed of the pipeline schedules on the demo GPT.

Trains `configs/gpt_demo.yaml` (4 layers, h=64, s=64, B=32, b=4) on the demo corpus for
--iters iterations under each schedule, on p local CPU ranks (t = d = 1), with the same seed
and the same data order (iteration t reads the same global batch under every schedule:
ptdp/data/batching.py), and reports per schedule the final loss (mean of the last 10 iterations), its
gap to 1f1b's, and the median step time (`step_time_s` of the metrics, the first iterations
excluded). It writes the loss curves as JSON and as a PNG (matplotlib, `pip install
'ptdp[plot]'`; without it only the JSON).

    python tools/bench_schedules.py --iters 300 --micro-batch 8 --lr 6e-4 --out bench/schedules

Schedules: 1f1b (PipeDream-Flush), interleaved (v=2), 2bw (PipeDream-2BW: no flush, delay-1
updates), pipedream (async, weight stashing: one update per micro-batch, i.e. m times as many
updates per iteration as the others with batches m times smaller; it needs train.clip_grad=0,
which it alone runs with). The demo data (demo/corpus.jsonl, demo/tokenizer.model,
demo/gpt_demo.{bin,idx}) is built first if missing, as `tools/demo.sh` does.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

if __package__:      # python -m tools.bench_schedules, or imported by a test
    from . import harness
else:                # python tools/bench_schedules.py (tools/harness.py says why)
    import harness

ROOT = Path(__file__).resolve().parents[1]   # the checkout: configs/, tools/make_corpus.py, demo/

SCHEDULES = ("1f1b", "interleaved", "2bw", "pipedream")
TAIL = 10          # iterations averaged for the final loss
SKIP = 3           # first iterations left out of the step time (start-up, pipeline fill)


def ensure_demo_data(demo: Path) -> tuple[Path, Path]:
    """(dataset prefix, tokenizer), built like tools/demo.sh's step 2 when absent."""
    corpus, tokenizer, prefix = demo / "corpus.jsonl", demo / "tokenizer.model", demo / "gpt_demo"
    demo.mkdir(parents=True, exist_ok=True)
    run = lambda *cmd: subprocess.run([sys.executable, *map(str, cmd)], check=True, cwd=ROOT)  # noqa: E731
    if not corpus.is_file():
        run("tools/make_corpus.py", "--output", corpus)
    if not tokenizer.is_file():
        run("-m", "ptdp", "tokenizer", "train", "--input", corpus, "--model-prefix",
            demo / "tokenizer", "--vocab-size", "512")
    if not Path(f"{prefix}.idx").is_file():
        run("-m", "ptdp", "preprocess", "--input", corpus, "--tokenizer", tokenizer,
            "--output-prefix", prefix, "--json-key", "text", "--quiet")
    return prefix, tokenizer


def overrides(name: str, a, prefix: Path, tokenizer: Path) -> list[str]:
    out = [f"parallel.pipeline={a.p}", "parallel.tensor=1", "parallel.data=1",
           f"parallel.chunks={a.chunks if name == 'interleaved' else 1}", f"schedule.name={name}",
           f"train.iters={a.iters}", "train.device=cpu", "train.eval_interval=0",
           "log.progress=false", "log.interval=1000000", f"train.timeout_s={a.timeout}"]
    out += (["data.source=synthetic", "data.paths=[]", "data.tokenizer=null"] if prefix is None
            else [f"data.paths=[{prefix}]", f"data.tokenizer={tokenizer}"])
    if a.micro_batch:
        out.append(f"train.micro_batch_size={a.micro_batch}")
    if a.lr is not None:
        out += [f"train.lr={a.lr}", f"train.min_lr={a.lr / 10}"]
    if a.warmup is not None:
        out.append(f"train.lr_warmup_iters={a.warmup}")
    if name == "pipedream":
        out.append("train.clip_grad=0")
    return out


def train_rank(runs: list[list[str]]) -> list[list[dict]]:
    """Runs on every rank: each schedule's job in turn; its metrics records."""
    import contextlib
    import os

    import torch.distributed as dist

    from ptdp.config import load_config
    from ptdp.training import Trainer
    out = []
    for extra in runs:
        cfg = load_config(ROOT / "configs" / "gpt_demo.yaml", extra, world_size=dist.get_world_size())
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            out.append(Trainer(cfg).train())
    return out


def summarise(name: str, history: list[dict], reference: dict | None) -> dict:
    losses = [r["loss"] for r in history]
    steps = [r["step_time_s"] for r in history[SKIP:]] or [r["step_time_s"] for r in history]
    row = {"schedule": name, "losses": losses, "step_times_s": [r["step_time_s"] for r in history],
           "final_loss": statistics.fmean(losses[-TAIL:]),
           "median_step_s": statistics.median(steps)}
    if reference is not None:
        row["loss_vs_1f1b"] = row["final_loss"] / reference["final_loss"] - 1
        row["step_vs_1f1b"] = row["median_step_s"] / reference["median_step_s"]
    return row


def plot(rows: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row in rows:
        iters = range(1, len(row["losses"]) + 1)
        left.plot(iters, row["losses"], label=f"{row['schedule']} (final {row['final_loss']:.3f})",
                  linewidth=1)
        right.plot(iters, [1e3 * s for s in row["step_times_s"]],
                   label=f"{row['schedule']} (median {1e3 * row['median_step_s']:.0f} ms)",
                   linewidth=1)
    left.set(xlabel="iteration", ylabel="training loss", title="loss (same data order)")
    right.set(xlabel="iteration", ylabel="step time (ms)", title="step time")
    right.set_yscale("log")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def table(rows: list[dict]) -> str:
    head = ["schedule", "final loss", "vs 1f1b", "median step ms", "vs 1f1b"]
    body = [[r["schedule"], f"{r['final_loss']:.4f}",
             f"{r.get('loss_vs_1f1b', 0):+.2%}" if "loss_vs_1f1b" in r else "-",
             f"{1e3 * r['median_step_s']:.1f}",
             f"{r['step_vs_1f1b']:.3f}x" if "step_vs_1f1b" in r else "-"] for r in rows]
    return harness.table(head, body, sep=" | ")


def main(argv=None) -> int:
    from ptdp.runtime.local_ranks import run_on_ranks
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--p", type=int, default=2, help="pipeline ranks (t = d = 1)")
    ap.add_argument("--chunks", type=int, default=2, help="v for the interleaved schedule")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="train.micro_batch_size (default: the config's, 4: m = 8)")
    ap.add_argument("--lr", type=float, default=None,
                    help="peak train.lr (min_lr = lr/10); default: the config's, 3e-3")
    ap.add_argument("--warmup", type=int, default=None,
                    help="train.lr_warmup_iters; default: the config's, 10")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--demo-dir", default=str(ROOT / "demo"))
    ap.add_argument("--synthetic", action="store_true",
                    help="random tokens instead of the demo corpus (smoke tests)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "schedules"),
                    help="folder for schedules.json and schedules.png")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole job")
    a = ap.parse_args(argv)
    names = [n for n in a.schedules.split(",") if n]
    if unknown := sorted(set(names) - set(SCHEDULES)):
        ap.error(f"unknown schedules {unknown}; choose from {', '.join(SCHEDULES)}")
    prefix, tokenizer = (None, None) if a.synthetic else ensure_demo_data(Path(a.demo_dir))
    runs = [overrides(name, a, prefix, tokenizer) for name in names]
    print(f"bench_schedules: configs/gpt_demo.yaml on {a.p} CPU ranks, {a.iters} iterations, "
          f"schedules {', '.join(names)}")
    histories = run_on_ranks(a.p, train_rank, runs, timeout_s=a.timeout, threads=1)[0]
    rows, reference = [], None
    for name, history in zip(names, histories):
        row = summarise(name, history, reference)
        reference = reference or (row if name == "1f1b" else None)
        rows.append(row)
    if reference is not None:   # 1f1b may not come first
        rows = [summarise(r["schedule"], h, reference) for r, h in zip(rows, histories)]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"config": "configs/gpt_demo.yaml", "p": a.p, "chunks": a.chunks,
                "data": "synthetic" if a.synthetic else str(prefix),
                "iters": a.iters, "micro_batch": a.micro_batch, "lr": a.lr, "warmup": a.warmup,
                "final_loss_over": TAIL,
                "step_time_skips": SKIP}
    harness.write_json(out / "schedules.json", {"settings": settings, "rows": rows},
                       tool=__file__, argv=argv)
    print(table(rows))
    lr = f"lr {a.lr if a.lr is not None else 'as configured'}, warm-up {a.warmup if a.warmup is not None else 'as configured'}"
    title = f"gpt_demo on {a.p} CPU ranks, {a.iters} iterations, {lr}"
    drawn = plot(rows, out / "schedules.png", title)
    print(f"wrote {out / 'schedules.json'}" + (f" and {out / 'schedules.png'}" if drawn else
                                                "; matplotlib missing: no picture (pip "
                                                "install 'ptdp[plot]')"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
