"""Saving a training job's state: every rank writes its files, then rank 0 publishes atomically.

Atomicity: everything is written into `iter_N.tmp/`, every rank reports success, then rank 0
writes metadata.json, renames the directory to `iter_N` and replaces `latest` with
os.replace. A crash at any point leaves either a `.tmp` directory (never loaded) or a complete
checkpoint, and `latest` names a complete one. Re-saving an iteration that exists never
removes the old copy before the new one is in place: the new one is published as
`iter_N.new`, `latest` is switched to it, the old copy is moved to `iter_N.old.tmp` and
deleted, then `iter_N.new` becomes `iter_N` and `latest` follows. The one moment where
`latest` names nothing (between the last rename and the last switch) is covered by the
loader's fallback (ptdp/checkpoint/layout.py). Each save starts by removing leftovers of
crashed saves (`*.tmp`, and `*.new` that `latest` does not name).

What is saved is the training state's parts (`state.parts()`, ptdp/training/state.py), each
kept where its `StatePart` says (ptdp/checkpoint/layout.py): this module knows no schedule and
no kind of master weights. Every rank asks every part for its state_dict() (some are
collective: the distributed optimizer's ranks assemble whole tensors from their shards,
ptdp/optim/distributed.py); data rank 0 of each model-parallel rank writes the per-parameter
entries, so the files do not depend on how the masters were held.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ptdp.checkpoint.layout import (CONFIG_FILE, CheckpointError, FORMAT_VERSION, LATEST, METADATA,
                                    PARAMETERS, RESAVE_SUFFIX, TMP_SUFFIX, TOKENIZER_FILE,
                                    incomplete, iteration_dir_name, latest_name, layout_of,
                                    rank_file_name, shard_file_name)
from ptdp.checkpoint.reshard import param_metadata
from ptdp.checkpoint.retention import disk_full, prune
from ptdp.checkpoint.integrity import DiskFull, file_checksum, is_disk_full, save_durably, seal
from ptdp.checkpoint.safety import all_gather, fsync_dir, on_all_ranks, remove, write_text_durably
from ptdp.config.batches import BatchSchedule
from ptdp.parallel.roles import role_of, writes
from ptdp.parallel.sharding import local_slice


def save_checkpoint(state, directory: str | os.PathLike, timing: dict | None = None) -> Path:
    """Write the training state (ptdp/training/state.py) after `state.progress.iteration`
    iterations; returns the final directory. Collective: every rank of the job calls it.
    `timing`: what saves and iterations cost this job, kept in the metadata for the record
    and for a resumed job's advice on how often to save (ptdp/metrics/report.py SaveTiming)."""
    pending = start_save(state, directory, timing)
    pending.write()
    return finish_save(pending)


@dataclass
class PendingSave:
    """A save between its snapshot and its publication: this rank's files, held in host
    memory, and the metadata rank 0 will publish once every rank has written its files."""

    final: Path
    files: dict[Path, object]     # path in the .tmp directory -> what torch.save writes there
    metadata: dict
    cfg: object
    error: BaseException | None = None
    checksums: dict[str, list] = dataclasses.field(default_factory=dict)   # name -> [size, crc]

    @property
    def tmp(self) -> Path:
        return self.final.with_name(self.final.name + TMP_SUFFIX)

    def write(self) -> None:
        """Write this rank's files durably. No collective, so it may run on a background
        thread while training goes on; a failure is kept for `finish_save` to share."""
        try:
            for path, obj in self.files.items():
                self.checksums[path.name] = save_durably(obj, path)
            _reached("rank_files")
        except BaseException as err:   # noqa: BLE001 - shared with every rank by finish_save
            self.error = (disk_full(self.final.parent, f"writing {self.tmp.name}")
                          if is_disk_full(err) else err)
        self.files = {}   # the host copies are no longer needed


def start_save(state, directory: str | os.PathLike, timing: dict | None = None) -> PendingSave:
    """The part of a save that training waits for: the .tmp directory, and a copy of this
    rank's state in host memory (pinned when the state is on a GPU), taken at the iteration
    boundary. Collective."""
    root = Path(directory)
    final = root / iteration_dir_name(state.progress.iteration)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    rank0 = dist.get_rank() == 0
    on_all_ranks(f"preparing checkpoint {tmp}",
                 lambda: _naming_a_full_disk(root, f"creating {tmp.name}",
                                             lambda: _prepare(root, tmp)) if rank0 else None)
    parts = [(part, part.state.state_dict()) for part in state.parts()]
    files, info = on_all_ranks(f"copying the state for checkpoint {tmp}",
                               lambda: _snapshot_rank_files(state, tmp, parts))
    params = {}
    for part in all_gather(info):
        params.update(part)
    metadata = _metadata(state, params, parts)
    if timing:
        metadata["timing"] = timing
    return PendingSave(final, files, metadata, state.cfg)


def finish_save(pending: PendingSave) -> Path:
    """Once every rank has written its files (`PendingSave.write`): rank 0 publishes the
    checkpoint (metadata.json, the rename, `latest`). Collective; a failure on any rank raises
    on every rank and publishes nothing."""
    def written():
        if pending.error is not None:
            raise pending.error

    root, rank0 = pending.final.parent, dist.get_rank() == 0
    try:
        on_all_ranks(f"writing checkpoint {pending.tmp}", written)
        checksums = {}
        for part in all_gather(pending.checksums):
            checksums.update(part)

        def publish():
            checksums.update(_write_config_and_tokenizer(pending.cfg, pending.tmp))
            _publish(pending.tmp, pending.final, seal(pending.metadata, checksums))
            ck = pending.cfg.checkpoint
            prune(root, ck.keep_last, ck.keep_every)

        on_all_ranks(f"publishing checkpoint {pending.final}", lambda: _naming_a_full_disk(
            root, f"publishing {pending.final.name}", publish) if rank0 else None)
    except DiskFull:
        if rank0:   # give back what the failed save took: the job's last lines need room too
            remove(pending.tmp)
        raise
    return pending.final


def _naming_a_full_disk(root: Path, what: str, fn):
    """fn(), a full disk raised as DiskFull: one line naming `root` and the space needed."""
    try:
        return fn()
    except OSError as err:
        if is_disk_full(err):
            raise disk_full(root, what) from err
        raise


def _writes_any(state) -> bool:
    """Whether this rank writes any parameter (ptdp/parallel/roles.py `writes`: the first of
    the replicas holding the same); the others write only their per-rank files."""
    return any(writes(p, state.grid) for p in state.params)


def _write_config_and_tokenizer(cfg, tmp: Path) -> dict[str, list]:
    """The resolved config as YAML, and a copy of the tokenizer, beside the shards; returns
    their checksums (small files: read back once)."""
    import yaml
    write_text_durably(tmp / CONFIG_FILE, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    for name, source in _tokenizer_copies(cfg).items():
        shutil.copyfile(source, tmp / name)
    return {name: file_checksum(tmp / name) for name in _config_and_tokenizer_files(cfg)}


def _tokenizer_copies(cfg) -> dict[str, Path]:
    """{name in the checkpoint: file} of data.tokenizer: a sentencepiece model as
    tokenizer.model; a Hugging Face tokenizer as tokenizer.json (+ tokenizer_config.json)."""
    from ptdp.data.tokenizer import HF_TOKENIZER_FILE, hf_tokenizer_files, is_hf_tokenizer
    path = cfg.data.tokenizer
    if not path:
        return {}
    if is_hf_tokenizer(path):
        files = hf_tokenizer_files(path)
        return files if files[HF_TOKENIZER_FILE].is_file() else {}
    return {TOKENIZER_FILE: Path(path)} if Path(path).is_file() else {}


def _reached(stage: str) -> None:
    """Called after each step of a save; does nothing. Tests replace it to crash a save there."""


def _prepare(root: Path, tmp: Path) -> None:
    """Finish or discard what crashed saves left, then make an empty `tmp` directory."""
    root.mkdir(parents=True, exist_ok=True)
    named = latest_name(root)
    if named and named.endswith(RESAVE_SUFFIX) and not incomplete(root / named):
        _finish_resave(root / named, root / named[: -len(RESAVE_SUFFIX)])
        named = latest_name(root)
    for entry in root.iterdir():
        stale = entry.name.endswith(TMP_SUFFIX) or (
            entry.name.endswith(RESAVE_SUFFIX) and entry.name != named)
        if stale:
            remove(entry)
    tmp.mkdir()
    _reached("tmp_dir")


def _snapshot_rank_files(state, tmp: Path, parts: list) -> tuple[dict, dict]:
    """({path: object} of this rank's files, metadata of the parameters it saves ({} if
    none)), every tensor copied to host memory. `parts`: (StatePart, its state_dict())."""
    grid = state.grid
    files = {tmp / rank_file_name(part.key, grid.rank): saved
             for part, saved in parts if part.per_rank}
    if not _writes_any(state):  # the replicas holding the same parameters write nothing
        return files, {}
    shards, info = _model_shards(state, [saved[PARAMETERS] for part, saved in parts
                                         if part.per_parameter and PARAMETERS in saved])
    files[tmp / shard_file_name(grid.pp_rank, grid.tp_rank, _expert_rank(grid))] = shards
    if state.device.type == "cuda":   # the pinned copies were made without waiting
        torch.cuda.synchronize(state.device)
    return files, info


def _model_shards(state, per_parameter: list[list[dict]]) -> tuple[dict, dict]:
    """({name: saved tensors}, {name: metadata}) for this rank's unique parameters: every
    part's entries of it, in the parts' order (CPU copies)."""
    shards, info = {}, {}
    for i, (name, param) in enumerate(state.named_parameters()):
        if role_of(param).duplicate:  # the tied head's copy; the original is saved
            continue
        if not writes(param, state.grid):   # another replica writes it
            continue
        entry = {key: value for entries in per_parameter for key, value in entries[i].items()}
        shards[name] = {key: _host_copy(value, state.device) for key, value in entry.items()}
        info[name] = param_metadata(param, state.tp.size, state.cfg.model.vocab_size,
                                    state.grid.pp_rank)
        if _expert_rank(state.grid):   # (only expert parameters: ptdp/checkpoint/layout.py)
            info[name]["expert_rank"] = _expert_rank(state.grid)
    return shards, info


def _expert_rank(grid) -> int:
    """This rank's index in its expert group (0 without expert parallelism)."""
    return grid.index("expert") if grid.e > 1 else 0


def _host_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy in host memory that training may not change: pinned and asynchronous from a
    GPU (the caller synchronises once), a plain clone on CPU. A host tensor of a job on a GPU
    is such a copy already (the distributed optimizer gathers its state into private host
    copies, ptdp/optim/distributed.py): kept, not copied twice."""
    tensor = tensor.detach()
    if tensor.device.type != "cuda":
        return tensor if device.type == "cuda" else tensor.clone()
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return copy.copy_(tensor, non_blocking=True)


def _metadata(state, params: dict, parts: list) -> dict:
    """The format version, every part's JSON state (under its key, or at the top level), the
    run's layout, model and config, the parameters' layout-free metadata, the file list."""
    cfg, grid = state.cfg, state.grid
    meta = {"format_version": FORMAT_VERSION}
    for part, saved in parts:
        if part.per_rank:
            continue
        saved = {key: value for key, value in saved.items() if key != PARAMETERS}
        if part.key is None:
            meta.update(saved)
        elif saved:
            meta[part.key] = saved
    meta.update({
        "layout": layout_of(cfg),
        "model": dataclasses.asdict(cfg.model),
        "train": dataclasses.asdict(cfg.train),  # for the record; LR is f(iteration, train)
        "config": cfg.to_dict(),                 # the whole resolved config, for the record
        "params": params})
    rank_files = [rank_file_name(part.key, r) for part, _ in parts if part.per_rank
                  for r in range(dist.get_world_size())]
    meta["files"] = sorted([shard_file_name(pp, tp, ep) for pp in range(grid.p)
                            for tp in range(grid.t) for ep in range(grid.e)]
                           + rank_files + _config_and_tokenizer_files(cfg))
    return meta


def _config_and_tokenizer_files(cfg) -> list[str]:
    """What `_write_config_and_tokenizer` writes (part of a complete checkpoint)."""
    return [CONFIG_FILE] + sorted(_tokenizer_copies(cfg))


def _publish(tmp: Path, final: Path, metadata: dict) -> None:
    """metadata.json last, then the directory rename, then `latest`: each step atomic."""
    write_text_durably(tmp / METADATA, json.dumps(metadata, indent=1))
    _reached("metadata")
    if not final.exists():
        os.rename(tmp, final)
        fsync_dir(final.parent)
        _reached("renamed")
        _point_latest(final)
        return
    # Re-saving an iteration: never remove the old copy before the new one is in place and
    # `latest` names it, so a crash at any step leaves a complete checkpoint to resume from.
    side = final.with_name(final.name + RESAVE_SUFFIX)
    os.rename(tmp, side)
    fsync_dir(final.parent)
    _reached("side_renamed")
    _point_latest(side)
    _reached("latest_to_side")
    _finish_resave(side, final)


def _finish_resave(side: Path, final: Path) -> None:
    """`latest` names `side`: drop the old `final`, give `side` the usual name, point at it."""
    if final.exists():
        trash = final.with_name(final.name + ".old" + TMP_SUFFIX)  # never loaded; swept later
        remove(trash)
        os.rename(final, trash)
        _reached("old_moved")
        shutil.rmtree(trash)
        _reached("old_removed")
    os.rename(side, final)
    fsync_dir(final.parent)
    _reached("renamed_back")  # `latest` names nothing until the next line: the loader falls back
    _point_latest(final)


def _point_latest(target: Path) -> None:
    latest_tmp = target.parent / (LATEST + TMP_SUFFIX)
    write_text_durably(latest_tmp, target.name + "\n")
    os.replace(latest_tmp, target.parent / LATEST)
    fsync_dir(target.parent)
    _reached("latest")


def conversion_config(model_cfg, overrides=(), tokenizer: str | os.PathLike | None = None):
    """The Config a converted checkpoint is written for (`ptdp convert --from ...`): the model
    read from the source, then the overrides (the layout, and anything else), synthetic data
    unless they name data, `tokenizer` as data.tokenizer."""
    from ptdp.config import load_config

    model_keys = [f"model.{k}={json.dumps(v)}" for k, v in vars(model_cfg).items()]
    world = {"tensor": 1, "pipeline": 1, "data": 1, "context": 1}   # the sizes the world needs
    for item in overrides:
        key, _, value = item.partition("=")
        if key.startswith("parallel.") and key[len("parallel."):] in world and value.isdigit():
            world[key[len("parallel."):]] = int(value)
    extra = ["data.source=synthetic"] if not any(o.startswith("data.") for o in overrides) else []
    extra += [f"data.tokenizer={tokenizer}"] if tokenizer else []
    return load_config(None, model_keys + extra + list(overrides),
                       world_size=math.prod(world.values()))


def save_full_state(full: dict, cfg, directory: str | os.PathLike, iteration: int = 0,
                    consumed_samples: int | None = None, skipped_samples: int = 0,
                    extra_meta: dict | None = None) -> Path:
    """Write full (layout-free, vocabulary-trimmed) weights as a checkpoint for cfg's layout,
    with cfg's data.tokenizer copied in.

    The progress is `iteration`, the samples consumed before it (default: what cfg's batches,
    ramp-up included, consume in `iteration` iterations) and those of updates fp16 skipped (the
    learning rate stands still over them), as another trainer's run recorded them.
    `extra_meta`: state parts kept in the metadata (e.g. "moe", the selection biases).

    The shards are what the ranks of (p, t, d, v) = cfg.parallel would save: each parameter
    sliced with `local_slice` for every tensor rank, on the pipeline rank whose chunk holds
    it. No optimizer state and no RNG files (`"rng": false`): a job resuming from it starts
    AdamW and its random streams afresh. Returns the iteration directory.
    """
    from ptdp.models import ModelContext, build_chunk, named_global_parameters
    from ptdp.parallel.mappings import TensorParallel
    from ptdp.parallel.rng import TensorParallelRNG
    from ptdp.config.catalogue import schedule_spec

    if iteration < 0:
        raise CheckpointError(f"iteration {iteration}: a checkpoint's iteration is 0 or more")
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
    stages = schedule_spec(cfg.schedule.name).stage_map(par.pipeline, par.chunks)
    for pp in range(par.pipeline):
        for stage in stages.stages_of(pp):
            chunk = build_chunk(ctx, stage, par.pipeline * par.chunks,  # names, split dims
                                par.stage_layers)
            for name, param in named_global_parameters(chunk):
                if role_of(param).duplicate:
                    continue
                if name not in full:
                    raise CheckpointError(f"the weights to save have no '{name}'")
                expected = param_metadata(param, par.tensor, cfg.model.vocab_size, pp)
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
    checksums = {shard_file_name(pp, tr): save_durably(shard, tmp / shard_file_name(pp, tr))
                 for (pp, tr), shard in shards.items()}
    checksums.update(_write_config_and_tokenizer(cfg, tmp))
    meta = {"format_version": FORMAT_VERSION, "iteration": iteration,
            "consumed_samples": (BatchSchedule.of(cfg.train).consumed(iteration)
                                 if consumed_samples is None else consumed_samples),
            "skipped_samples": skipped_samples, "layout": layout_of(cfg),
            "model": dataclasses.asdict(cfg.model), "train": dataclasses.asdict(cfg.train),
            "config": cfg.to_dict(), "rng": False, "params": params,
            "files": sorted([shard_file_name(pp, tr) for pp, tr in shards]
                            + _config_and_tokenizer_files(cfg)), **(extra_meta or {})}
    _publish(tmp, final, seal(meta, checksums))
    return final
