"""Checkpoints prove themselves: the size and CRC-32 of every file, and of the metadata itself.

A save hashes each file as it writes it (the bytes pass through `_HashingWriter` on their way
to the disk: no second read), and rank 0 records them in metadata.json under "checksums":

    "checksums": {"algorithm": "crc32",
                  "files": {"model_pp000_tp000.pt": [size in bytes, "8-hex-digit CRC"], ...},
                  "metadata": "CRC of the metadata's canonical JSON, less this field"}

A load checks the size first (a truncated file fails without a read), then the CRC as it reads:
a rank file is read once into memory, hashed and unpickled from there; a shard file, which is
memory-mapped so that a rank reads only its own tensors, is hashed in one sequential pass that
leaves it in the page cache, where the mapped reads find it (one read from the disk, not two).

CRC-32 (zlib) rather than a cryptographic hash: it guards against accidents (flipped bits,
torn or overwritten files), not against an attacker, detects every error burst up to 32 bits
and misses a random corruption with probability 2**-32, and runs at about twice the speed of
BLAKE2b (1.7 GB/s against 0.8 on this project's CPU; tools/bench_checkpoint.py measures the
cost on a checkpoint). Checkpoints written before checksums existed have no "checksums" key
and load unverified.
"""

from __future__ import annotations

import errno
import io
import json
import os
import zlib
from pathlib import Path

import torch

from ptdp.checkpoint.layout import (METADATA, RANK_FILE, CheckpointError, param_file_name,
                                   shard_file_name)

CHECKSUMS = "checksums"   # the metadata's key
ALGORITHM = "crc32"
CHUNK_BYTES = 8 << 20


class DamagedCheckpoint(CheckpointError):
    """A checkpoint's files or metadata are not what its save wrote (bits flipped, a file
    truncated or overwritten, metadata edited): an older intact checkpoint may be loaded."""


class DiskFull(CheckpointError):
    """A checkpoint could not be written: no space left on the device."""


class _HashingWriter:
    """A file object for torch.save that hashes what it writes. torch reports a failed write
    as 'unexpected pos ...'; the OSError is kept so that the caller can raise it instead."""

    def __init__(self, f):
        self.f, self.crc, self.size, self.error = f, 0, 0, None

    def write(self, data) -> int:
        try:
            written = self.f.write(data)
        except OSError as err:
            self.error = err
            raise
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        return written

    def flush(self) -> None:
        self.f.flush()


def _entry(size: int, crc: int) -> list:
    return [size, f"{crc:08x}"]


def save_durably(obj, path: Path) -> list:
    """torch.save `obj` to `path` durably; returns [size, crc] of the bytes written.
    A full disk raises OSError(ENOSPC), not torch's 'unexpected pos'."""
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return _entry(writer.size, writer.crc)


def file_checksum(path: Path) -> list:
    """[size, crc] of a file on disk, read in one streaming pass."""
    crc, size = 0, 0
    buffer = bytearray(CHUNK_BYTES)   # one buffer, refilled: no allocation per chunk
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return _entry(size, crc)


def expected_checksum(meta: dict, name: str) -> list | None:
    """[size, crc] the metadata records for file `name`; None for a checkpoint without
    checksums (written by older code)."""
    recorded = meta.get(CHECKSUMS)
    return None if recorded is None else recorded["files"].get(name)


def _compare(path: Path, expected: list, actual: list) -> None:
    if actual[0] != expected[0]:
        raise DamagedCheckpoint(f"cannot read {path}: it has {actual[0]} bytes, its save wrote "
                                f"{expected[0]} (truncated or overwritten)")
    if actual[1] != expected[1]:
        raise DamagedCheckpoint(f"cannot read {path}: it fails its checksum ({ALGORITHM} "
                                f"{actual[1]}, its save wrote {expected[1]}): the file is corrupt")


def verify_size(path: Path, expected: list | None) -> None:
    """The cheap first check: the file's size (no read)."""
    if expected is not None:
        _compare(path, expected, [path.stat().st_size, expected[1]])


def verify_file(path: Path, expected: list | None) -> None:
    """Raise DamagedCheckpoint unless `path` has the recorded size and checksum."""
    if expected is not None:
        verify_size(path, expected)
        _compare(path, expected, file_checksum(path))


def load_verified(path: Path, expected: list | None, mmap: bool):
    """torch.load a checkpoint file after checking it against `expected` ([size, crc] or None),
    reading it from the disk once (module docstring)."""
    verify_size(path, expected)
    if mmap:
        verify_file(path, expected)
        return _torch_load(path, path, mmap=True)
    data = path.read_bytes()
    if expected is not None:
        _compare(path, expected, _entry(len(data), zlib.crc32(data)))
    return _torch_load(path, io.BytesIO(data), mmap=False)


