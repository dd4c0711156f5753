"""Per-iteration metrics: one JSON object per iteration (one file for the whole job), TensorBoard
and Weights & Biases scalars (ptdp/metrics/wandb_log.py), console lines and the progress bar, written by rank 0; and the resolved config beside
the metrics file.

The file and TensorBoard keep every iteration; a console line, printed every log.interval
iterations, averages the interval since the previous line (`interval_average`), as Megatron-LM's
log lines do.

Auxiliary losses (the ones pipeline stages add to the objective, ptdp/pipeline/executor.py)
are fields `aux/<name>` of the record, averaged like the loss, and shown on the console line
after it (`aux <name> <value>`); a run without them writes exactly the fields it always did.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml

from ptdp.config import Config


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


AUX_PREFIX = "aux/"


def aux_loss_fields(aux_losses: dict) -> dict:
    """The record's fields for the iteration's aux losses: {"aux/<name>": value}."""
    return {AUX_PREFIX + name: value for name, value in aux_losses.items()}


def aux_loss_text(record: dict) -> str:
    """" | aux <name> <value>" for each aux loss in `record` ("" without any)."""
    return "".join(f" | aux {key[len(AUX_PREFIX):]} {value:.4g}" for key, value in record.items()
                   if key.startswith(AUX_PREFIX))


LOAD_FIELD = "moe/load_max_over_mean"


def load_text(record: dict) -> str:
    """" | load max/mean <x>" for an MoE model's record ("" without experts)."""
    return f" | load max/mean {record[LOAD_FIELD]:.2f}" if LOAD_FIELD in record else ""


def format_tflops(value: float) -> str:
    """Three significant digits, never '0.000': CPU ranks do ~1e-3 TFLOP/s."""
    return f"{value:.3g}"


class MetricsLog:
    """Writes one JSON object per iteration, TensorBoard scalars and console lines (rank 0).

    Iterations that ran validation carry `valid_loss` in the same record.
    """

    def __init__(self, cfg: Config, is_writer: bool, first_iteration: int = 0):
        """`first_iteration`: the iterations already done (the checkpoint's, 0 for a fresh
        start); the file is cut back to them, so that each iteration appears once however
        often the job was restarted."""
        self.cfg, self.active = cfg, is_writer
        self.file = self.tensorboard = self.wandb = self.progress = None
        self.window: list[dict] = []   # the records since the last console line
        if not is_writer:
            return
        if cfg.log.metrics_file:  # its folder may not exist yet (runs/<name>/metrics.jsonl)
            Path(cfg.log.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            drop_records_after(cfg.log.metrics_file, first_iteration)
            self.file = open(cfg.log.metrics_file, "a")
        if cfg.log.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise RuntimeError("log.tensorboard_dir is set but tensorboard is not installed: "
                                   "pip install 'ptdp[tensorboard]'") from err
            self.tensorboard = SummaryWriter(cfg.log.tensorboard_dir)
        if cfg.log.wandb_project:
            from ptdp.metrics.wandb_log import WandbRun
            self.wandb = WandbRun(cfg)
        if cfg.log.progress and sys.stderr.isatty():
            from tqdm import tqdm
            self.progress = tqdm(total=cfg.train.iters, desc="train", unit="it")

    def log(self, record: dict) -> None:
        """Write `record` to the file and TensorBoard as it is; print the console line at the end
        of every log.interval iterations (and after a validation), averaged over the iterations
        since the last line."""
        if not self.active:
            return
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tensorboard:
            for key, value in scalars(record).items():
                self.tensorboard.add_scalar(key, value, record["iter"])
        if self.wandb:
            self.wandb.log(scalars(record), record["iter"])
        if self.progress:
            self.progress.update(1)
            self.progress.set_postfix(loss=f"{record['loss']:.4f}")
        self.window.append(record)
        if record["iter"] % self.cfg.log.interval == 0 or "valid_loss" in record:
            self.print(self._line(interval_average(self.window)))
            self.window = []

    def _line(self, r: dict) -> str:
        mfu = f" | mfu {r['mfu']:.1%}" if r["mfu"] is not None else ""
        skipped = f" | skipped {r['skipped']} (overflow)" if r["skipped"] else ""
        valid = f" | valid loss {r['valid_loss']:.4f}" if "valid_loss" in r else ""
        batch = f" | batch {r['global_batch_size']}" if self.cfg.train.rampup_batch_size else ""
        # tflops_per_gpu and mem_gb keep their record names; the values are per rank, and
        # mem_gb is in GiB (2**30 bytes)
        return (f"iter {r['iter']:>6}/{self.cfg.train.iters} | loss {r['loss']:.4f}"
                f"{aux_loss_text(r)}{load_text(r)} | lr {r['lr']:.2e}{batch} | grad norm {r['grad_norm']:.3f} | "
                f"{r['step_time_s'] * 1e3:.0f} ms | {r['tokens_per_s']:.0f} tok/s | "
                f"{format_tflops(r['tflops_per_gpu'])} TFLOP/s per rank{mfu} | "
                f"{r['mem_gb']:.2f} GiB{valid}{skipped}")

    def print(self, text: str | None) -> None:
        if not self.active or not text:
            return
        if self.progress:
            self.progress.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for handle in (self.file, self.tensorboard, self.wandb, self.progress):
            if handle:
                handle.close()


def scalars(record: dict) -> dict:
    """The record's numbers as TensorBoard and W&B log them: {"train/<key>": value}."""
    return {f"train/{key}": value for key, value in record.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "iter"}


def interval_average(records: list[dict]) -> dict:
    """One console line's values for the iterations `records` (as Megatron-LM's `training_log`):
    the loss (and each aux loss) averaged over the iterations that updated the weights (all of
    them if none did), step time averaged, throughput and TFLOP/s over the interval's total time, the number of
    skipped iterations; the learning rate, gradient norm, loss scale and memory of the last
    iteration, and its validation loss if it ran one."""
    last, seconds = records[-1], sum(r["step_time_s"] for r in records)
    updated = [r for r in records if not r["skipped"]] or records
    per_second = lambda key: sum(r[key] * r["step_time_s"] for r in records) / seconds  # noqa: E731
    aux = {key: sum(r[key] for r in updated) / len(updated)
           for key in last if key.startswith(AUX_PREFIX)}
    return {**last, **aux, "loss": sum(r["loss"] for r in updated) / len(updated),
            "step_time_s": seconds / len(records),
            "tokens_per_s": per_second("tokens_per_s"),
            "tflops_per_gpu": per_second("tflops_per_gpu"),
            "mfu": per_second("mfu") if last["mfu"] is not None else None,
            "skipped": sum(bool(r["skipped"]) for r in records)}


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
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped
