"""Benchmark (not a test): ptdp on one device against plain PyTorch of the same shape.

In one process, with (p, t, d) = (1, 1, 1) (a 1-rank process group: gloo on CPU, NCCL on
CUDA), it times a training step of

* **ptdp**: the model built and trained through the real `ptdp.training.Trainer` path
  (synthetic data, AdamW, clipping at 1.0, the configured precision with fp32 master weights);
* **reference**: the same shape written as plain PyTorch in this file, nanoGPT style: fp32
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
`--steps` steps, by CUDA events on GPU and perf_counter on CPU. The table gives tokens/s,
model TFLOP/s by Eq. 4.2 (ptdp/planner/formulas.py) with 3 passes per layer (forward and
backward: the model's FLOPs) and with the 4 passes the formula counts as written (one more
forward for recomputation), MFU = 3-pass TFLOP/s / the hardware's peak for the precision
(configs/hardware/, `--hardware` or auto-detected on known GPUs; null on CPU), peak memory
(CUDA: max allocated; CPU: the process's peak resident set since the model was built), the
first loss and the parameter count.

ptdp's fast paths on one GPU (docs/performance.md, "Speed on one GPU"):
* `train.compile` (default on for CUDA): each transformer layer is torch.compile'd, fusing
  LayerNorm, bias + GeLU and bias + dropout + residual add (ptdp/kernels/fused.py);
* attention is F.scaled_dot_product_attention: flash for GPT (causal, no mask), the
  memory-efficient/cuDNN kernel for BERT (boolean padding mask);
* the vocab-parallel cross-entropy makes one fp32 copy of the logits, reused in place for
  the softmax and its gradient;
* model weights, fp32 master weights and gradients live in one flat buffer each, so zeroing,
  unscaling, the master-to-model copy and the data-parallel all-reduce are one kernel each;
  AdamW is torch's fused implementation on CUDA.

On one GPU (defaults on CUDA: GPT 1.3B: 24 layers, h 2048, 16 heads, s 2048, V 51200, bf16,
b = 8, m = 4; BERT-large with `--arch bert`: 24 layers, h 1024, 16 heads, s 512, b = 16):

    python tools/bench_gpu.py --device cuda --arch gpt --json gpt.json
    python tools/bench_gpu.py --device cuda --arch bert --json bert.json

Targets on one H100 80GB (stated, not yet measured): GPT 1.3B >= 1.10x the compiled
reference's tokens/s at equal b and m and >= 58% MFU; BERT-large >= 1.25x HF
BertForPreTraining and >= 40% MFU; peak memory <= the compiled reference's + 10%. The script
prints them with the measured ratios on CUDA. `--device cpu --tiny` runs a tiny shape in
seconds: a smoke test, its numbers say nothing about GPUs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

SHAPES = {  # layers, hidden, heads, seq, vocab, micro-batch
    "gpt": dict(layers=24, hidden=2048, heads=16, seq=2048, vocab=51200, micro_batch=8),
    "bert": dict(layers=24, hidden=1024, heads=16, seq=512, vocab=30522, micro_batch=16),
    "tiny": dict(layers=2, hidden=64, heads=4, seq=64, vocab=512, micro_batch=2),
}
TARGETS = {  # on one H100 80GB, against the compiled reference
    "gpt": {"speedup": 1.10, "mfu": 0.58, "memory_ratio": 1.10},
    "bert": {"speedup": 1.25, "mfu": 0.40, "memory_ratio": 1.10},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------ plain PyTorch models
class Block(nn.Module):
    """Pre-LN transformer block on [b, s, h]: x + Attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, hidden: int, heads: int, causal: bool, recompute: bool):
        super().__init__()
        self.heads, self.causal, self.recompute = heads, causal, recompute
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def attention(self, x, mask):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(h, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))

    def layer(self, x, mask):
        x = x + self.attention(self.ln1(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def forward(self, x, mask=None):
        if self.recompute and self.training:
            return torch.utils.checkpoint.checkpoint(self.layer, x, mask, use_reentrant=False)
        return self.layer(x, mask)


class Encoder(nn.Module):
    """Word + position (+ token type) embeddings, blocks, final LayerNorm."""

    def __init__(self, s: dict, causal: bool, recompute: bool, tokentypes: int = 0):
        super().__init__()
        h = s["hidden"]
        self.wte, self.wpe = nn.Embedding(s["vocab"], h), nn.Embedding(s["seq"], h)
        self.wtt = nn.Embedding(tokentypes, h) if tokentypes else None
        self.blocks = nn.ModuleList(Block(h, s["heads"], causal, recompute)
                                    for _ in range(s["layers"]))
        self.ln_f = nn.LayerNorm(h)
        for name, p in self.named_parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens, types=None, mask=None):
        x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
        if self.wtt is not None:
            x = x + self.wtt(types)
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_f(x)


class PlainGPT(nn.Module):
    """nanoGPT's GPT: the logits are x @ wte^T (tied), the loss torch's cross-entropy."""

    def __init__(self, s: dict, recompute: bool):
        super().__init__()
        self.encoder = Encoder(s, causal=True, recompute=recompute)

    def forward(self, batch):
        x = self.encoder(batch["tokens"])
        logits = F.linear(x, self.encoder.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), batch["labels"].view(-1))


class PlainBert(nn.Module):
    """ptdp's BERT (models/bert.py) in plain PyTorch: masked-LM head (dense, GeLU, LN, tied
    logits + bias) on the masked positions and a sentence-order head on [CLS]."""

    def __init__(self, s: dict, recompute: bool):
        super().__init__()
        h = s["hidden"]
        self.encoder = Encoder(s, causal=False, recompute=recompute, tokentypes=2)
        self.lm_dense, self.lm_ln = nn.Linear(h, h), nn.LayerNorm(h)
        self.lm_bias = nn.Parameter(torch.zeros(s["vocab"]))
        self.pooler, self.binary = nn.Linear(h, h), nn.Linear(h, 2)

    def forward(self, batch):
        keep = batch["attention_mask"].bool()[:, None, None, :]
        x = self.encoder(batch["tokens"], batch["types"], keep)
        lm = self.lm_ln(F.gelu(self.lm_dense(x)))
        logits = F.linear(lm, self.encoder.wte.weight, self.lm_bias)
        lm_loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(),
                                  batch["mlm_labels"].view(-1), ignore_index=-100)
        sop = self.binary(torch.tanh(self.pooler(x[:, 0])))
        return lm_loss + F.cross_entropy(sop.float(), batch["sop_label"])


class HFBert(nn.Module):
    """transformers.BertForPreTraining (post-LN, as published), SDPA attention, dropout 0."""

    def __init__(self, s: dict, recompute: bool):
        super().__init__()
        from transformers import BertConfig, BertForPreTraining
        config = BertConfig(vocab_size=s["vocab"], hidden_size=s["hidden"],
                            num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                            intermediate_size=4 * s["hidden"], max_position_embeddings=s["seq"],
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                            attn_implementation="sdpa")
        self.model = BertForPreTraining(config)
        if recompute:
            self.model.gradient_checkpointing_enable()

    def forward(self, batch):
        return self.model(input_ids=batch["tokens"], token_type_ids=batch["types"],
                          attention_mask=batch["attention_mask"], labels=batch["mlm_labels"],
                          next_sentence_label=batch["sop_label"]).loss


