"""Benchmark (not a test): ptdp on one device against plain PyTorch of the same shape.

In one process, with (p, t, d) = (1, 1, 1) (a 1-rank process group: gloo on CPU, NCCL on
CUDA), it times a training step of

* **ptdp**: the model built and trained through the real `ptdp.training.Trainer` path
  (synthetic data, AdamW, clipping at 1.0, the configured precision with fp32 master weights);
* **reference**: the same shape written as plain PyTorch (tools/gpu_reference.py), nanoGPT style: fp32
  parameters under bf16/fp16 autocast, fused AdamW (CUDA), `clip_grad_norm_`, whole-model
  `torch.compile` with `--compile`. GPT is pre-LN with learned positions, tied embeddings,
  causal SDPA and a GeLU MLP. BERT is Hugging Face's `BertForPreTraining` (SDPA attention)
  when `transformers` is importable, else a plain pre-LN BERT with the same heads as ptdp's
  (`--reference plain` forces it);

with the same micro-batch b and m micro-batches per step (gradient accumulation), the same
TF32 setting (`--tf32`, default on: ptdp's `train.tf32`, torch's flags for the reference) and
the same data path: every micro-batch comes from host memory and is copied to the device
during the step, ptdp's built ahead by `--data-workers` processes (`data.num_workers`, pinned
on CUDA), the reference's built once before timing and kept in (pinned) host memory, as a
`DataLoader` with `pin_memory` would hand them over; after
`--warmup` untimed steps (compilation happens there). A step's time is the median over
`--steps` steps, by CUDA events on GPU and perf_counter on CPU (tools/harness.py). Then, where
the device holds both models at once (always on CPU; on a GPU when twice ptdp's peak
reservation fits), ptdp stays in memory while the reference is measured, and the two take
`--rounds` steps in alternation, every other round in reverse order: the ratio of their
medians there is the speedup reported (`paired`), since a host whose speed drifts between
the two sequential measurements (one H200 measured the same BERT-large job at 224 and 276 ms
minutes apart) slows both sides of a round alike; the sequential ratio is kept beside it.
`--profile` profiles one more step of each model after all of that: a profiler can leave
CUDA's tracing attached once it stops, slowing every later kernel launch. The table gives
tokens/s,
model TFLOP/s by Eq. 4.2 (ptdp/planner/formulas.py) with 3 passes per layer (forward and
backward: the model's FLOPs) and with the 4 passes the formula counts as written (one more
forward for recomputation), MFU = 3-pass TFLOP/s / the hardware's peak for the precision
(configs/hardware/, `--hardware` or auto-detected on known GPUs; null on CPU), peak memory
(CUDA: max allocated; CPU: the process's peak resident set; each less what the process held
before the model was built, ptdp's model when it is kept), the first loss and the parameter
count.

ptdp's fast paths on one GPU (docs/performance.md, "Speed on one GPU"):
* `train.compile` (default on for CUDA): the transformer layers are torch.compile'd in regions
  of `train.compile_layers` consecutive layers (`--compile-layers`; by default up to 8 here,
  ptdp/config/compilation.py), fusing LayerNorm, bias + GeLU and bias + dropout + residual
  add (ptdp/kernels/fused.py);
* attention is F.scaled_dot_product_attention: flash for GPT (causal, no mask), the
  memory-efficient/cuDNN kernel for BERT (boolean padding mask);
* with compile, the vocab-parallel cross-entropy is fused (ptdp/parallel/cross_entropy.py):
  each pass over the bf16 logits one compiled kernel, no fp32 copy; BERT's masked-LM head
  runs on the masked positions only (models/bert.py);
* model weights, fp32 master weights and gradients live in one flat buffer each, so zeroing,
  unscaling, the master-to-model copy and the data-parallel all-reduce are one kernel each;
  AdamW is torch's fused implementation on CUDA.

On one GPU (defaults on CUDA: GPT 1.3B: 24 layers, h 2048, 16 heads, s 2048, V 51200, bf16,
b = 8, m = 4; BERT-large with `--arch bert`: 24 layers, h 1024, 16 heads, s 512, b = 16):

    python tools/bench_gpu.py --device cuda --arch gpt --json gpt.json
    python tools/bench_gpu.py --device cuda --arch bert --json bert.json

Targets on one H100 80GB (stated; other GPUs print theirs beside them): GPT 1.3B >= 1.10x the compiled
reference's tokens/s at equal b and m and >= 58% MFU; BERT-large >= 1.25x HF
BertForPreTraining and >= 40% MFU; peak memory <= the compiled reference's + 10%. The script
prints them with the measured ratios on CUDA. `--device cpu --tiny` runs a tiny shape in
seconds: a smoke test, its numbers say nothing about GPUs. `--json` is written after each
measurement ("complete": false until both are in), so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

import torch

if __package__:      # python -m tools.bench_gpu, or imported by a test
    from . import harness
    from .gpu_reference import DTYPES, PlainRunner, has_transformers
else:                # python tools/bench_gpu.py (tools/harness.py says why)
    import harness
    from gpu_reference import DTYPES, PlainRunner, has_transformers

SHAPES = {  # layers, hidden, heads, seq, vocab, micro-batch
    "gpt": dict(layers=24, hidden=2048, heads=16, seq=2048, vocab=51200, micro_batch=8),
    "bert": dict(layers=24, hidden=1024, heads=16, seq=512, vocab=30522, micro_batch=16),
    "tiny": dict(layers=2, hidden=64, heads=4, seq=64, vocab=512, micro_batch=2),
}
TARGETS = {  # on one H100 80GB, against the compiled reference
    "gpt": {"speedup": 1.10, "mfu": 0.58, "memory_ratio": 1.10},
    "bert": {"speedup": 1.25, "mfu": 0.40, "memory_ratio": 1.10},
}


# ------------------------------------------------------------------------ ptdp through Trainer
class PtdpRunner:
    """ptdp's Trainer at (p, t, d) = (1, 1, 1); one step = Trainer.train_step."""

    name = "ptdp"

    def __init__(self, args, s: dict, device):
        from ptdp.config import load_config
        from ptdp.training import Trainer
        overrides = [
            f"model.arch={args.arch}", f"model.num_layers={s['layers']}",
            f"model.hidden_size={s['hidden']}", f"model.num_heads={s['heads']}",
            f"model.seq_length={s['seq']}", f"model.vocab_size={s['vocab']}",
            f"model.dropout={s['dropout']}",
            f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.micro_batch * args.micro_batches}",
            f"train.iters={args.warmup + args.steps + bool(args.profile) + args.rounds}",
            f"train.precision={args.precision}",
            f"train.recompute={args.recompute}", f"train.compile={str(args.compile).lower()}",
            f"train.device={device.type}", "train.lr=1e-4", "log.progress=false",
            "data.source=synthetic", f"train.tf32={str(args.tf32).lower()}",
            f"data.num_workers={args.data_workers}"]
        if args.hardware:
            overrides.append(f"log.hardware={args.hardware}")
        if args.compile_layers is not None:
            overrides.append(f"train.compile_layers={args.compile_layers}")
        if args.cuda_graphs:
            overrides.append("train.cuda_graphs=true")
        self.cfg = load_config(None, overrides, world_size=1)
        from ptdp.config.compilation import region_layers
        # layers per compiled region as run here (one chunk: a region is at most all of them)
        self.compile_layers = (min(region_layers(self.cfg), s["layers"]) if args.compile
                               else None)
        self.cuda_graphs = self.cfg.train.cuda_graphs
        self.trainer = Trainer(self.cfg)
        self.parameters = self.trainer.state.total_parameter_count()

    def step(self, iteration: int) -> float:
        return self.trainer.train_step(iteration).loss


# ------------------------------------------------------------------------ measuring
def reset_peak_memory(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: "5" resets VmHWM, the peak resident set size, to the current size
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_reserved_gb(device) -> float | None:
    """What the caching allocator held at its peak (CUDA), the GPU memory really taken."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return peak_memory_gb(device)


def peak_memory_gb(device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    from ptdp.metrics.throughput import peak_memory_gb as process_peak
    return process_peak(device)


def memory_held_gb(device) -> tuple[float, float]:
    """(allocated, reserved) GiB the process holds now: the base a model's peaks are taken
    over (on CPU both are the resident set)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()   # what a released model left cached is not held
        return (torch.cuda.memory_allocated(device) / 2**30,
                torch.cuda.memory_reserved(device) / 2**30)
    from ptdp.runtime.process_memory import process_status_bytes
    rss = (process_status_bytes("VmRSS") or 0) / 2**30
    return rss, rss


def run_one(make, args, s: dict, device, vocab: int, peak: float | None,
            keep: bool = False) -> tuple[dict, object]:
    """Build and time one model: its row, and its runner when `keep` (else the runner is
    released, compiled graphs and all, before the next model is measured)."""
    from ptdp.planner.formulas import model_flops_per_iteration
    reset_peak_memory(device)
    held, held_reserved = memory_held_gb(device)
    runner = make(args, s, device)
    timed = harness.time_steps(runner.step, args.steps, args.warmup, device)
    seconds, losses, step = timed.seconds, timed.results, timed.median
    batch = args.micro_batch * args.micro_batches
    flops = {passes: model_flops_per_iteration(batch, s["seq"], s["layers"], s["hidden"], vocab,
                                               recompute_forward=passes == 4) for passes in (3, 4)}
    tflops3, tflops4 = flops[3] / step / 1e12, flops[4] / step / 1e12
    row = {"model": runner.name, "micro_batch": args.micro_batch, "micro_batches": args.micro_batches,
           "step_ms": step * 1e3, "step_ms_all": [x * 1e3 for x in seconds],
           "tokens_per_s": batch * s["seq"] / step, "tflops": tflops3, "tflops_eq42": tflops4,
           "mfu": tflops3 / peak if peak else None,
           "peak_memory_gb": peak_memory_gb(device) - held,
           "peak_reserved_gb": peak_reserved_gb(device) - held_reserved,
           "loss_first": losses[0], "loss_last": losses[-1], "parameters": runner.parameters,
           "vocab": vocab, "compile_layers": getattr(runner, "compile_layers", None),
           "cuda_graphs": getattr(runner, "cuda_graphs", None)}
    if keep:
        return row, runner
    del runner
    forget_models(device)
    return row, None


def _compile_words(ours: dict) -> str:
    k = ours.get("compile_layers")
    graphs = ", CUDA graphs" if ours.get("cuda_graphs") else ""
    return "off" if k is None else f"on (ptdp's regions: {k} layer{'s' if k > 1 else ''}{graphs})"


def forget_models(device) -> None:
    """Release what models no longer referenced leave behind (compiled graphs, reference
    cycles, cached GPU blocks) before the next model is measured."""
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def room_for_both(device, ours: dict) -> bool:
    """Whether the reference can be measured beside ptdp's model (the two about the same
    size): on a GPU, twice ptdp's peak reservation with 15 % to spare."""
    if device.type != "cuda":
        return True
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    return 2 * ours["peak_reserved_gb"] * 1.15 <= total


def paired_rounds(ours, reference, args, device) -> dict:
    """`args.rounds` steps of each model in alternation (tools/harness.py `alternating`, every
    other round reversed), each step waited for: their medians and the speedup they give."""
    def waited(runner):
        def step(i):
            loss = runner.step(i)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return loss
        return step

    first = args.warmup + args.steps   # ptdp's next iteration
    rounds = harness.alternating({"ptdp": waited(ours), "reference": waited(reference)},
                                 args.rounds, swap=True, first=first)
    ms = {side: [r[side].wall * 1e3 for r in rounds] for side in ("ptdp", "reference")}
    median = {side: statistics.median(values) for side, values in ms.items()}
    ratios = sorted(ref / ours for ours, ref in zip(ms["ptdp"], ms["reference"]))
    return {"rounds": args.rounds, "ptdp_ms": median["ptdp"], "reference_ms": median["reference"],
            "ptdp_ms_all": ms["ptdp"], "reference_ms_all": ms["reference"],
            "speedup": median["reference"] / median["ptdp"],
            "round_speedups": ratios}   # each round's, sorted: how far one round can stray


def profile_after_timing(runner, args, device) -> None:
    """With --profile, one more step of `runner` profiled (after the timed and paired ones)."""
    if args.profile:
        profile_step(runner, args.warmup + args.steps + args.rounds, device,
                     Path(args.profile) / f"profile_{args.arch}_{runner.name.split()[0]}.txt")


def profile_step(runner, iteration: int, device, path: Path) -> None:
    """One step under torch.profiler: where a step's time goes, to compare the two models
    operator by operator (by device time on a GPU, then by the host's time) and on a timeline
    (`path` with .trace.json.gz: chrome://tracing, Perfetto). `busy` is the device's summed
    kernel time over the step's wall time (on a GPU, the rest is the device waiting for the
    host)."""
    from time import perf_counter

    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = perf_counter()
        runner.step(iteration)
        if cuda:
            torch.cuda.synchronize(device)
        wall = perf_counter() - start
    averages = prof.key_averages()
    head = f"{runner.name}: one step, {wall * 1e3:.1f} ms wall (profiled)"
    if cuda:
        from torch.autograd import DeviceType
        kernels = sum(e.self_device_time_total for e in averages
                      if e.device_type == DeviceType.CUDA) / 1e6   # the kernels' own rows
        head += f"; kernels {kernels * 1e3:.1f} ms, busy {kernels / wall:.1%}"
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40)]
    if cuda:   # and by the host's time, which decides a step the device waits on
        tables.insert(0, averages.table(sort_by="self_device_time_total", row_limit=40))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + "\n" + "\n\nBy self CPU time:\n".join(tables) + "\n")
    trace = path.with_suffix(".trace.json.gz")   # the timeline: where the device waited
    prof.export_chrome_trace(str(trace))
    print(head, f"-> {path}, {trace}")


def compare(rows: list[dict], arch: str, device, paired: dict | None = None) -> dict:
    """The speedup (the paired rounds' where they ran, else the sequential medians'), the peak
    memory ratio and, on CUDA, which targets are met."""
    ours, ref = rows
    sequential = ours["tokens_per_s"] / ref["tokens_per_s"]
    out = {"speedup": paired["speedup"] if paired else sequential,
           "speedup_sequential": sequential, "paired": paired,
           "memory_ratio": (ours["peak_memory_gb"] / ref["peak_memory_gb"]
                            if ours["peak_memory_gb"] and ref["peak_memory_gb"] else None),
           "met": None}
    if device.type == "cuda" and ours["mfu"] is not None:
        t = TARGETS[arch]
        out["met"] = {"speedup": out["speedup"] >= t["speedup"], "mfu": ours["mfu"] >= t["mfu"],
                      "memory_ratio": out["memory_ratio"] is not None
                      and out["memory_ratio"] <= t["memory_ratio"]}
    return out


def table(rows: list[dict]) -> str:
    head = ("model", "b", "m", "step ms", "tokens/s", "TFLOP/s", "TFLOP/s eq4.2", "MFU",
            "peak GiB", "first loss", "params")
    fmt = lambda v, f: "null" if v is None else format(v, f)  # noqa: E731
    body = [(r["model"], str(r["micro_batch"]), str(r["micro_batches"]), fmt(r["step_ms"], ".1f"),
             fmt(r["tokens_per_s"], ",.0f"), fmt(r["tflops"], ".3f"), fmt(r["tflops_eq42"], ".3f"),
             fmt(r["mfu"], ".1%"), fmt(r["peak_memory_gb"], ".2f"), fmt(r["loss_first"], ".4f"),
             f"{r['parameters']:,}") for r in rows]
    return harness.table(head, body, align="<")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time ptdp (Trainer, (p,t,d) = (1,1,1)) against plain PyTorch of the same "
                    "shape on one device. Fast paths, defaults and targets: see this file's "
                    "docstring and docs/performance.md, 'Speed on one GPU'.")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--arch", choices=("gpt", "bert"), default="gpt")
    parser.add_argument("--tiny", action="store_true",
                        help="2 layers, h 64, 4 heads, s 64, V 512, b 2, m 2: runs on CPU in seconds")
    for name in ("layers", "hidden", "heads", "seq", "vocab"):
        parser.add_argument(f"--{name}", type=int, help=f"override the shape's {name}")
    parser.add_argument("--micro-batch", type=int, help="b (default: GPT 8, BERT 16, tiny 2)")
    parser.add_argument("--micro-batches", type=int, help="m per step (default 4, tiny 2)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    parser.add_argument("--rounds", type=int,
                        help="paired rounds, the two models alternating, where the device holds "
                             "both (default: --steps; 0: none)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default: 3 CUDA, 1 CPU)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile both models: ptdp in regions of layers (train.compile), the "
                             "reference whole (default: on for CUDA, off on CPU)")
    parser.add_argument("--compile-layers", type=int,
                        help="ptdp's train.compile_layers, layers per compiled region (default: "
                             "its null, ptdp/config/compilation.py)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="ptdp's train.cuda_graphs: each compiled region replayed as a CUDA "
                             "graph (needs --compile on CUDA)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="hidden and attention dropout of both models (BERT against Hugging "
                             "Face only: the plain references have none; default 0)")
    parser.add_argument("--recompute", choices=("none", "full", "selective"), default="none",
                        help="ptdp's train.recompute; the reference checkpoints each block "
                             "for full or selective")
    parser.add_argument("--precision", choices=tuple(DTYPES),
                        help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--reference", choices=("auto", "hf", "plain"), default="auto",
                        help="BERT reference: HF BertForPreTraining when importable (auto)")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                        help="TF32 for fp32 matmuls, both models (ptdp's train.tf32; default on)")
    parser.add_argument("--data-workers", type=int,
                        help="ptdp's data.num_workers (default: 2 on CUDA, 0 on CPU)")
    parser.add_argument("--hardware", help="hardware profile for MFU (configs/hardware/); "
                                           "auto-detected on known GPUs")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (torch.set_num_threads) on --device cpu; 1 keeps a "
                             "shared machine's timings steady (default 1)")
    parser.add_argument("--json", help="write the rows and the comparison here")
    parser.add_argument("--profile", metavar="DIR",
                        help="after all timing (paired rounds too), profile one more step of "
                             "each model (torch.profiler) and write "
                             "DIR/profile_<arch>_<model>.txt: the operators by self "
                             "device time, then by self CPU time, and how busy the device was; "
                             "and the step's timeline beside it (.trace.json.gz)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible")
    shape = dict(SHAPES["tiny" if args.tiny else args.arch])
    for name in ("layers", "hidden", "heads", "seq", "vocab"):
        if getattr(args, name) is not None:
            shape[name] = getattr(args, name)
    if args.compile_layers is not None and args.compile_layers < 1:
        parser.error(f"--compile-layers must be >= 1 (train.compile_layers), got "
                     f"{args.compile_layers}")
    shape["dropout"] = args.dropout
    if args.dropout and (args.arch != "bert" or args.reference == "plain"
                         or not has_transformers()):
        parser.error("--dropout needs --arch bert and the Hugging Face reference (transformers "
                     "installed, --reference auto or hf): the plain references have no dropout")
    args.shape = shape
    args.micro_batch = args.micro_batch or shape["micro_batch"]
    args.micro_batches = args.micro_batches or (2 if args.tiny else 4)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    args.compile = cuda if args.compile is None else args.compile
    args.data_workers = (2 if cuda else 0) if args.data_workers is None else args.data_workers
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    args.rounds = args.steps if args.rounds is None else args.rounds
    if args.steps < 1 or args.warmup < 0 or args.rounds < 0:
        parser.error("--steps must be >= 1, --warmup and --rounds >= 0")
    if args.cuda_graphs and not (cuda and args.compile):
        parser.error("--cuda-graphs needs --device cuda and --compile (train.cuda_graphs replays "
                     "the compiled regions)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        from ptdp.runtime.startup import set_tf32
        torch.cuda.set_device(device)
        set_tf32(args.tf32)   # the reference's; ptdp's Trainer sets the same from train.tf32
    else:
        torch.set_num_threads(args.threads)
    s = args.shape
    from ptdp.config import padded_vocab_size
    from ptdp.metrics.throughput import peak_tflops
    peak = peak_tflops(peak_config(args), device)
    header = {"arch": args.arch, "device": str(device), "shape": s, "precision": args.precision,
              "compile": args.compile, "recompute": args.recompute, "steps": args.steps,
              "tf32": args.tf32, "data_workers": args.data_workers, "warmup": args.warmup,
              "peak_tflops": peak, "targets": TARGETS[args.arch]}   # in every JSON it writes
    paired = None
    with harness.world_of_one(device):
        # Every timing comes before any profiled step: the profiler can leave CUDA's tracing
        # library attached after it stops, slowing each later kernel launch (PyTorch issue
        # #144455), which costs a host-bound step most (BERT-large on an H200: ptdp 195 ms
        # timed before any profiling, 237 ms paired after both profiled steps;
        # docs/performance.md, "Fifth run").
        ours, kept = run_one(PtdpRunner, args, s, device, padded_vocab_size(s["vocab"], 1), peak,
                             keep=args.rounds > 0 or bool(args.profile))
        if kept is not None and not room_for_both(device, ours):
            profile_after_timing(kept, args, device)   # the reference is timed after it
            kept = None
            forget_models(device)
        if args.json:   # a later crash keeps what was measured
            harness.write_json(args.json, {**header, "rows": [ours], "complete": False},
                               tool=__file__, argv=argv, device=device)
        reference, reference_runner = run_one(PlainRunner, args, s, device, s["vocab"], peak,
                                              keep=kept is not None or bool(args.profile))
        rows = [ours, reference]
        if kept is not None and args.rounds > 0:
            paired = paired_rounds(kept, reference_runner, args, device)
        for runner in (kept, reference_runner):
            if runner is not None:
                profile_after_timing(runner, args, device)
    summary = compare(rows, args.arch, device, paired)
    if args.json:
        harness.write_json(args.json, {**header, "rows": rows, **summary, "complete": True},
                           tool=__file__, argv=argv, device=device)
    print(f"{args.arch}: {s['layers']} layers, h {s['hidden']}, {s['heads']} heads, s {s['seq']}, "
          f"V {s['vocab']}, {args.precision}, recompute {args.recompute}, compile "
          f"{_compile_words(rows[0])}, TF32 {'on' if args.tf32 else 'off'}, "
          f"{args.data_workers} data worker(s), {device} (peak {peak or 'unknown'} TFLOP/s); "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(table(rows))
    mem = summary["memory_ratio"]
    if paired:
        spread = paired["round_speedups"]
        print(f"paired: ptdp {paired['ptdp_ms']:.1f} ms, reference {paired['reference_ms']:.1f} ms "
              f"(medians of {paired['rounds']} alternating rounds; single rounds "
              f"{spread[0]:.3f}-{spread[-1]:.3f}x); sequential medians' ratio "
              f"{summary['speedup_sequential']:.3f}x")
    else:
        print("paired: not run (" + ("--rounds 0" if args.rounds == 0 else
                                     "the device cannot hold both models") + ")")
    print(f"ptdp / reference: {summary['speedup']:.3f}x tokens/s"
          f"{' (paired)' if paired else ''}, {'n/a' if mem is None else f'{mem:.3f}x'} peak memory")
    if device.type == "cuda":
        print(targets_line(args.arch, torch.cuda.get_device_name(device), summary["met"]))
    else:
        print("CPU: a smoke test of both paths; these numbers say nothing about GPU speed")
    return 0


def targets_line(arch: str, gpu: str, met) -> str:
    """The targets and whether they were met; they are stated for one H100 80GB, so on any
    other GPU the line says which one measured them."""
    t = TARGETS[arch]
    where = ("one H100 80GB" if "H100 80GB" in gpu
             else f"stated for one H100 80GB, measured on one {gpu}")
    return (f"targets ({where}): >= {t['speedup']:.2f}x tokens/s, >= {t['mfu']:.0%} MFU, "
            f"<= {t['memory_ratio']:.2f}x memory; met: {met}")


def peak_config(args):
    """A Config carrying only what `ptdp.metrics.peak_tflops` reads (precision, log.hardware)."""
    from ptdp.config import load_config
    overrides = [f"train.precision={args.precision}"]
    if args.hardware:
        overrides.append(f"log.hardware={args.hardware}")
    return load_config(None, overrides, world_size=1)


if __name__ == "__main__":
    sys.exit(main())
