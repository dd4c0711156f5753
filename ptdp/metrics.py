"""What a training job reports: the start-up summary, per-iteration metrics (JSON lines,
TensorBoard, console and progress bar). Only rank 0 writes; every rank computes the same
numbers, so any rank could.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch
import yaml

from ptdp.config import Config
from ptdp.hardware import available_hardware, load_hardware
from ptdp.planner.formulas import model_flops, parameter_count


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process in GiB (2**30 bytes): allocated on a GPU, resident on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # VmHWM is this process's own peak; ru_maxrss can carry the launcher's peak across fork.
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def peak_tflops(cfg: Config, device: torch.device) -> float | None:
    """The hardware's peak for the training precision: from log.hardware, or the GPU's name.
    The same number `ptdp plan` divides by for its MFU column (the profile's datasheet peak;
    a measured profile keeps it and records its GEMM rate as an efficiency)."""
    name = cfg.log.hardware
    if name is None and device.type == "cuda":
        gpu = torch.cuda.get_device_name(device).lower()
        gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        for candidate in available_hardware():
            family, _, size = candidate.partition("-")
            if family in gpu and size.endswith("gb") and abs(float(size[:-2]) - gib) < 8:
                name = candidate
    if name is None:
        return None
    peaks = load_hardware(name).peak_tflops
    return peaks.get(cfg.train.precision) or peaks.get("fp32")


def iteration_tflops(cfg: Config, seconds: float, world_size: int) -> float:
    """Model TFLOP/s per GPU: Eq. 4.2 for GPT, BERT's own formula (its LM transform, pooler
    and binary head) for BERT; the recomputed forward counts only when it runs."""
    m, tr = cfg.model, cfg.train
    flops = model_flops(m.arch, tr.global_batch_size, m.seq_length, m.num_layers, m.hidden_size,
                        cfg.padded_vocab_size, recompute_forward=tr.recompute == "full")
    return flops / seconds / world_size / 1e12


def startup_report(cfg: Config, grid, local_params: int, total_params: int,
                   device: torch.device | None = None) -> str:
    """A few lines: model size, layout with each rank's role, batch, precision, outputs.

    The full resolved config goes to a file (`config_path`) and, with log.verbose, here too.
    """
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    eq43 = parameter_count(m.num_layers, m.hidden_size, cfg.padded_vocab_size, m.seq_length)
    world = grid.p * grid.t * grid.d
    lines = []
    if cfg.log.verbose:
        lines += ["ptdp: resolved config", yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip()]
    lines += [
        f"ptdp: {m.arch.upper()} with {total_params / 1e6:.3g} M parameters ({m.num_layers} "
        f"layers, hidden {m.hidden_size}, {m.num_heads} heads, sequence {m.seq_length}, "
        f"vocabulary {m.vocab_size} padded to {cfg.padded_vocab_size}; Eq. 4.3: "
        f"{eq43 / 1e6:.3g} M); {local_params:,} on rank 0",
        f"layout: (p, t, d) = ({par.pipeline}, {par.tensor}, {par.data}), v = {par.chunks}, "
        f"schedule {cfg.schedule.name}, {world} rank(s):",
        *rank_roles(cfg, grid),
        f"batch: {tr.global_batch_size} sequences x {m.seq_length} tokens per iteration = "
        f"{cfg.num_micro_batches} micro-batches of {tr.micro_batch_size} per pipeline x "
        f"{par.data} data replica(s); {tr.iters} iterations",
        f"precision: {tr.precision} on {device.type if device is not None else tr.device}"
        + (" (gloo)" if device is not None and device.type == "cpu" else ""),
        "output: " + outputs_text(cfg),
    ]
    return "\n".join(lines)


MAX_ROLE_LINES = 16


def rank_roles(cfg: Config, grid) -> list[str]:
    """One line per rank (the first MAX_ROLE_LINES): its pipeline stage(s) with their layers,
    its tensor shard and its data replica."""
    from ptdp.parallel.grid import coordinates_of
    from ptdp.pipeline.schedules import rank_stages, stage_layers
    par, world = cfg.parallel, grid.p * grid.t * grid.d
    lines = []
    for rank in range(min(world, MAX_ROLE_LINES)):
        c = coordinates_of(rank, grid.p, grid.d, grid.t)
        stages = rank_stages(c.pipeline, par.pipeline, par.chunks)
        last = par.pipeline * par.chunks - 1
        parts = []
        for s in stages:
            layers = stage_layers(s, par.pipeline, par.chunks, cfg.model.num_layers)
            extra = (" + embedding" if s == 0 else "") + (" + head and loss" if s == last else "")
            parts.append(f"layers {layers.start}-{layers.stop - 1}{extra}")
        lines.append(f"  rank {rank}: pipeline stage {c.pipeline} ({'; '.join(parts)}), "
                     f"tensor shard {c.tensor + 1}/{grid.t}, data replica {c.data + 1}/{grid.d}")
    if world > MAX_ROLE_LINES:
        lines.append(f"  ... {world - MAX_ROLE_LINES} more: rank = (pipeline stage x {grid.d} + "
                     f"data replica) x {grid.t} + tensor shard")
    return lines


def config_path(cfg: Config) -> Path | None:
    """Where the resolved config is written: beside the metrics file (metrics.config.yaml for
    metrics.jsonl), else None."""
    if not cfg.log.metrics_file:
        return None
    metrics = Path(cfg.log.metrics_file)
    return metrics.with_name(metrics.stem + ".config.yaml")


def write_config(cfg: Config) -> Path | None:
    path = config_path(cfg)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


def outputs_text(cfg: Config) -> str:
    ck, log = cfg.checkpoint, cfg.log
    out = []
    if log.metrics_file:
        out.append(f"metrics {log.metrics_file} (config {config_path(cfg)})")
    else:
        out.append("no metrics file (set log.metrics_file)")
    if log.tensorboard_dir:
        out.append(f"TensorBoard {log.tensorboard_dir}")
    if ck.dir:
        when = f"every {ck.save_interval} iterations and at the end" if ck.save_interval else "at the end"
        out.append(f"checkpoints {ck.dir} ({when})")
    else:
        out.append("no checkpoints (set checkpoint.dir)")
    if ck.load:
        out.append(f"resuming from {ck.load}")
    return "; ".join(out)


def format_bytes(n: float) -> str:
    """Binary units: 1023 B, 4.0 KiB, 1.50 MiB, 2.00 GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_tflops(value: float) -> str:
    """Three significant digits, never '0.000': CPU ranks do ~1e-3 TFLOP/s."""
    return f"{value:.3g}"


def end_summary(history: list[dict], cfg: Config, seconds: float, device: torch.device,
                checkpoint: str | None, resume_command: str | None) -> str:
    """What a finished run did, in a few lines (rank 0 prints it)."""
    if not history:
        return f"ptdp: nothing to do: the run was already at train.iters={cfg.train.iters}"
    tr, m = cfg.train, cfg.model
    first, last = history[0]["iter"], history[-1]["iter"]
    tokens = len(history) * tr.global_batch_size * m.seq_length
    step_time = sum(r["step_time_s"] for r in history)
    mean_tflops = sum(r["tflops_per_gpu"] * r["step_time_s"] for r in history) / step_time
    valid = [(r["valid_loss"], r["iter"]) for r in history if "valid_loss" in r]
    lines = [f"ptdp: done: iterations {first}-{last} ({len(history)}) in {seconds:.1f} s, "
             f"{tokens:,} tokens",
             f"  loss: final train {history[-1]['loss']:.4f}"]
    if valid:
        best = min(valid)
        lines[-1] += (f", final validation {valid[-1][0]:.4f} (iteration {valid[-1][1]}), best "
                      f"validation {best[0]:.4f} (iteration {best[1]})")
    else:
        lines[-1] += " (no validation: set train.eval_interval)"
    lines.append(f"  throughput: {tokens / step_time:,.0f} tokens/s, "
                 f"{format_tflops(mean_tflops)} TFLOP/s per rank (model FLOPs), mean step "
                 f"{step_time / len(history) * 1e3:.0f} ms")
    lines.append(f"  peak memory: {max(r['mem_gb'] for r in history):.2f} GiB on rank 0 "
                 f"({'allocated on the GPU' if device.type == 'cuda' else 'resident, CPU'})")
    if checkpoint:
        lines.append(f"  last checkpoint: {checkpoint}")
        if resume_command:
            lines.append(f"  resume (raise train.iters to go further): {resume_command}")
    else:
        lines.append("  no checkpoint written (set checkpoint.dir)")
    return "\n".join(lines)


class MetricsLog:
    """Writes one JSON object per iteration, TensorBoard scalars and console lines (rank 0).

    Iterations that ran validation carry `valid_loss` in the same record.
    """

    def __init__(self, cfg: Config, is_writer: bool):
        self.cfg, self.active = cfg, is_writer
        self.file = self.tensorboard = self.progress = None
        if not is_writer:
            return
        if cfg.log.metrics_file:  # its folder may not exist yet (runs/<name>/metrics.jsonl)
            Path(cfg.log.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(cfg.log.metrics_file, "a")
        if cfg.log.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise RuntimeError("log.tensorboard_dir is set but tensorboard is not installed: "
                                   "pip install 'ptdp[tensorboard]'") from err
            self.tensorboard = SummaryWriter(cfg.log.tensorboard_dir)
        if cfg.log.progress and sys.stderr.isatty():
            from tqdm import tqdm
            self.progress = tqdm(total=cfg.train.iters, desc="train", unit="it")

    def log(self, record: dict) -> None:
        if not self.active:
            return
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tensorboard:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "iter":
                    self.tensorboard.add_scalar(f"train/{key}", value, record["iter"])
        if self.progress:
            self.progress.update(1)
            self.progress.set_postfix(loss=f"{record['loss']:.4f}")
        if record["iter"] % self.cfg.log.interval == 0 or "valid_loss" in record:
            self.print(self._line(record))

    def _line(self, r: dict) -> str:
        mfu = f" | mfu {r['mfu']:.1%}" if r["mfu"] is not None else ""
        skipped = " | skipped (overflow)" if r["skipped"] else ""
        valid = f" | valid loss {r['valid_loss']:.4f}" if "valid_loss" in r else ""
        # tflops_per_gpu and mem_gb keep their record names; the values are per rank, and
        # mem_gb is in GiB (2**30 bytes)
        return (f"iter {r['iter']:>6}/{self.cfg.train.iters} | loss {r['loss']:.4f} | "
                f"lr {r['lr']:.2e} | grad norm {r['grad_norm']:.3f} | "
                f"{r['step_time_s'] * 1e3:.0f} ms | {r['tokens_per_s']:.0f} tok/s | "
                f"{format_tflops(r['tflops_per_gpu'])} TFLOP/s per rank{mfu} | "
                f"{r['mem_gb']:.2f} GiB{valid}{skipped}")

    def print(self, text: str) -> None:
        if not self.active:
            return
        if self.progress:
            self.progress.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for handle in (self.file, self.tensorboard, self.progress):
            if handle:
                handle.close()


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics file (one JSON object per line), in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def drop_records_after(path: str | Path, iteration: int) -> int:
    """Keep only the records with iter <= `iteration`; returns how many were dropped.

    A job resumed from iteration N logs N+1, N+2, ... again, so the records a crashed run wrote
    after its checkpoint go. A torn last line (the run died mid-write) goes too. The file is
    replaced atomically, so a crash here leaves the old file, never a half-written one.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            keep = json.loads(line)["iter"] <= iteration
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped
