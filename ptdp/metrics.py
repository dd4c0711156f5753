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


def startup_report(cfg: Config, grid, local_params: int, total_params: int) -> str:
    m, par = cfg.model, cfg.parallel
    eq43 = parameter_count(m.num_layers, m.hidden_size, cfg.padded_vocab_size, m.seq_length)
    return "\n".join([
        "ptdp: resolved config",
        yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(),
        f"layout: (p, t, d) = ({par.pipeline}, {par.tensor}, {par.data}), v = {par.chunks}, "
        f"schedule {cfg.schedule.name}, {cfg.num_micro_batches} micro-batches of "
        f"{cfg.train.micro_batch_size} per pipeline, world size {grid.p * grid.t * grid.d}",
        f"parameters: {local_params:,} on rank 0, {total_params:,} in the model "
        f"(Eq. 4.3: {eq43:,.0f}; padded vocabulary {cfg.padded_vocab_size})",
    ])


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
        return (f"iter {r['iter']:>6}/{self.cfg.train.iters} | loss {r['loss']:.4f} | "
                f"lr {r['lr']:.2e} | grad norm {r['grad_norm']:.3f} | "
                f"{r['step_time_s'] * 1e3:.0f} ms | {r['tokens_per_s']:.0f} tok/s | "
                f"{r['tflops_per_gpu']:.3f} TFLOP/s/GPU{mfu} | {r['mem_gb']:.2f} GB{valid}{skipped}")

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
