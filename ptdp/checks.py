"""Everything that can be known about a job before it starts: `ptdp check`, and the first
thing `ptdp train` does on every rank, before any process group exists.

One function per concern, each adding one line per problem to a `Findings`; the concerns
are independent, so a user sees every problem at once (only a config that does not load
stops the rest). Checks stay cheap: `.idx` headers and file sizes, not the corpus; the
tokenizer is loaded; a checkpoint's files are opened memory-mapped (torch is imported only
then). Nothing is created or written.
"""

from __future__ import annotations

import math
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

from ptdp.config import Config, ConfigError, parse_config, parse_paths, parse_split, validate
from ptdp.config.models import Samples


@dataclass
class Findings:
    """The outcome of the checks: errors (the job must not start), warnings (it may, but
    probably should not as it is) and notes (it may)."""

    cfg: Config | None = None
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    hardware: object = None        # the log.hardware profile, when it loads

    def error(self, line: str) -> None:
        self.errors.append(_one_line(line))

    def note(self, line: str) -> None:
        self.notes.append(_one_line(line))

    def warn(self, line: str) -> None:
        self.warnings.append(_one_line(line))


def _one_line(text: str) -> str:
    """Messages from libraries can span lines; a finding is one line."""
    return " ".join(str(text).split())


def check_job(config_path: str | None, overrides: list[str], world_size: int,
              ranks_per_node: int | None = None) -> Findings:
    """Load and validate the config for `world_size` ranks, then check everything it names.

    `ranks_per_node` (torchrun's --nproc-per-node, LOCAL_WORLD_SIZE) also checks that every
    rank of this node gets a GPU of its own when the job trains on GPUs, and warns when
    tensor groups straddle nodes.

    `found.cfg` is the validated config when there is no error. Only a config that does not
    parse (unknown keys, wrong types) stops the other checks: they guard their own inputs.
    """
    found = Findings()
    try:
        cfg = parse_config(config_path, overrides)
    except ConfigError as err:
        for line in err.errors:
            found.error(line)
        return found
    try:
        found.notes += validate(cfg, world_size)
    except ConfigError as err:
        for line in err.errors:
            found.error(line)
    headers = check_data(cfg, found)
    check_tokenizer(cfg, headers, found)
    check_hardware(cfg, found)
    check_packages(cfg, found)
    if ranks_per_node is not None:
        check_devices(cfg, ranks_per_node, found)
        check_placement(cfg, world_size, ranks_per_node, found)
    check_checkpoint_load(cfg, found)
    check_outputs(cfg, found)
    if ranks_per_node is not None:
        check_shared_checkpoints(cfg, world_size, ranks_per_node, found)
    if not found.errors:
        found.cfg = cfg
    return found


# --------------------------------------------------------------------------------------------
# Data and tokenizer
# --------------------------------------------------------------------------------------------

def check_data(cfg: Config, found: Findings) -> list:
    """Headers and sizes of every data.paths prefix; returns the headers that could be read."""
    if cfg.data.source != "indexed":
        return []
    from ptdp.data.indexed import IndexedDataError, read_index_header

    try:
        pairs = parse_paths(cfg.data.paths)
    except ConfigError:
        return []   # reported by the config's validation
    headers = []
    for _, prefix in pairs:
        try:
            headers.append(read_index_header(prefix))
        except IndexedDataError as err:
            found.error(f"data.paths: {err}")
    for header in headers:
        _check_dataset(cfg, header, found)
    if len(headers) == len(pairs):
        _check_enough_tokens(cfg, pairs, headers, found)
    _check_same_vocabulary(headers, found)
    return headers


def _idx(header) -> str:
    return f"{header.prefix}.idx"