def _torch_load(path: Path, source, mmap: bool):
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises many types for a bad file; the text says which
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DamagedCheckpoint(f"cannot read {path}: {first_line}") from err


def _metadata_crc(meta: dict) -> str:
    """CRC of the metadata as JSON (keys sorted), less its own checksum."""
    meta = json.loads(json.dumps(meta))   # the types a reader of the file sees
    meta.get(CHECKSUMS, {}).pop("metadata", None)
    return f"{zlib.crc32(json.dumps(meta, sort_keys=True).encode()):08x}"


def seal(meta: dict, files: dict[str, list]) -> dict:
    """`meta` with the checksums of its files and of itself (what rank 0 publishes)."""
    meta = dict(meta, **{CHECKSUMS: {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}})
    meta[CHECKSUMS]["metadata"] = _metadata_crc(meta)
    return meta


def verify_metadata(meta: dict, directory: Path) -> None:
    """Raise DamagedCheckpoint if metadata.json is not what its save wrote (edited, or
    half-overwritten with valid JSON) or lacks what a load reads."""
    where = directory / METADATA
    recorded = meta.get(CHECKSUMS)
    if recorded is not None:
        files = recorded.get("files") if isinstance(recorded, dict) else None
        if not isinstance(files, dict) or set(files) != set(meta["files"]):
            raise DamagedCheckpoint(f"{where}: its checksums do not cover the files it lists")
        if recorded.get("metadata") != _metadata_crc(meta):
            raise DamagedCheckpoint(f"cannot read {where}: it fails its checksum (the metadata "
                                    f"was changed after the save)")
    problems = [key for key, kind in (("iteration", int), ("layout", dict), ("model", dict),
                                      ("params", dict)) if not isinstance(meta.get(key), kind)]
    if problems:
        raise DamagedCheckpoint(f"{where} is not checkpoint metadata: "
                                f"{', '.join(problems)} missing or of the wrong type")


def is_disk_full(err: BaseException | None) -> bool:
    """Whether `err` (or what it was raised from) is 'no space left on device'."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        err = err.__cause__ or err.__context__
    return False


def verify_checkpoint(directory: Path, meta: dict) -> None:
    """Check a whole checkpoint without loading it into a model (what `ptdp check` does,
    before any rank starts): the metadata, every file's size and checksum (old checkpoints
    without checksums: every file opens), and that each shard holds the parameters the
    metadata places on its pipeline rank."""
    verify_metadata(meta, directory)
    layout = meta["layout"]
    by_file: dict[str, list[str]] = {shard_file_name(pp, tp): []
                                     for pp in range(layout["pipeline"])
                                     for tp in range(layout["tensor"])}
    for name, info in meta["params"].items():   # experts of rank r > 0: their own files
        for tp in range(layout["tensor"]):
            by_file.setdefault(param_file_name(info, tp), []).append(name)
    for file, names in by_file.items():
        path = directory / file
        shard = load_verified(path, expected_checksum(meta, file), mmap=True)
        missing = [n for n in names
                   if not isinstance(shard, dict) or "value" not in (shard.get(n) or {})]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise DamagedCheckpoint(f"{path} has no entry for parameter '{missing[0]}'{more} "
                                    f"(the metadata says it is there)")
    for name in meta["files"]:
        if RANK_FILE.fullmatch(name):
            load_verified(directory / name, expected_checksum(meta, name), mmap=False)
        elif name not in by_file:   # config.yaml, the tokenizer's files
            verify_file(directory / name, expected_checksum(meta, name))


def first_intact(path, ck, model) -> tuple[Path, dict, list[str]]:
    """(directory, metadata, notes) of the checkpoint a job given `path` would load, verified
    whole (`verify_checkpoint`), trying the candidates a job tries in the same order
    (ptdp/checkpoint/layout.py `load_candidates`); the notes say which were skipped and why.
    Raises CheckpointError when none is intact or one holds another model."""
    from ptdp.checkpoint.layout import check_model_config, load_candidates, read_metadata
    notes, problems = [], []
    for directory, note in load_candidates(path, ck):
        directory = Path(directory)
        try:
            meta = read_metadata(directory)
            check_model_config(meta, model, directory)
            verify_checkpoint(directory, meta)
        except DamagedCheckpoint as err:
            problems.append(str(err))
            notes.append(f"skipping {directory}, it fails verification: {err}")
            continue
        return directory, meta, notes + ([note] if note else [])
    raise CheckpointError(problems[0] if len(problems) == 1
                          else "no intact checkpoint: " + "; ".join(problems))
