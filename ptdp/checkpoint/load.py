"""Loading a checkpoint into a freshly built training state, resharding when the layout differs.

Every rank first reads and checks all of its state; the trainer is modified only if that
succeeded on every rank (failures are shared, ptdp/checkpoint/safety.py), otherwise every rank
raises CheckpointError. The learning rate and the data position are pure functions of the
iteration, so restoring the iteration restores both.

Each of the state's parts (`state.parts()`, ptdp/training/state.py) is handed what the
checkpoint holds of it, where its `StatePart` says (ptdp/checkpoint/layout.py): its metadata,
its per-parameter entries resharded for this layout, its rank file when the layout is the
saved one; {} when the checkpoint holds nothing of it (a converted checkpoint, another layout
or schedule): the part then keeps or makes a fresh state, as its own load_state_dict says.
The same happens to the parts that checkpoint.load_optimizer=false, load_rng=false and
finetune=true withhold from the checkpoint checkpoint.load names (`withheld_parts`; finetune
also leaves the progress at iteration 0).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from ptdp.checkpoint.integrity import (DamagedCheckpoint, expected_checksum, load_verified,
                                       verify_metadata)
from ptdp.checkpoint.layout import (PARAMETERS, CheckpointError, check_model_config, layout_of,
                                    layout_text, load_candidates, rank_file_name, read_metadata)
from ptdp.checkpoint.reshard import ShardReader, to_local
from ptdp.checkpoint.retention import protect
from ptdp.checkpoint.safety import on_all_ranks, shared_failure
from ptdp.config.batches import BatchSchedule
from ptdp.config.schema import AUTO_LOAD, schedule_lengths


def load_checkpoint(state, path: str | os.PathLike) -> Path:
    """Restore a checkpoint into a freshly built training state (ptdp/training/state.py),
    resharding if the layout differs. Collective; returns the directory loaded.

    A checkpoint that fails verification (ptdp/checkpoint/integrity.py: a file's size or
    checksum, the metadata's checksum, an unreadable file) is skipped with one line, and the
    next older one is tried, whatever the damage, when `path` is a checkpoint root or the newest
    checkpoint of checkpoint.dir that `checkpoint.load=auto` or a restart picked; a checkpoint
    named as such is loaded or refused."""
    cfg, rank0 = state.cfg, dist.get_rank() == 0
    candidates = [on_all_ranks(f"finding checkpoint {path}",
                               lambda: load_candidates(path, cfg.checkpoint) if rank0 else None)]
    dist.broadcast_object_list(candidates, src=0)   # every rank tries the same, in order
    skipped = []
    for directory, note in candidates[0]:
        directory = Path(directory)
        meta, loaded = on_all_ranks(f"loading checkpoint {directory}",
                                    lambda: _read_verified(state, directory))
        damage = shared_failure(f"verifying checkpoint {directory}",
                                loaded if meta is None else None)
        if damage:
            skipped.append(damage)
            if rank0:
                print(f"checkpoint.load: skipping {directory}: {damage}", flush=True)
            continue
        fresh = withheld_parts(cfg.checkpoint, path, [part.key for part, _ in loaded])
        for part, saved in loaded:   # (cannot fail on shapes: all checked already)
            if part.key in fresh:
                _start_fresh(part, saved)
            else:
                part.state.load_state_dict(saved)
        protect(directory)   # verified: retention keeps it while this job runs
        _report(state, directory, meta, note, fresh)
        return directory
    raise NoIntactCheckpoint(f"no intact checkpoint to load from {path}: " + "; ".join(skipped))


PROGRESS = None   # the progress part's key: the metadata's top level

# checkpoint.load_optimizer=false, load_rng=false and finetune=true: the parts left fresh
WITHOUT_OPTIMIZER = ("optimizer", "loss_scaler")
WITHOUT_RNG = ("rng",)
WEIGHTS_ONLY = ("weights", "moe")   # finetune: every other part starts fresh


def withheld_parts(ck, path, keys: list) -> set:
    """Of the parts' `keys`, those that start fresh instead of loading: what
    checkpoint.load_optimizer, load_rng and finetune name, when `path` is the checkpoint
    checkpoint.load names. A job's own newest checkpoint in checkpoint.dir, which `auto` or a
    restart resumes from (ptdp/checkpoint/layout.py `resolve_load`), always loads whole."""
    if ck.load in (None, AUTO_LOAD) or str(path) != str(ck.load):
        return set()
    if ck.finetune:
        return {key for key in keys if key not in WEIGHTS_ONLY}
    return set(WITHOUT_OPTIMIZER * (not ck.load_optimizer) + WITHOUT_RNG * (not ck.load_rng))


def _start_fresh(part, saved: dict) -> None:
    """Leave a withheld part as built, except that parts numbered from the progress (the random
    streams, the weight versions) are handed {} as when a checkpoint holds nothing of them
    (ptdp/checkpoint/layout.py `StatePart`); per-parameter parts get entries with nothing in
    them, so every parameter keeps a fresh state."""
    if part.key is PROGRESS:
        return
    if part.per_parameter:
        part.state.load_state_dict({PARAMETERS: [{} for _ in saved.get(PARAMETERS, ())]})
    else:
        part.state.load_state_dict({})


class NoIntactCheckpoint(CheckpointError):
    """Every checkpoint that could be loaded failed verification."""


def _read_verified(state, directory: Path) -> tuple[dict | None, list | str]:
    """(metadata, what each part loads), or (None, why the checkpoint is damaged). Errors that
    are not damage (another model, a file system error) raise."""
    try:
        meta = read_metadata(directory)
        verify_metadata(meta, directory)
    except CheckpointError as err:   # unreadable, incomplete or edited metadata
        return None, str(err)
    check_model_config(meta, state.cfg.model, directory)
    try:
        return meta, _read_rank_state(state, directory, meta)
    except DamagedCheckpoint as err:
        return None, str(err)


def _report(state, directory: Path, meta: dict, note: str | None, fresh: set) -> None:
    if dist.get_rank() != 0:
        return
    if note:
        print(f"checkpoint.load: {note}", flush=True)
    if state.cfg.log.progress:
        print(f"loaded checkpoint {directory} (iteration {meta['iteration']}, saved with layout "
              f"{layout_text(meta['layout'])})", flush=True)
    if fresh:   # always said: a fresh optimizer or iteration 0 changes the run
        kept = sorted(str(key or "progress") for key in fresh)
        print(f"checkpoint.load: fresh {', '.join(kept)} (checkpoint.load_optimizer, load_rng, "
              f"finetune){'; fine-tuning from iteration 0' if PROGRESS in fresh else ''}",
              flush=True)
    if PROGRESS in fresh:   # a new run: its batches and schedule are its own
        return
    for warning in (batch_change_warning(meta, state.cfg.train),
                    schedule_change_warning(meta, state.cfg.train)):
        if warning:
            print(f"warning: {warning}", flush=True)


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


def _read_rank_state(state, directory: Path, meta: dict) -> list:
    """(part, what it loads) for every part of this rank's state, read, resharded and
    shape-checked; nothing applied yet."""
    entries = _parameter_entries(state, directory, meta)
    loaded = []
    for part in state.parts():
        if part.per_rank:
            saved = _rank_file(state, directory, meta, part.key)
        else:
            saved = dict(meta if part.key is None else meta.get(part.key) or {})
            if part.per_parameter:
                saved[PARAMETERS] = entries
        loaded.append((part, saved))
    return loaded


def _parameter_entries(state, directory: Path, meta: dict) -> list[dict]:
    """Per parameter of this rank, every saved entry as a whole local tensor of this layout
    ("step" as saved)."""
    shards = ShardReader(directory, meta)
    entries = []
    for name, param in state.named_parameters():
        entry = shards.full(name)
        entries.append({key: full if key == "step" else
                        to_local(param, full, state.tp, state.cfg.padded_vocab_size, name, key)
                        for key, full in entry.items()})
    return entries


def _rank_file(state, directory: Path, meta: dict, key: str) -> dict:
    """This rank's saved file of a per-rank part if the layout is unchanged (and it was
    saved: converted checkpoints mark `key: false`), else {}."""
    if meta["layout"] != layout_of(state.cfg) or meta.get(key, True) is False:
        return {}
    name = rank_file_name(key, state.grid.rank)
    return load_verified(directory / name, expected_checksum(meta, name), mmap=False)
