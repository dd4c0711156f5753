"""Loading a checkpoint into a freshly built trainer, resharding when the layout differs.

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

import torch
import torch.distributed as dist

from ptdp.checkpoint.layout import (OPTIMIZER_KEYS, check_model_config, find_checkpoint,
                                    layout_of, layout_text, load_file, read_metadata,
                                    rng_file_name)
from ptdp.checkpoint.reshard import ShardReader, master_of, to_local
from ptdp.checkpoint.safety import on_all_ranks
from ptdp.metrics.log import drop_records_after
from ptdp.parallel.rng import TensorParallelRNG, seed_everything


def load_checkpoint(trainer, path: str | os.PathLike) -> Path:
    """Restore a checkpoint into a freshly built trainer, resharding if the layout differs.

    Collective. Every rank first reads and checks all of its state; the trainer is modified
    only if that succeeded on every rank, otherwise every rank raises CheckpointError.
    """
    def read():
        directory, note = find_checkpoint(path)
        meta = read_metadata(directory)
        check_model_config(meta, trainer.cfg.model, directory)
        return directory, note, meta, _read_rank_state(trainer, directory, meta)

    directory, note, meta, state = on_all_ranks(f"loading checkpoint {path}", read)
    _apply(trainer, meta, state)
    rank0 = dist.get_rank() == 0
    if rank0 and note:
        print(f"checkpoint.load: {note}", flush=True)
    # The resumed job replays the iterations after this one: keep each in the metrics once.
    metrics_file = trainer.cfg.log.metrics_file
    on_all_ranks(f"trimming {metrics_file} to iteration {meta['iteration']}",
                  lambda: drop_records_after(metrics_file, meta["iteration"])
                  if rank0 and metrics_file else None)
    if rank0 and trainer.cfg.log.progress:
        print(f"loaded checkpoint {directory} (iteration {meta['iteration']}, saved with layout "
              f"{layout_text(meta['layout'])})", flush=True)
    warning = schedule_change_warning(meta, trainer.cfg.train)
    if rank0 and warning:
        print(f"warning: {warning}", flush=True)
    return directory


def schedule_change_warning(meta: dict, train) -> str | None:
    """Say so when a resumed job decays the learning rate over another length than the run
    that saved the checkpoint (typically: train.iters raised to extend a finished run)."""
    saved = meta.get("train") or {}
    if "iters" not in saved or meta.get("rng") is False or train.lr_decay_style == "constant":
        return None   # (converted checkpoints start a new run; a constant LR has no length)
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


def _read_rank_state(trainer, directory: Path, meta: dict) -> dict:
    """Everything this rank needs, read and shape-checked, nothing applied yet."""
    shards = ShardReader(directory, meta)
    if trainer.weights.sharded:
        return _read_sharded_rank_state(trainer, shards, directory, meta)
    masters = master_of(trainer)
    values, optimizer_state, shadow = {}, {}, {}
    for name, param in trainer.named_parameters():
        entry = shards.full(name)
        local = {key: to_local(param, full, trainer, name, key) for key, full in entry.items()
                 if key != "step"}
        master = masters[id(param)]
        values[id(master)] = local["value"]
        if "shadow" in local:
            shadow[id(param)] = local["shadow"]
        if all(k in local for k in OPTIMIZER_KEYS) and "step" in entry:
            optimizer_state[id(master)] = {"step": entry["step"].clone(),
                                          **{k: local[k] for k in OPTIMIZER_KEYS}}
    return {"values": values, "optimizer": optimizer_state, "shadow": shadow,
            "rng": _rng_to_restore(trainer, directory, meta)}


def _read_sharded_rank_state(trainer, shards, directory: Path, meta: dict) -> dict:
    """`_read_rank_state` for the distributed optimizer: whole local tensors for the model
    weights, and for each of this rank's pieces (ptdp/optim/distributed.py) its range of the
    master value and of the Adam moments."""
    model, locals_, steps = {}, [], []
    for name, param in trainer.named_parameters():
        entry = shards.full(name)
        locals_.append({key: to_local(param, full, trainer, name, key).reshape(-1)
                        for key, full in entry.items() if key != "step"})
        steps.append(entry.get("step"))
        model[id(param)] = locals_[-1]["value"].view(param.shape)
    values, optimizer_state = {}, {}
    for piece in trainer.master_params:
        local, step = locals_[piece.param_index], steps[piece.param_index]
        part = {key: tensor[slice(*piece.param_range)].clone() for key, tensor in local.items()}
        values[id(piece)] = part["value"]
        if all(k in part for k in OPTIMIZER_KEYS) and step is not None:
            optimizer_state[id(piece)] = {"step": step.clone(), **{k: part[k] for k in OPTIMIZER_KEYS}}
    return {"values": values, "model": model, "optimizer": optimizer_state, "shadow": {},
            "rng": _rng_to_restore(trainer, directory, meta)}


def _rng_to_restore(trainer, directory: Path, meta: dict) -> dict | None:
    """The saved RNG state of this rank if the layout is unchanged (and was saved), else None."""
    if meta["layout"] != layout_of(trainer.cfg) or not meta.get("rng", True):
        return None
    return load_file(directory / rng_file_name(trainer.grid.rank), mmap=False)


def _apply(trainer, meta: dict, state: dict) -> None:
    """Copy validated state into the trainer (cannot fail on shapes: all checked already)."""
    with torch.no_grad():
        for master in trainer.master_params:
            master.copy_(state["values"][id(master)])
        if "model" in state:   # distributed optimizer: masters of this rank's shard only
            for param in trainer.params:
                param.copy_(state["model"][id(param)])
        for param, master in zip(trainer.params, trainer.master_params):
            if "model" not in state and param is not master:
                param.copy_(master)  # low-precision model weights follow the fp32 masters
    _load_optimizer_state(trainer.optimizer, state["optimizer"])
    if "loss_scaler" in meta:   # absent from converted checkpoints: keep the configured scale
        trainer.loss_scaler.load_state_dict(meta["loss_scaler"])
    if hasattr(trainer.no_flush, "resume"):   # 2BW: the older version the next batch uses
        shadow = state["shadow"]
        values = [shadow[id(p)] for p in trainer.params] if len(shadow) == len(trainer.params) else None
        trainer.no_flush.resume(meta["iteration"], values,
                                meta.get("two_bw", {}).get("loss_scales", {}))
    _restore_rng(trainer, state["rng"], meta["iteration"])
    trainer.iteration = meta["iteration"]


def _load_optimizer_state(optimizer, by_param: dict) -> None:
    """Through load_state_dict, so torch places `step` and casts moments as it expects."""
    sd = optimizer.state_dict()
    index = 0
    state = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in by_param:
                state[index] = by_param[id(p)]
            index += 1
    sd["state"] = state
    optimizer.load_state_dict(sd)


def _restore_rng(trainer, saved: dict | None, iteration: int) -> None:
    """Exact streams when the layout is unchanged; otherwise fresh ones derived from the
    iteration (a rank's stream has no counterpart in another layout, and reusing the
    start-of-training seeds would repeat the first iterations' dropout masks)."""
    if saved is None:
        seed = trainer.cfg.train.seed + 1_000_003 * iteration
        seed_everything(seed, trainer.grid.pp_rank)
        fresh = TensorParallelRNG(seed, trainer.grid.tp_rank, trainer.device)
        trainer.ctx.rng.set_state(fresh.get_state())
        return
    torch.set_rng_state(saved["cpu"])
    trainer.ctx.rng.set_state(saved["tensor_parallel"])
    if "cuda" in saved and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(saved["cuda"], trainer.device)