def plain_batch(arch: str, s: dict, b: int, device, generator) -> dict:
    """One random micro-batch; BERT masks 15% of positions and pads the last eighth of half
    the sequences (so the padding mask is real)."""
    shape = (b, s["seq"])
    tokens = torch.randint(0, s["vocab"], shape, generator=generator)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1)}
    if arch == "bert":
        masked = torch.rand(shape, generator=generator) < 0.15
        batch["mlm_labels"] = torch.where(masked, tokens, torch.full_like(tokens, -100))
        batch["types"] = (torch.arange(s["seq"]) >= s["seq"] // 2).long().expand(shape).clone()
        attention = torch.ones(shape, dtype=torch.long)
        attention[::2, -max(1, s["seq"] // 8):] = 0
        batch["attention_mask"] = attention
        batch["sop_label"] = torch.randint(0, 2, (b,), generator=generator)
    return {k: v.to(device) for k, v in batch.items()}


class PlainRunner:
    """A plain training step: m micro-batches under autocast, clip, fused AdamW."""

    def __init__(self, args, s: dict, device):
        self.device, self.m = device, args.micro_batches
        recompute = args.recompute != "none"
        if args.arch == "gpt":
            model, self.name = PlainGPT(s, recompute), "reference (plain GPT)"
        elif args.reference == "hf" or (args.reference == "auto" and _has_transformers()):
            model, self.name = HFBert(s, recompute), "reference (HF BertForPreTraining)"
        else:
            model, self.name = PlainBert(s, recompute), "reference (plain BERT)"
        self.model = model.to(device).train()
        self.parameters = sum(p.numel() for p in self.model.parameters())
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95),
                                           fused=device.type == "cuda" or None)
        self.forward = torch.compile(self.model) if args.compile else self.model
        self.dtype = DTYPES[args.precision]
        self.scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
        generator = torch.Generator().manual_seed(1234)
        cpu = torch.device("cpu")
        # host batches, copied to the device every micro-batch as ptdp's are (like with like)
        self.batches = [plain_batch(args.arch, s, args.micro_batch, cpu, generator)
                        for _ in range(self.m)]
        if device.type == "cuda":
            self.batches = [{k: v.pin_memory() for k, v in b.items()} for b in self.batches]

    def step(self, iteration: int) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for host in self.batches:
            batch = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
            with torch.autocast(self.device.type, dtype=self.dtype,
                                enabled=self.dtype != torch.float32):
                loss = self.forward(batch) / self.m
            self.scaler.scale(loss).backward()
            total += loss.detach()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return total.item()  # one host sync per step, as ptdp's loss logging


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
        return True
    except ImportError:
        return False


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
            f"model.seq_length={s['seq']}", f"model.vocab_size={s['vocab']}", "model.dropout=0.0",
            f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.micro_batch * args.micro_batches}",
            f"train.iters={args.warmup + args.steps}", f"train.precision={args.precision}",
            f"train.recompute={args.recompute}", f"train.compile={str(args.compile).lower()}",
            f"train.device={device.type}", "train.lr=1e-4", "log.progress=false",
            "data.source=synthetic", f"train.tf32={str(args.tf32).lower()}",
            f"data.num_workers={args.data_workers}"]
        if args.hardware:
            overrides.append(f"log.hardware={args.hardware}")
        self.cfg = load_config(None, overrides, world_size=1)
        self.trainer = Trainer(self.cfg)
        self.parameters = self.trainer.state.total_parameter_count()

    def step(self, iteration: int) -> float:
        return self.trainer.train_step(iteration).loss


# ------------------------------------------------------------------------ timing
def init_process_group(device) -> None:
    """A 1-rank world on a free port (the Trainer would default to 29500, maybe taken)."""
    from ptdp.runtime.local_ranks import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                **({"device_id": device} if device.type == "cuda" else {}))


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