def _check_dataset(cfg: Config, header, found: Findings) -> None:
    if header.num_documents == 0 or header.num_tokens == 0:
        found.error(f"data.paths: {_idx(header)} holds no tokens ({header.num_documents} "
                    f"documents); re-run `ptdp preprocess` on a corpus with text in it")
    if header.vocab_size is not None and cfg.model.vocab_size < header.vocab_size:
        found.error(f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of "
                    f"{_idx(header)} ({header.vocab_size}); set "
                    f"model.vocab_size={header.vocab_size}")
    if header.vocab_size is None and header.num_tokens:   # no sidecar: read the ids
        from ptdp.data.indexed import token_id_range
        low, high = token_id_range(header)
        if low < 0 or high >= cfg.model.vocab_size:
            found.error(f"data.paths: {header.prefix}.bin holds token ids {low}..{high}, outside "
                        f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size, or "
                        f"check that this is the data of this model's tokenizer")
    if header.vocab_size is None:
        found.warn(f"data.paths: {_idx(header)} has no {header.prefix}.ptdp.json, so its token "
                   f"ids are not checked against a recorded vocabulary (only read here, and "
                   f"against model.vocab_size as training reads them); write it once with `ptdp "
                   f"preprocess --describe --output-prefix {header.prefix} --tokenizer TOKENIZER`")
    _check_eod_options(cfg, header, found)
    if cfg.model.family.samples is Samples.SENTENCE_PAIRS:
        if not header.meta.get("sentences"):
            found.error(f"data.paths: {_idx(header)} has no sentence boundaries, which BERT "
                        f"needs; re-run `ptdp preprocess --split-sentences`")
        from ptdp.data.tokenizer import SPECIAL_TOKENS
        missing = [t for t in SPECIAL_TOKENS if t not in header.meta.get("special_ids", {})]
        if missing and header.vocab_size is None:   # a Megatron pair: its tokenizer is unknown
            found.error(f"data.paths: {_idx(header)} has no {header.prefix}.ptdp.json naming the "
                        f"special tokens BERT needs; write it with `ptdp preprocess --describe "
                        f"--output-prefix {header.prefix} --tokenizer TOKENIZER`")
        elif missing:
            found.error(f"data.paths: {_idx(header)} was tokenised without {', '.join(missing)}; "
                        f"train the tokenizer with `ptdp tokenizer train` and re-run preprocess")


def _check_eod_options(cfg: Config, header, found: Findings) -> None:
    """The end-of-document options need the data's <eod> id, and <eod> tokens in the data."""
    from ptdp.config.validation import EOD_OPTIONS
    used = [f"data.{key}" for key in EOD_OPTIONS if getattr(cfg.data, key)]
    if not used:
        return
    if "<eod>" not in header.meta.get("special_ids", {}) and not cfg.data.tokenizer:
        found.error(f"{', '.join(used)}: the end-of-document id of {_idx(header)} is unknown (no "
                    f"sidecar naming it); set data.tokenizer, or write the sidecar with `ptdp "
                    f"preprocess --describe --output-prefix {header.prefix} --tokenizer TOKENIZER`")
    elif header.meta.get("append_eod") is False:
        found.warn(f"{', '.join(used)}: {_idx(header)} was preprocessed without end-of-document "
                   f"tokens (--no-append-eod), so these options change nothing")


def _check_enough_tokens(cfg: Config, pairs: list, headers: list, found: Findings) -> None:
    """At least one sample in the train split: L + 1 tokens (estimated from the header and
    data.split, since the split is by documents and their sizes are not read here)."""
    s = cfg.model.seq_length
    try:
        share = parse_split(cfg.data.split)
    except ConfigError:
        return   # reported by the config's validation
    share = share[0] / sum(share)
    # Empty datasets and an empty train split are reported on their own.
    estimates = [(h, int(h.num_tokens * share)) for (w, _), h in zip(pairs, headers)
                 if w > 0 and h.num_tokens > 0]
    if share > 0 and estimates and all(tokens < s + 1 for _, tokens in estimates):
        h, tokens = estimates[0]
        found.error(f"model.seq_length={s} needs {s + 1} tokens per sample, but the train split "
                    f"of {_idx(h)} holds about {tokens} ({h.num_tokens} tokens, data.split="
                    f"{cfg.data.split}); use a shorter model.seq_length or more data")


def _check_same_vocabulary(headers: list, found: Findings) -> None:
    headers = [h for h in headers if h.vocab_size is not None]  # a Megatron pair without sidecar
    if not headers:
        return
    first = headers[0]
    for h in headers[1:]:
        if (h.vocab_size, h.meta.get("tokenizer_fingerprint")) != \
                (first.vocab_size, first.meta.get("tokenizer_fingerprint")):
            found.error(f"data.paths: {_idx(h)} and {_idx(first)} were tokenised with different "
                        f"vocabularies; blend only data from one tokenizer")


def check_tokenizer(cfg: Config, headers: list, found: Findings) -> None:
    """data.tokenizer loads, fits in model.vocab_size and is the one the data was made with."""
    path = cfg.data.tokenizer
    if not path:
        return
    if not package_installed(_tokenizer_package(path)):
        return  # reported by check_packages
    from ptdp.data.tokenizer import TokenizerError, load_tokenizer
    try:
        tok = load_tokenizer(path)
    except (TokenizerError, ImportError, OSError) as err:
        found.error(f"data.tokenizer: {err}")
        return
    vocab_reported = any(line.startswith("model.vocab_size=") for line in found.errors)
    if tok.vocab_size > cfg.model.vocab_size and not vocab_reported:
        found.error(f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of "
                    f"the tokenizer {path} ({tok.vocab_size}); set model.vocab_size={tok.vocab_size}")
    headers = [h for h in headers if h.vocab_size is not None]  # a Megatron pair without sidecar
    if headers:
        data = headers[0]
        data_fp = data.meta.get("tokenizer_fingerprint")
        if tok.vocab_size != data.vocab_size or (data_fp and data_fp != tok.fingerprint):
            found.error(f"data.tokenizer: {path} (vocab_size {tok.vocab_size}) is not the tokenizer "
                        f"{_idx(data)} was made with (vocab_size {data.vocab_size}, tokenizer "
                        f"{data.meta.get('tokenizer', 'unknown')}); point data.tokenizer at that "
                        f"model or re-run `ptdp preprocess` with this one")


# --------------------------------------------------------------------------------------------
# Hardware profile and optional packages
# --------------------------------------------------------------------------------------------

def check_hardware(cfg: Config, found: Findings) -> None:
    if not cfg.log.hardware:
        return
    from ptdp.hardware import HardwareError, load_hardware
    try:
        found.hardware = load_hardware(cfg.log.hardware)
    except HardwareError as err:
        found.error(f"log.hardware: {err}")


def package_installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def check_packages(cfg: Config, found: Findings) -> None:
    """Optional packages the config asks for (torch.utils.tensorboard needs `tensorboard`)."""
    for key, package in (("tensorboard_dir", "tensorboard"), ("wandb_project", "wandb")):
        if getattr(cfg.log, key) and not package_installed(package):
            found.error(f"log.{key} is set but the {package} package is not installed: "
                        f"pip install 'ptdp[{package}]', or unset log.{key}")
    needed = _tokenizer_package(cfg.data.tokenizer) if cfg.data.tokenizer else None
    if needed and not package_installed(needed):
        extra = " 'ptdp[hf]' (or pip install tokenizers)" if needed == "tokenizers" else f" {needed}"
        found.error(f"data.tokenizer needs the {needed} package: pip install{extra}")


def _tokenizer_package(path: str) -> str:
    """What reads data.tokenizer: `tokenizers` for a tokenizer.json, a vocab.json or vocab.txt
    (or a directory holding one), else sentencepiece. The rule of ptdp/data/tokenizer.py
    `is_hf_tokenizer`, repeated because importing ptdp.data imports torch, which the package
    check must not need."""
    return "tokenizers" if Path(path).suffix in (".json", ".txt") or Path(path).is_dir() \
        else "sentencepiece"


def check_devices(cfg: Config, ranks_per_node: int, found: Findings) -> None:
    """One GPU per rank (NCCL): GPU LOCAL_RANK, or LOCAL_RANK % visible when srun shows each
    task only its own (ptdp/runtime/launch_env.py `gpu_of_rank`); one line when none fits."""
    if cfg.train.device == "cpu":
        return
    import torch

    from ptdp.runtime.launch_env import LaunchError, gpu_of_rank, started_by_srun, visible_devices
    if (gpus := torch.cuda.device_count()) == 0:   # auto then trains on CPU
        if cfg.train.device == "cuda":
            found.error(f"train.device=cuda but no GPU is visible{visible_devices(os.environ)}; "
                        f"train on CPU with train.device=cpu")
        elif cfg.train.cuda_graphs:
            found.error(f"train.cuda_graphs=true but no GPU is visible"
                        f"{visible_devices(os.environ)}; set train.cuda_graphs=false on CPU")
        return
    local_rank = int(os.environ.get("LOCAL_RANK") or ranks_per_node - 1)  # (ptdp check: the last)
    try:
        gpu_of_rank(local_rank, gpus, ranks_per_node, started_by_srun())
    except LaunchError as err:
        found.error(f"train.device={cfg.train.device}: {err}")


def check_placement(cfg: Config, world_size: int, ranks_per_node: int, found: Findings) -> None:
    """Tensor groups inside a node (ptdp/parallel/placement.py): a warning, not an error,
    since a job whose tensor groups straddle nodes is slow but correct."""
    par = cfg.parallel
    sizes = (par.pipeline, par.tensor, par.data, par.context)
    if ranks_per_node < 1 or par.data is None or math.prod(sizes) != world_size:
        return   # the layout error is reported by validate()
    from ptdp.parallel.placement import placement_warnings
    for line in placement_warnings(*sizes, ranks_per_node):
        found.warn(line)


# --------------------------------------------------------------------------------------------
# Checkpoint to load
# --------------------------------------------------------------------------------------------

def check_checkpoint_load(cfg: Config, found: Findings) -> None:
    """The checkpoint exists, is complete and readable, and holds this model (any layout)."""
    from ptdp.checkpoint.integrity import first_intact
    from ptdp.checkpoint.layout import CheckpointError, resolve_load
    from ptdp.runtime.exit_status import restart_attempt
    load, which = resolve_load(cfg.checkpoint, restart_attempt() > 0)
    if which:
        found.note(which)
    if not load:
        return
    try:
        directory, meta, notes = first_intact(load, cfg.checkpoint, cfg.model)  # checksums too
    except CheckpointError as err:
        found.error(f"checkpoint.load: {err}")
        return
    for note in notes:
        found.note(f"checkpoint.load: {note}")
    if meta["iteration"] >= cfg.train.iters:
        found.note(f"checkpoint.load: {directory} is at iteration {meta['iteration']}, not before "
                   f"train.iters={cfg.train.iters}: there is nothing left to train")


# --------------------------------------------------------------------------------------------
# Output folders
# --------------------------------------------------------------------------------------------

def check_outputs(cfg: Config, found: Findings) -> None:
    """Outputs go into folders that exist and are writable, or that the job can create
    (rank 0 creates missing ones when it starts, as the shipped configs' runs/<name>/)."""
    for key, path in (("log.metrics_file", cfg.log.metrics_file),
                      ("log.trace_file", cfg.log.trace_file)):
        if path:
            _check_output_file(key, Path(path), found)
    for key, path in (("checkpoint.dir", cfg.checkpoint.dir),
                      ("log.tensorboard_dir", cfg.log.tensorboard_dir)):
        if path:
            _check_output_dir(key, Path(path), found)


def _check_output_file(key: str, path: Path, found: Findings) -> None:
    if path.is_dir():
        found.error(f"{key}: {path} is a directory; give a file name")
    elif path.exists() and not os.access(path, os.W_OK):
        found.error(f"{key}: {path} is not writable; choose another path")
    else:
        _check_output_dir(key, path.absolute().parent, found, file=path)


def _check_output_dir(key: str, path: Path, found: Findings, file: Path | None = None) -> None:
    """`path` is a writable directory, or the nearest existing ancestor is one."""
    whose = f" (the folder of {file})" if file else ""
    if path.exists():
        if not path.is_dir():
            found.error(f"{key}: {path}{whose} is a file, not a directory; choose another path")
        elif not os.access(path, os.W_OK):
            found.error(f"{key}: {path}{whose} is not writable; choose another path")
        return
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        found.error(f"{key}: {path}{whose} cannot be created: {ancestor} is a file; choose "
                    f"another path")
    elif not os.access(ancestor, os.W_OK):
        found.error(f"{key}: {path}{whose} cannot be created: {ancestor} is not writable; "
                    f"choose another path")


# Mounted on one node only; a cluster's shared file systems (nfs, lustre, gpfs, beegfs, cifs,
# fuse-mounted object stores, ...) are not in this list.
LOCAL_FILE_SYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "ramfs",
                      "overlay", "vfat"}


def check_shared_checkpoints(cfg: Config, world_size: int, ranks_per_node: int,
                             found: Findings) -> None:
    """A job of several nodes saves into one directory every node must see (rank 0 makes the
    checkpoint's folders, every rank writes its own files there): warn when checkpoint.dir
    is on this node's own disk. `ptdp train` checks what the ranks really see at start-up
    (ptdp/checkpoint/safety.py `check_shared_directory`)."""
    nodes = -(-world_size // max(1, ranks_per_node))
    if not cfg.checkpoint.dir or nodes <= 1:
        return
    kind = filesystem_type(Path(cfg.checkpoint.dir))
    if kind in LOCAL_FILE_SYSTEMS:
        found.warn(f"checkpoint.dir: {cfg.checkpoint.dir} is on this node's own {kind} file "
                   f"system, but the job spans {nodes} nodes: saving needs a directory every "
                   f"node sees (NFS, Lustre, GPFS, ...); `ptdp train` stops at start-up if the "
                   f"ranks do not see the same folder (docs/clusters.md)")


def filesystem_type(path: Path) -> str | None:
    """The type of the file system holding `path` (or its nearest existing ancestor), from
    /proc/mounts; None where that cannot be read."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
        path = path.resolve()
    except OSError:
        return None
    best, kind = None, None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = Path(fields[1].replace("\\040", " "))
        if (path == point or point in path.parents) and (
                best is None or len(point.parts) > len(best.parts)):
            best, kind = point, fields[2]
    return kind
