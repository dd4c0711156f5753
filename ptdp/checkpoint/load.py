"""Loading a checkpoint into a freshly built training state, resharding when the layout differs.

Every rank first reads and checks all of its state; the trainer is modified only if that
succeeded on every rank (failures are shared, ptdp/checkpoint/safety.py), otherwise every rank
raises CheckpointError. The learning rate and the data position are pure functions of the
iteration, so restoring the iteration restores both.

PipeDream-2BW without a saved shadow (a checkpoint of another schedule) starts as at iteration
0: its first two batches use the loaded weights. PipeDream async saves its newest weights; a
resumed run refills the pipeline, so its first p-1 inputs see fresher weights than they would
have without the interruption.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from ptdp.checkpoint.layout import (OPTIMIZER_KEYS, check_model_config, find_checkpoint, layout_of,
                                    layout_text, load_file, read_metadata, rng_file_name)
from ptdp.checkpoint.reshard import ShardReader, to_local
from ptdp.checkpoint.safety import on_all_ranks
from ptdp.config.batches import BatchSchedule
from ptdp.config.schema import schedule_lengths
from ptdp.metrics.log import drop_records_after


def load_checkpoint(state, path: str | os.PathLike) -> Path:
    """Restore a checkpoint into a freshly built training state (ptdp/training/state.py),
    resharding if the layout differs. Collective; returns the directory loaded."""
    cfg = state.cfg

    def read():
        directory, note = find_checkpoint(path)
        meta = read_metadata(directory)
        check_model_config(meta, cfg.model, directory)
        return directory, note, meta, _read_rank_state(state, directory, meta)

    directory, note, meta, parts = on_all_ranks(f"loading checkpoint {path}", read)
    _apply(state, meta, parts)
    rank0 = dist.get_rank() == 0
    if rank0 and note:
        print(f"checkpoint.load: {note}", flush=True)
    # The resumed job replays the iterations after this one: keep each in the metrics once.
    metrics_file = cfg.log.metrics_file
    on_all_ranks(f"trimming {metrics_file} to iteration {meta['iteration']}",
                 lambda: drop_records_after(metrics_file, meta["iteration"])
                 if rank0 and metrics_file else None)
    if rank0 and cfg.log.progress:
        print(f"loaded checkpoint {directory} (iteration {meta['iteration']}, saved with layout "
              f"{layout_text(meta['layout'])})", flush=True)
    warnings = (batch_change_warning(meta, cfg.train), schedule_change_warning(meta, cfg.train))
    for warning in warnings:
        if rank0 and warning:
            print(f"warning: {warning}", flush=True)
    return directory


def batch_change_warning(meta: dict, train) -> str | None:
    """Say so when this config's batches (train.global_batch_size, train.rampup_batch_size)
    would have consumed another number of samples in the checkpoint's iterations: the data
    position and the learning rate follow this config's count (ptdp/config/batches.py), not the
    checkpoint's."""
    saved, iteration = meta.get("consumed_samples"), meta["iteration"]
    now = BatchSchedule.of(train).consumed(iteration)
    if saved is None or saved == now:
        return None
    return (f"the checkpoint consumed {saved} samples in its {iteration} iterations, this "
            f"config's batches (train.global_batch_size, train.rampup_batch_size) make {now}: "
            f"the data position and the learning rate continue from {now}")


def schedule_change_warning(meta: dict, train) -> str | None:
    """Say so when a resumed job decays the learning rate over another length than the run
    that saved the checkpoint (typically: train.iters raised to extend a finished run)."""
    saved = meta.get("train") or {}
    if "iters" not in saved or meta.get("rng") is False or train.lr_decay_style == "constant":
        return None   # (converted checkpoints start a new run; a constant LR has no length)
    if saved.get("train_samples") is not None or train.train_samples is not None:
        return _sample_schedule_change(meta, saved, train)
    before = saved.get("lr_decay_iters") or saved["iters"]
    now = train.lr_decay_iters or train.iters
    if before == now:
        return None
    how = (f"train.iters went from {saved['iters']} to {train.iters}"
           if train.lr_decay_iters is None and saved.get("lr_decay_iters") is None
           else f"the decay length went from {before} to {now} iterations")
    return (f"{how}, so the learning-rate schedule is stretched: from iteration "
            f"{meta['iteration'] + 1} on it follows a {train.lr_decay_style} decay over {now} "
            f"iterations, not the saved run's {before}. Set train.lr_decay_iters={before} to "
            f"keep the saved run's schedule (the LR then stays at train.min_lr after it)")


def _sample_schedule_change(meta: dict, saved: dict, train) -> str | None:
    """The same for sample-based runs (train.train_samples), whose decay counts samples."""
    before = saved.get("lr_decay_samples") or saved.get("train_samples") \
        or (saved.get("lr_decay_iters") or saved["iters"]) * saved.get("global_batch_size", 0)
    now = schedule_lengths(train).decay
    if before == now:
        return None
    return (f"the decay length went from {before} to {now} samples (train.train_samples or "
            f"train.lr_decay_samples), so the learning-rate schedule is stretched: from iteration "
            f"{meta['iteration'] + 1} on it follows a {train.lr_decay_style} decay over {now} "
            f"samples, not the saved run's {before}. Set train.lr_decay_samples={before} to keep "
            f"the saved run's schedule (the LR then stays at train.min_lr after it)")


def _read_rank_state(state, directory: Path, meta: dict) -> dict:
    """Everything this rank's state parts load, read, resharded and shape-checked, per
    parameter; nothing applied yet."""
    shards = ShardReader(directory, meta)
    values, optimizer, shadow = [], [], []
    for name, param in state.named_parameters():
        entry = shards.full(name)
        local = {key: to_local(param, full, state.tp, state.cfg.padded_vocab_size, name, key)
                 for key, full in entry.items() if key != "step"}
        values.append(local["value"])
        optimizer.append({**{key: local[key] for key in OPTIMIZER_KEYS if key in local},
                          **({"step": entry["step"]} if "step" in entry else {})})
        shadow.append(local.get("shadow"))
    return {"values": values, "optimizer": optimizer,
            "shadow": shadow if all(s is not None for s in shadow) else None,
            "rng": _rng_to_restore(state, directory, meta)}


def _rng_to_restore(state, directory: Path, meta: dict) -> dict | None:
    """The saved RNG state of this rank if the layout is unchanged (and was saved), else None."""
    if meta["layout"] != layout_of(state.cfg) or not meta.get("rng", True):
        return None
    return load_file(directory / rng_file_name(state.grid.rank), mmap=False)


def _apply(state, meta: dict, parts: dict) -> None:
    """Load every part of the state (cannot fail on shapes: all checked already)."""
    state.weight_state().load_state_dict(parts["values"])
    state.optimizer_state().load_state_dict(parts["optimizer"])
    if "loss_scaler" in meta:   # absent from converted checkpoints: keep the configured scale
        state.loss_scaler.load_state_dict(meta["loss_scaler"])
    state.progress.load_state_dict(meta)   # first: 2BW's versions are numbered from it
    if state.versions is not None:   # 2BW: the older version the next batch uses
        state.versions.load_state_dict({"shadow": parts["shadow"], "loss_scales": meta.get(
            "two_bw", {}).get("loss_scales", {})})
    if parts["rng"] is not None:
        state.rng.load_state_dict(parts["rng"])
    else:   # a rank's stream has no counterpart in another layout, and reusing the
        # start-of-training seeds would repeat the first iterations' dropout masks
        state.rng.reseed(state.cfg.train.seed + 1_000_003 * meta["iteration"])
