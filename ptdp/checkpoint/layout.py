"""What a checkpoint is on disk, and how to find, read and check one (no process group).

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
                                      `ptdp convert` need no other file); a Hugging Face
                                      tokenizer is copied as tokenizer.json instead, with the
                                      tokenizer_config.json beside it when it has one

A checkpoint written by `save_full_state` (`ptdp convert --from hf`) has no RNG files and
no optimizer state and no loss scale: a job loading it starts fresh RNG streams, fresh AdamW
moments and the configured loss scale.

What goes where comes from the training state's parts (`StatePart`, listed by
`TrainingState.parts()` in ptdp/training/state.py): a part's per-parameter entries join the
shard files under each parameter's global name (the keys above are those of the weights, the
optimizer and 2BW's versions), its other state goes into metadata.json under the part's key
("loss_scaler", "two_bw"; the progress at the top level: "iteration", "skipped_samples",
"consumed_samples"), and a per-rank part (the random streams) is a file per world rank.

A directory is a complete checkpoint when its metadata.json reads and every file it lists is
there. When `latest` is missing or names an incomplete directory, the newest complete
checkpoint in the folder is found instead, with a one-line note (ptdp/checkpoint/save.py says
when that can happen).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ptdp.config.schema import AUTO_LOAD

FORMAT_VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"
TMP_SUFFIX = ".tmp"
RESAVE_SUFFIX = ".new"   # a re-saved iteration, published beside the copy it replaces
CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.model"
# Directory names a checkpoint can be loaded from: iter_N, or iter_N.new mid-way in a re-save.
CHECKPOINT_NAME = re.compile(r"iter_(\d+)(\.new)?")
RANK_FILE = re.compile(r"\w+_rank\d{5}\.pt")
PARAMETERS = "parameters"   # the key of a part's per-parameter entries in its state_dict()
# Model keys that do not change what the saved weights mean; a resumed job may change them.
NON_STRUCTURAL_MODEL_KEYS = ("dropout", "init_std")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the path or parameter."""


@dataclass(frozen=True)
class StatePart:
    """A saveable part of the training state, and where a checkpoint keeps it.

    `state` has `state_dict()` / `load_state_dict()` (the Stateful pattern). Its state_dict()
    is a dict: JSON values, kept in metadata.json under `key` (None: at the top level), and, if
    `per_parameter`, under PARAMETERS one dict of tensors per parameter of this rank (aligned
    with TrainingState.named_parameters(), whole local tensors of this layout), kept in the
    shard files and resharded on load. A `per_rank` part's whole state_dict() is this rank's
    own file (`rank_file_name`), loaded only into the same layout.

    Loading hands each part what was saved of it, {} when nothing was (a converted checkpoint,
    another schedule or layout, or a part that saved {}): it then keeps or makes a fresh state.
    Parts load in their order in the list.
    """

    key: str | None
    state: Any
    per_parameter: bool = False
    per_rank: bool = False


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def shard_file_name(pp_rank: int, tp_rank: int, expert_rank: int = 0) -> str:
    """A model shard file; with expert parallelism expert rank r > 0 of a stage writes its
    experts into a file of its own (`..._ep001.pt`; rank 0's go with the dense weights)."""
    suffix = f"_ep{expert_rank:03d}" if expert_rank else ""
    return f"model_pp{pp_rank:03d}_tp{tp_rank:03d}{suffix}.pt"


def param_file_name(info: dict, tp_rank: int) -> str:
    """The shard file holding tensor rank `tp_rank`'s shard of a parameter (its metadata
    `info`: the pipeline rank, and the expert rank for an expert held by rank r > 0)."""
    return shard_file_name(info["pipeline_rank"], tp_rank, info.get("expert_rank", 0))


def rank_file_name(key: str, rank: int) -> str:
    """The file of a per-rank part (`StatePart.per_rank`): `rng_rank00003.pt`."""
    return f"{key}_rank{rank:05d}.pt"


def latest_name(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def layout_of(cfg) -> dict:
    par = cfg.parallel
    layout = {"pipeline": par.pipeline, "tensor": par.tensor, "data": par.data,
              "chunks": par.chunks}
    if par.context > 1:   # only then: older checkpoints (and c = 1) keep their four keys
        layout["context"] = par.context
    if par.expert > 1:    # the same for expert parallelism
        layout["expert"] = par.expert
    return layout


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
        return path / latest_name(path), None
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
    name = latest_name(root)
    target = root / (name or "")
    if not name or not CHECKPOINT_NAME.fullmatch(name) or incomplete(target):
        return f"{latest} names '{name}', but {target} is missing or incomplete"
    return None


def incomplete(directory: Path) -> str | None:
    """Why `directory` is not a complete checkpoint, or None if it is."""
    try:
        read_metadata(directory)
    except CheckpointError as err:
        return str(err)
    return None


def newest_complete_checkpoint(root: Path) -> Path | None:
    """The complete iteration directory with the highest iteration, or None."""
    return next(iter(complete_checkpoints(root)), None)


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete iteration directories of `root`, newest first (a re-save's `.new` copy
    wins a tie: it is the later save)."""
    candidates = []
    for entry in root.iterdir():
        match = CHECKPOINT_NAME.fullmatch(entry.name)
        if match and entry.is_dir():
            candidates.append((int(match.group(1)), bool(match.group(2)), entry))
    return [entry for _, _, entry in sorted(candidates, reverse=True) if not incomplete(entry)]


def load_candidates(path, ck) -> list[tuple[str, str | None]]:
    """(directory, note) of the checkpoints to try in order for `path` (ptdp/checkpoint/load.py
    `load_checkpoint`): the one `path` resolves to, then, when `path` is a checkpoint root or
    the newest checkpoint of checkpoint.dir that `checkpoint.load=auto` or a restart picked
    (`ck`: the job's checkpoint config), the other complete ones beside it, newest first. A
    checkpoint named as such is the only candidate."""
    from ptdp.runtime.exit_status import restart_attempt
    directory, note = find_checkpoint(path)
    first = [(str(directory), note)]
    given = Path(path)
    picked = ((ck.load == AUTO_LOAD or restart_attempt() > 0) and bool(ck.dir)
              and given.parent.resolve() == Path(ck.dir).resolve())
    if directory == given and not picked:
        return first
    return first + [(str(other), None)   # (load_checkpoint says why it skipped the others)
                    for other in complete_checkpoints(directory.parent) if other != directory]


def resolve_load(ck, restarting: bool = False) -> tuple[str | None, str | None]:
    """(the checkpoint to load or None, a line saying which) for a job's `checkpoint` config.

    `checkpoint.load=auto`: the newest complete checkpoint in checkpoint.dir, or a fresh start
    when there is none. A job the launch script restarted after a failure (`restarting`)
    resumes from the newest checkpoint of its own checkpoint.dir whatever checkpoint.load says
    (it may name the checkpoint the job started from), and from checkpoint.load until it has
    saved one."""
    auto = ck.load == AUTO_LOAD
    if (auto or restarting) and ck.dir and Path(ck.dir).is_dir():
        newest = newest_complete_checkpoint(Path(ck.dir))
        if newest is not None:
            why = "checkpoint.load=auto" if auto else "restarted after a failure"
            return str(newest), f"{why}: resuming from {newest}, the newest in {ck.dir}"
    if auto:
        return None, f"checkpoint.load=auto: no checkpoint in {ck.dir} yet; starting fresh"
    return ck.load, None


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
    saved = dict(meta["model"])
    fields = {f.name for f in dataclasses.fields(model)}
    if fields - set(saved):   # saved before those keys existed: they hold what the rest implies
        implied = dataclasses.asdict(type(model)(**{k: v for k, v in saved.items() if k in fields}))
        saved.update(json.loads(json.dumps({k: implied[k] for k in fields - set(saved)})))
    # Rotary positions have no table: any length up to the saved model's longest position
    # loads, or past it where the config extends the context (model.max_position_embeddings).
    rotary = saved.get("position_embedding") == current.get("position_embedding") == "rope"
    lengths = ("seq_length", "max_position_embeddings") if rotary else ()
    differ = [k for k in sorted(set(saved) | set(current))
              if k not in NON_STRUCTURAL_MODEL_KEYS + lengths and saved.get(k) != current.get(k)]
    limit = saved.get("max_position_embeddings") or saved.get("seq_length")
    if rotary and current["seq_length"] > max(limit, current.get("max_position_embeddings") or 0):
        raise CheckpointError(f"{directory}: model.seq_length={current['seq_length']} is past "
                              f"the {limit} positions its rotary model supports (set "
                              f"model.max_position_embeddings to extend it)")
    if differ:
        details = ", ".join(f"model.{k}={saved.get(k)!r} in the checkpoint but {current.get(k)!r} "
                            f"in the config" for k in differ)
        raise CheckpointError(f"{directory} was saved for a different model: {details}")


def layout_text(layout: dict) -> str:
    context = f" c={layout['context']}" if layout.get("context", 1) > 1 else ""
    return (f"p={layout['pipeline']} t={layout['tensor']}{context} d={layout['data']} "
            f"v={layout['chunks']}")
