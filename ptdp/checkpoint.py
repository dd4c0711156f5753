"""Sharded checkpoints: atomic save, exact resume, and resharding to another (p, t, d, v).

Layout of one checkpoint (N = iterations done, zero-padded to 7 digits):

    {dir}/latest                      "iter_000000N": the newest complete checkpoint
    {dir}/iter_000000N/metadata.json  iteration, layout, model and train config, loss scaler,
                                      and per global parameter name: full shape,
                                      tp_split_dim, vocab_padded and the pipeline rank holding it
    {dir}/iter_000000N/model_pp{P:03d}_tp{T:03d}.pt
                                      one per model-parallel rank, written by data rank 0:
                                      {name: {"value", "exp_avg", "exp_avg_sq", "step"}} with the
                                      shards of the master (fp32) weights and their AdamW state;
                                      2BW adds "shadow": the older of its two weight versions
    {dir}/iter_000000N/rng_rank{R:05d}.pt
                                      one per world rank: CPU/CUDA and tensor-parallel RNG
    {dir}/iter_000000N/config.yaml    the job's full resolved config (also in metadata.json)
    {dir}/iter_000000N/tokenizer.model
                                      a copy of data.tokenizer, when set (generation and
                                      `ptdp convert` need no other file)

A checkpoint written by `save_full_state` (`ptdp convert --from hf`) has no RNG files and
no optimizer state and no loss scale: a job loading it starts fresh RNG streams, fresh AdamW
moments and the configured loss scale.

Atomicity: everything is written into `iter_N.tmp/`, every rank reports success, then rank 0
writes metadata.json, renames the directory to `iter_N` and replaces `latest` with
os.replace. A crash at any point leaves either a `.tmp` directory (never loaded) or a complete
checkpoint, and `latest` names a complete one. Re-saving an iteration that exists never
removes the old copy before the new one is in place: the new one is published as
`iter_N.new`, `latest` is switched to it, the old copy is moved to `iter_N.old.tmp` and
deleted, then `iter_N.new` becomes `iter_N` and `latest` follows. The one moment where
`latest` names nothing (between the last rename and the last switch) is covered by the
loader's fallback: when `latest` is missing or names an incomplete directory, the newest
complete checkpoint in the folder is loaded, with a one-line note. Each save starts by
removing leftovers of crashed saves (`*.tmp`, and `*.new` that `latest` does not name).

PipeDream-2BW: after N iterations the masters are W(N) and batch N still runs with W(N-1), the
shadow version; it is saved beside each value (and the fp16 loss scales fixed for batches N and
N+1, in the metadata), so a resumed 2BW run recomputes batch N with W(N-1) and continues the
loss sequence of the uninterrupted run exactly. Without a saved shadow (a checkpoint of another
schedule) a 2BW run starts as at iteration 0: its first two batches use the loaded weights.
PipeDream async saves its newest weights; a resumed run refills the pipeline, so its first p-1
inputs see fresher weights than they would have without the interruption.

Resharding: shards are layout-specific, but the global names, full shapes and split dims in
the metadata are not. A loading rank rebuilds the full tensor of each of its parameters from
the saved shards (concatenate along tp_split_dim, trim vocab padding) and slices it for its
own layout with `ptdp.sharding.local_slice`, so any (p, t, d, v) can load any other's
checkpoint. Data position and learning rate are pure functions of the iteration, so restoring
the iteration restores both.

Distributed optimizer (ptdp/optim/distributed.py): each data rank holds the masters and Adam
moments of its shard of every bucket only. At a save the data ranks all-gather them into whole
tensors and data rank 0 writes the same entries as without it; at a load each rank slices its
pieces' ranges out of the rebuilt local tensors. The files do not depend on whether it was on,
so checkpoints move freely between runs with and without it.

Failures on any rank are shared with every rank (one small all_gather), so a job never hangs
in a collective because one rank could not read or write, and a trainer is only modified
after every rank has read and checked all of its state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ptdp.metrics import drop_records_after
from ptdp.parallel.tensor import TensorParallelRNG, seed_everything
from ptdp.sharding import local_slice

FORMAT_VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"
TMP_SUFFIX = ".tmp"
RESAVE_SUFFIX = ".new"   # a re-saved iteration, published beside the copy it replaces
CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.model"
# Directory names a checkpoint can be loaded from: iter_N, or iter_N.new mid-way in a re-save.
CHECKPOINT_NAME = re.compile(r"iter_(\d+)(\.new)?")
OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq")
# Model keys that do not change what the saved weights mean; a resumed job may change them.
NON_STRUCTURAL_MODEL_KEYS = ("dropout", "init_std")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the path or parameter."""


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def shard_file_name(pp_rank: int, tp_rank: int) -> str:
    return f"model_pp{pp_rank:03d}_tp{tp_rank:03d}.pt"


def rng_file_name(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


# --------------------------------------------------------------------------------------------
# Agreement between ranks
# --------------------------------------------------------------------------------------------

def _on_all_ranks(what: str, fn):
    """Run fn() on this rank; if it failed on any rank, raise on every rank.

    Returns fn's local result. Only the error text travels, so results may be large.
    """
    error, result = None, None
    try:
        result = fn()
    except Exception as err:  # shared below, then re-raised (chained) on this rank too
        error = err
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, msg) for rank, msg in enumerate(messages) if msg is not None]
    if failed:
        rank, msg = failed[0]
        others = f" (and on {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise CheckpointError(f"{what} failed on rank {rank}{others}: {msg}") from error
    return result


def _all_gather(obj) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------

def save_checkpoint(trainer, directory: str | os.PathLike) -> Path:
    """Write the trainer's state after `trainer.iteration` iterations; returns the final dir.

    Collective: every rank of the job must call it.
    """
    root = Path(directory)
    final = root / iteration_dir_name(trainer.iteration)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    rank0 = dist.get_rank() == 0
    _on_all_ranks(f"preparing checkpoint {tmp}", lambda: _prepare(root, tmp) if rank0 else None)
    # The distributed optimizer's state is sharded over the data group: every data rank takes
    # part in assembling the whole tensors that data rank 0 writes, in the usual format.
    gathered = (trainer.weights.gather_optimizer_state(trainer.optimizer)
                if trainer.weights.sharded else None)
    info = _on_all_ranks(f"writing checkpoint {tmp}",
                         lambda: _write_rank_files(trainer, tmp, gathered))
    params = {}
    for part in _all_gather(info):
        params.update(part)
    def publish():
        _write_config_and_tokenizer(trainer.cfg, tmp)
        _publish(tmp, final, _metadata(trainer, params))

    _on_all_ranks(f"publishing checkpoint {final}", lambda: publish() if rank0 else None)
    return final


def _write_config_and_tokenizer(cfg, tmp: Path) -> None:
    """The resolved config as YAML, and a copy of the tokenizer, beside the shards."""
    import yaml
    _write_text_durably(tmp / CONFIG_FILE, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    if cfg.data.tokenizer and Path(cfg.data.tokenizer).is_file():
        shutil.copyfile(cfg.data.tokenizer, tmp / TOKENIZER_FILE)


def _reached(stage: str) -> None:
    """Called after each step of a save; does nothing. Tests replace it to crash a save there."""


def _prepare(root: Path, tmp: Path) -> None:
    """Finish or discard what crashed saves left, then make an empty `tmp` directory."""
    root.mkdir(parents=True, exist_ok=True)
    named = _latest_name(root)
    if named and named.endswith(RESAVE_SUFFIX) and not _incomplete(root / named):
        _finish_resave(root / named, root / named[: -len(RESAVE_SUFFIX)])
        named = _latest_name(root)
    for entry in root.iterdir():
        stale = entry.name.endswith(TMP_SUFFIX) or (
            entry.name.endswith(RESAVE_SUFFIX) and entry.name != named)
        if stale:
            _remove(entry)
    tmp.mkdir()
    _reached("tmp_dir")


def _latest_name(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _write_rank_files(trainer, tmp: Path, gathered: tuple | None) -> dict:
    """This rank's files; returns metadata of the parameters it saved ({} if none)."""
    grid = trainer.grid
    _save_durably(_rng_state(trainer), tmp / rng_file_name(grid.rank))
    if grid.dp_rank != 0:  # data-parallel replicas hold identical model and optimizer state
        _reached("rank_files")
        return {}
    shards, info = _model_shards(trainer) if gathered is None else _gathered_shards(trainer, *gathered)
    _save_durably(shards, tmp / shard_file_name(grid.pp_rank, grid.tp_rank))
    _reached("rank_files")
    return info


def _model_shards(trainer) -> tuple[dict, dict]:
    """({name: saved tensors}, {name: metadata}) for this rank's unique parameters."""
    masters = _master_of(trainer)
    shadow = _shadow_of(trainer)
    shards, info = {}, {}
    for name, param in trainer.named_parameters():
        if getattr(param, "duplicate", False):  # the tied head's copy; the original is saved
            continue
        master = masters[id(param)]
        entry = {"value": master.detach().cpu().clone()}
        if shadow is not None:
            entry["shadow"] = shadow[id(param)].detach().float().cpu().clone()
        state = trainer.optimizer.state.get(master, {})
        for key in OPTIMIZER_KEYS + ("step",):
            if key in state:
                entry[key] = torch.as_tensor(state[key]).detach().cpu().clone()
        shards[name] = entry
        info[name] = _param_metadata(param, trainer)
    return shards, info


def _gathered_shards(trainer, whole: dict, step) -> tuple[dict, dict]:
    """`_model_shards` for the distributed optimizer, from the state its data ranks gathered
    (ShardedMasterWeights.gather_optimizer_state): the same entries, so any layout loads it."""
    shards, info = {}, {}
    for i, (name, param) in enumerate(trainer.named_parameters()):
        if getattr(param, "duplicate", False):
            continue
        entry = {key: tensors[i].detach().cpu().clone() for key, tensors in whole.items()}
        if step is not None:
            entry["step"] = step.clone()
        shards[name] = entry
        info[name] = _param_metadata(param, trainer)
    return shards, info


def _shadow_of(trainer) -> dict | None:
    """id(model param) -> its value in 2BW's older live version, or None."""
    shadow = getattr(trainer.no_flush, "shadow", lambda: None)()
    if shadow is None:
        return None
    return {id(p): value for p, value in zip(trainer.params, shadow[1])}


def _param_metadata(param, trainer) -> dict:
    """Full (layout-free) shape and how this layout split it."""
    dim = getattr(param, "tp_split_dim", None)
    vocab_padded = bool(getattr(param, "vocab_padded", False))
    shape = list(param.shape)
    if dim is not None:
        shape[dim] *= trainer.tp.size
    if vocab_padded:
        shape[0] = trainer.cfg.model.vocab_size
    return {"shape": shape, "tp_split_dim": dim, "vocab_padded": vocab_padded,
            "pipeline_rank": trainer.grid.pp_rank}


def _master_of(trainer) -> dict:
    """id(model param) -> the master param the optimizer updates (same order, maybe same object)."""
    return {id(p): m for p, m in zip(trainer.params, trainer.master_params)}


def _rng_state(trainer) -> dict:
    state = {"cpu": torch.get_rng_state(), "tensor_parallel": trainer.ctx.rng.get_state()}
    if trainer.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(trainer.device)
    return state


def _metadata(trainer, params: dict) -> dict:
    cfg, grid = trainer.cfg, trainer.grid
    return {
        "format_version": FORMAT_VERSION,
        "iteration": trainer.iteration,
        "consumed_samples": trainer.iteration * cfg.train.global_batch_size,
        "layout": _layout(cfg),
        "model": dataclasses.asdict(cfg.model),
        "train": dataclasses.asdict(cfg.train),  # for the record; LR is f(iteration, train)
        "config": cfg.to_dict(),                 # the whole resolved config, for the record
        "loss_scaler": trainer.loss_scaler.state_dict(),
        **_two_bw_metadata(trainer),
        "params": params,
        "files": sorted([shard_file_name(pp, tp) for pp in range(grid.p) for tp in range(grid.t)]
                        + [rng_file_name(r) for r in range(dist.get_world_size())]
                        + _config_and_tokenizer_files(cfg)),
    }


def _config_and_tokenizer_files(cfg) -> list[str]:
    """What `_write_config_and_tokenizer` writes (part of a complete checkpoint)."""
    has_tokenizer = bool(cfg.data.tokenizer) and Path(cfg.data.tokenizer).is_file()
    return [CONFIG_FILE] + ([TOKENIZER_FILE] if has_tokenizer else [])


def _two_bw_metadata(trainer) -> dict:
    shadow = getattr(trainer.no_flush, "shadow", lambda: None)()
    if shadow is None:
        return {}
    scales = {str(b): s for b, s in trainer.no_flush.scales.items() if b >= trainer.iteration}
    return {"two_bw": {"shadow_version": shadow[0], "loss_scales": scales}}


def _layout(cfg) -> dict:
    par = cfg.parallel
    return {"pipeline": par.pipeline, "tensor": par.tensor, "data": par.data, "chunks": par.chunks}


def _publish(tmp: Path, final: Path, metadata: dict) -> None:
    """metadata.json last, then the directory rename, then `latest`: each step atomic."""
    _write_text_durably(tmp / METADATA, json.dumps(metadata, indent=1))
    _reached("metadata")
    if not final.exists():
        os.rename(tmp, final)
        _fsync_dir(final.parent)
        _reached("renamed")
        _point_latest(final)
        return
    # Re-saving an iteration: never remove the old copy before the new one is in place and
    # `latest` names it, so a crash at any step leaves a complete checkpoint to resume from.
    side = final.with_name(final.name + RESAVE_SUFFIX)
    os.rename(tmp, side)
    _fsync_dir(final.parent)
    _reached("side_renamed")
    _point_latest(side)
    _reached("latest_to_side")
    _finish_resave(side, final)


def _finish_resave(side: Path, final: Path) -> None:
    """`latest` names `side`: drop the old `final`, give `side` the usual name, point at it."""
    if final.exists():
        trash = final.with_name(final.name + ".old" + TMP_SUFFIX)  # never loaded; swept later
        _remove(trash)
        os.rename(final, trash)
        _reached("old_moved")
        shutil.rmtree(trash)
        _reached("old_removed")
    os.rename(side, final)
    _fsync_dir(final.parent)
    _reached("renamed_back")  # `latest` names nothing until the next line: the loader falls back
    _point_latest(final)


def _point_latest(target: Path) -> None:
    latest_tmp = target.parent / (LATEST + TMP_SUFFIX)
    _write_text_durably(latest_tmp, target.name + "\n")
    os.replace(latest_tmp, target.parent / LATEST)
    _fsync_dir(target.parent)
    _reached("latest")


def _save_durably(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_text_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make renames inside `path` survive a power loss (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# Finding and checking a checkpoint (no torch.distributed: usable from tools and tests)
# --------------------------------------------------------------------------------------------

def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint root (follow `latest`) or one iteration directory -> a complete iteration dir."""
    return find_checkpoint(path)[0]


def find_checkpoint(path: str | os.PathLike) -> tuple[Path, str | None]:
    """(complete iteration dir, note). The note says why `latest` was not followed and which
    checkpoint was taken instead (None when `latest` or the given directory was used)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; check checkpoint.load")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is a file, not a checkpoint directory; "
                              f"point checkpoint.load at a checkpoint.dir or an iter_N directory")
    if path.name.endswith(TMP_SUFFIX):
        raise CheckpointError(f"{path} is an incomplete checkpoint (a save that did not finish)")
    if (path / METADATA).is_file():
        return path, None
    if CHECKPOINT_NAME.fullmatch(path.name):
        raise CheckpointError(f"{path} is an incomplete checkpoint: it has no {METADATA}")
    problem = _latest_problem(path)
    if problem is None:
        return path / _latest_name(path), None
    fallback = newest_complete_checkpoint(path)
    if fallback is None:
        raise CheckpointError(f"{path} holds no checkpoint: {problem}, and no complete iter_N "
                              f"directory to fall back to")
    return fallback, f"{problem}; loading the newest complete checkpoint, {fallback}"


def _latest_problem(root: Path) -> str | None:
    """Why `root/latest` cannot be followed, or None if it names a complete checkpoint."""
    latest = root / LATEST
    if not latest.is_file():
        return f"no '{LATEST}' file"
    name = _latest_name(root)
    target = root / (name or "")
    if not name or not CHECKPOINT_NAME.fullmatch(name) or _incomplete(target):
        return f"{latest} names '{name}', but {target} is missing or incomplete"
    return None


def _incomplete(directory: Path) -> str | None:
    """Why `directory` is not a complete checkpoint, or None if it is."""
    try:
        read_metadata(directory)
    except CheckpointError as err:
        return str(err)
    return None


def newest_complete_checkpoint(root: Path) -> Path | None:
    """The complete iteration directory with the highest iteration (a re-save's `.new` copy
    wins a tie: it is the later save), or None."""
    candidates = []
    for entry in root.iterdir():
        match = CHECKPOINT_NAME.fullmatch(entry.name)
        if match and entry.is_dir():
            candidates.append((int(match.group(1)), bool(match.group(2)), entry))
    for _, _, entry in sorted(candidates, reverse=True):
        if not _incomplete(entry):
            return entry
    return None


def read_metadata(directory: Path) -> dict:
    """metadata.json of a complete checkpoint, after checking that its files are all there."""
    try:
        meta = json.loads((directory / METADATA).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {directory / METADATA}: {err}") from err
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), list):
        raise CheckpointError(f"{directory / METADATA} is not checkpoint metadata")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{directory}: format version {meta.get('format_version')} is not "
                              f"{FORMAT_VERSION}")
    missing = [f for f in meta["files"] if not (directory / f).is_file()]
    if missing:
        raise CheckpointError(f"{directory} is an incomplete checkpoint: missing {', '.join(missing)}")
    return meta


def check_model_config(meta: dict, model, directory: Path) -> None:
    """The model must be the checkpoint's (the layout may differ); name every differing key."""
    current = json.loads(json.dumps(dataclasses.asdict(model)))  # same types as the saved JSON
    saved = meta["model"]
    differ = [k for k in sorted(set(saved) | set(current))
              if k not in NON_STRUCTURAL_MODEL_KEYS and saved.get(k) != current.get(k)]
    if differ:
        details = ", ".join(f"model.{k}={saved.get(k)!r} in the checkpoint but {current.get(k)!r} "
                            f"in the config" for k in differ)
        raise CheckpointError(f"{directory} was saved for a different model: {details}")


def check_files_readable(directory: Path, meta: dict) -> None:
    """Open every file of a checkpoint without reading its tensors (memory-mapped) and check
    that each shard holds the parameters the metadata places on its pipeline rank.

    What `ptdp check` uses: a truncated or garbage file fails here, before any rank starts.
    """
    by_stage: dict[int, list[str]] = {}
    for name, info in meta["params"].items():
        by_stage.setdefault(info["pipeline_rank"], []).append(name)
    layout = meta["layout"]
    for pp in range(layout["pipeline"]):
        for tp in range(layout["tensor"]):
            path = directory / shard_file_name(pp, tp)
            shard = _load_file(path, mmap=True)
            missing = [n for n in by_stage.get(pp, [])
                       if not isinstance(shard, dict) or "value" not in (shard.get(n) or {})]
            if missing:
                more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
                raise CheckpointError(f"{path} has no entry for parameter '{missing[0]}'{more} "
                                      f"(the metadata says it is there)")
    for name in meta["files"]:
        if name.startswith("rng_rank"):
            _load_file(directory / name, mmap=False)


def _load_file(path: Path, mmap: bool):
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises many types for a bad file; the text says which
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CheckpointError(f"cannot read {path}: {first_line}") from err


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

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

    directory, note, meta, state = _on_all_ranks(f"loading checkpoint {path}", read)
    _apply(trainer, meta, state)
    rank0 = dist.get_rank() == 0
    if rank0 and note:
        print(f"checkpoint.load: {note}", flush=True)
    # The resumed job replays the iterations after this one: keep each in the metrics once.
    metrics_file = trainer.cfg.log.metrics_file
    _on_all_ranks(f"trimming {metrics_file} to iteration {meta['iteration']}",
                  lambda: drop_records_after(metrics_file, meta["iteration"])
                  if rank0 and metrics_file else None)
    if rank0 and trainer.cfg.log.progress:
        print(f"loaded checkpoint {directory} (iteration {meta['iteration']}, saved with layout "
              f"{_layout_text(meta['layout'])})", flush=True)
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
    masters = _master_of(trainer)
    values, optimizer_state, shadow = {}, {}, {}
    for name, param in trainer.named_parameters():
        entry = shards.full(name)
        local = {key: _to_local(param, full, trainer, name, key) for key, full in entry.items()
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
        locals_.append({key: _to_local(param, full, trainer, name, key).reshape(-1)
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


class ShardReader:
    """Full tensors of saved parameters, rebuilt from the shard files of the saved layout."""

    def __init__(self, directory: Path, meta: dict):
        self.directory, self.meta = directory, meta
        self.tensor = meta["layout"]["tensor"]
        self.vocab_size = meta["model"]["vocab_size"]
        self._files: dict[tuple[int, int], dict] = {}

    def full(self, name: str) -> dict:
        """{"value", "exp_avg", "exp_avg_sq": full tensors, "step"} for global `name`."""
        info = self.meta["params"].get(name)
        if info is None:
            raise CheckpointError(f"{self.directory} has no parameter '{name}'")
        parts = [self._shard(info["pipeline_rank"], tp, name) for tp in range(self.tensor)]
        entry = {key: self._unshard([p[key] for p in parts], info)
                 for key in parts[0] if key != "step"}
        if "step" in parts[0]:
            entry["step"] = parts[0]["step"]
        expected = list(info["shape"])
        if list(entry["value"].shape) != expected:
            raise CheckpointError(f"{self.directory}: parameter '{name}' rebuilds to shape "
                                  f"{list(entry['value'].shape)}, metadata says {expected}")
        return entry

    def _unshard(self, parts: list, info: dict):
        dim = info["tp_split_dim"]
        full = torch.cat(parts, dim=dim) if dim is not None else parts[0]
        return full[: self.vocab_size] if info["vocab_padded"] else full

    def _shard(self, pp: int, tp: int, name: str) -> dict:
        shard = self._file(pp, tp).get(name)
        if shard is None:
            raise CheckpointError(f"{self.directory / shard_file_name(pp, tp)} has no entry for "
                                  f"parameter '{name}' (the metadata says it is there)")
        return shard

    def _file(self, pp: int, tp: int) -> dict:
        key = (pp, tp)
        if key not in self._files:
            path = self.directory / shard_file_name(pp, tp)
            # mmap: only the tensors this rank asks for are read from disk
            self._files[key] = _load_file(path, mmap=True)
        return self._files[key]


def _to_local(param, full: torch.Tensor, trainer, name: str, key: str) -> torch.Tensor:
    """This rank's shard of `full` for the current layout, checked against the parameter."""
    local = local_slice(param, full, trainer.tp, trainer.cfg.padded_vocab_size)
    if local.shape != param.shape:
        raise CheckpointError(f"parameter '{name}' ({key}): the checkpoint gives a shard of shape "
                              f"{list(local.shape)} but the model's is {list(param.shape)}")
    return local.clone()  # own the memory: the source may be a memory-mapped file


def _rng_to_restore(trainer, directory: Path, meta: dict) -> dict | None:
    """The saved RNG state of this rank if the layout is unchanged (and was saved), else None."""
    if meta["layout"] != _layout(trainer.cfg) or not meta.get("rng", True):
        return None
    return _load_file(directory / rng_file_name(trainer.grid.rank), mmap=False)


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


def _layout_text(layout: dict) -> str:
    return (f"p={layout['pipeline']} t={layout['tensor']} d={layout['data']} "
            f"v={layout['chunks']}")


# --------------------------------------------------------------------------------------------
# Writing full weights into a checkpoint of any layout (no process group: `ptdp convert`)
# --------------------------------------------------------------------------------------------

def save_full_state(full: dict, cfg, directory: str | os.PathLike, iteration: int = 0,
                    tokenizer: str | os.PathLike | None = None) -> Path:
    """Write full (layout-free, vocabulary-trimmed) weights as a checkpoint for cfg's layout.

    The shards are what the ranks of (p, t, d, v) = cfg.parallel would save: each parameter
    sliced with `local_slice` for every tensor rank, on the pipeline rank whose chunk holds
    it. No optimizer state and no RNG files (`"rng": false`): a job resuming from it starts
    AdamW and its random streams afresh. Returns the iteration directory.
    """
    from models import ModelContext, build_chunk, named_global_parameters
    from ptdp.parallel.tensor import TensorParallel, TensorParallelRNG
    from ptdp.pipeline.schedules import rank_stages

    par = cfg.parallel
    root = Path(directory)
    final = root / iteration_dir_name(iteration)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    _prepare(root, tmp)
    shards = {(pp, tr): {} for pp in range(par.pipeline) for tr in range(par.tensor)}
    params = {}
    ctx = ModelContext(cfg.model, TensorParallel(None, 0, par.tensor), cfg.train.seed,
                       TensorParallelRNG(cfg.train.seed, 0, torch.device("cpu")),
                       cfg.padded_vocab_size)
    for pp in range(par.pipeline):
        for stage in rank_stages(pp, par.pipeline, par.chunks):
            chunk = build_chunk(ctx, stage, par.pipeline * par.chunks)  # names and split dims
            for name, param in named_global_parameters(chunk):
                if getattr(param, "duplicate", False):
                    continue
                if name not in full:
                    raise CheckpointError(f"the weights to save have no '{name}'")
                expected = _param_metadata(param, SimpleNamespace(tp=ctx.tp, cfg=cfg,
                                                                  grid=SimpleNamespace(pp_rank=pp)))
                if list(full[name].shape) != expected["shape"]:
                    raise CheckpointError(f"'{name}' has shape {list(full[name].shape)}; the "
                                          f"model needs {expected['shape']}")
                for tr in range(par.tensor):
                    tp = TensorParallel(None, tr, par.tensor)
                    local = local_slice(param, full[name].float(), tp, cfg.padded_vocab_size)
                    if local.shape != param.shape:
                        raise CheckpointError(f"'{name}': full shape {list(full[name].shape)} "
                                              f"does not fit the model's shard {list(param.shape)}")
                    shards[(pp, tr)][name] = {"value": local.contiguous().clone()}
                params[name] = expected
            del chunk
    for (pp, tr), shard in shards.items():
        _save_durably(shard, tmp / shard_file_name(pp, tr))
    if tokenizer:
        cfg.data.tokenizer = str(tokenizer)
    _write_config_and_tokenizer(cfg, tmp)
    meta = {"format_version": FORMAT_VERSION, "iteration": iteration,
            "consumed_samples": iteration * cfg.train.global_batch_size, "layout": _layout(cfg),
            "model": dataclasses.asdict(cfg.model), "train": dataclasses.asdict(cfg.train),
            "config": cfg.to_dict(), "rng": False, "params": params,
            "files": sorted([shard_file_name(pp, tr) for pp, tr in shards]
                            + _config_and_tokenizer_files(cfg))}
    _publish(tmp, final, meta)
    return final