def time_steps(runner, args, device) -> tuple[list[float], list[float]]:
    """(seconds of each timed step, every step's loss)."""
    losses, seconds = [], []
    for it in range(args.warmup + args.steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(runner.step(it))
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            losses.append(runner.step(it))
            elapsed = time.perf_counter() - t0
        if it >= args.warmup:
            seconds.append(elapsed)
    return seconds, losses


def run_one(make, args, s: dict, device, vocab: int, peak: float | None) -> dict:
    from ptdp.planner.formulas import model_flops_per_iteration
    reset_peak_memory(device)
    runner = make(args, s, device)
    seconds, losses = time_steps(runner, args, device)
    step = statistics.median(seconds)
    batch = args.micro_batch * args.micro_batches
    flops = {passes: model_flops_per_iteration(batch, s["seq"], s["layers"], s["hidden"], vocab,
                                               recompute_forward=passes == 4) for passes in (3, 4)}
    tflops3, tflops4 = flops[3] / step / 1e12, flops[4] / step / 1e12
    row = {"model": runner.name, "micro_batch": args.micro_batch, "micro_batches": args.micro_batches,
           "step_ms": step * 1e3, "step_ms_all": [x * 1e3 for x in seconds],
           "tokens_per_s": batch * s["seq"] / step, "tflops": tflops3, "tflops_eq42": tflops4,
           "mfu": tflops3 / peak if peak else None, "peak_memory_gb": peak_memory_gb(device),
           "peak_reserved_gb": peak_reserved_gb(device),
           "loss_first": losses[0], "loss_last": losses[-1], "parameters": runner.parameters,
           "vocab": vocab}
    del runner
    torch.compiler.reset()  # drop compiled graphs before the next model is measured
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def compare(rows: list[dict], arch: str, device) -> dict:
    ours, ref = rows
    out = {"speedup": ours["tokens_per_s"] / ref["tokens_per_s"],
           "memory_ratio": (ours["peak_memory_gb"] / ref["peak_memory_gb"]
                            if ours["peak_memory_gb"] and ref["peak_memory_gb"] else None),
           "targets": TARGETS[arch], "met": None}
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
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


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
    parser.add_argument("--warmup", type=int, help="untimed steps first (default: 3 CUDA, 1 CPU)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile both models: ptdp per layer (train.compile), the "
                             "reference whole (default: on for CUDA, off on CPU)")
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
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible")
    shape = dict(SHAPES["tiny" if args.tiny else args.arch])
    for name in ("layers", "hidden", "heads", "seq", "vocab"):
        if getattr(args, name) is not None:
            shape[name] = getattr(args, name)
    args.shape = shape
    args.micro_batch = args.micro_batch or shape["micro_batch"]
    args.micro_batches = args.micro_batches or (2 if args.tiny else 4)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    args.compile = cuda if args.compile is None else args.compile
    args.data_workers = (2 if cuda else 0) if args.data_workers is None else args.data_workers
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
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
    init_process_group(device)
    s = args.shape
    from ptdp.config import padded_vocab_size
    from ptdp.metrics.throughput import peak_tflops
    peak = peak_tflops(peak_config(args), device)
    rows = [run_one(PtdpRunner, args, s, device, padded_vocab_size(s["vocab"], 1), peak),
            run_one(PlainRunner, args, s, device, s["vocab"], peak)]
    summary = compare(rows, args.arch, device)
    print(f"{args.arch}: {s['layers']} layers, h {s['hidden']}, {s['heads']} heads, s {s['seq']}, "
          f"V {s['vocab']}, {args.precision}, recompute {args.recompute}, compile "
          f"{'on' if args.compile else 'off'}, TF32 {'on' if args.tf32 else 'off'}, "
          f"{args.data_workers} data worker(s), {device} (peak {peak or 'unknown'} TFLOP/s); "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(table(rows))
    mem = summary["memory_ratio"]
    print(f"ptdp / reference: {summary['speedup']:.3f}x tokens/s, "
          f"{'n/a' if mem is None else f'{mem:.3f}x'} peak memory")
    t = TARGETS[args.arch]
    if device.type == "cuda":
        print(f"targets (one H100 80GB): >= {t['speedup']:.2f}x tokens/s, >= {t['mfu']:.0%} MFU, "
              f"<= {t['memory_ratio']:.2f}x memory; met: {summary['met']}")
    else:
        print("CPU: a smoke test of both paths; these numbers say nothing about GPU speed")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"arch": args.arch, "device": str(device), "shape": s, "precision": args.precision,
             "compile": args.compile, "recompute": args.recompute, "steps": args.steps,
             "tf32": args.tf32, "data_workers": args.data_workers,
             "warmup": args.warmup, "peak_tflops": peak, "rows": rows, **summary}, indent=2))
    import torch.distributed as dist
    dist.destroy_process_group()
    return 0


def peak_config(args):
    """A Config carrying only what `ptdp.metrics.peak_tflops` reads (precision, log.hardware)."""
    from ptdp.config import load_config
    overrides = [f"train.precision={args.precision}"]
    if args.hardware:
        overrides.append(f"log.hardware={args.hardware}")
    return load_config(None, overrides, world_size=1)


if __name__ == "__main__":
    sys.exit(main())
