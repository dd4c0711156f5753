"""What makes saving and loading safe on every rank: failures are shared (so no rank waits in
a collective for one that failed), and every file and rename is durable before the next step.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid
from pathlib import Path

import torch.distributed as dist

from ptdp.checkpoint.integrity import DiskFull, is_disk_full
from ptdp.checkpoint.layout import CheckpointError
from ptdp.checkpoint.retention import disk_full, sweep_leftovers


def on_all_ranks(what: str, fn):
    """Run fn() on this rank; if it failed on any rank, raise on every rank.

    Returns fn's local result. Only the error text travels, so results may be large.
    """
    error, result = None, None
    try:
        result = fn()
    except Exception as err:  # shared below, then re-raised (chained) on this rank too
        error = err
    text = None if error is None else f"{type(error).__name__}: {error}"
    gathered = all_gather((text, str(error) if isinstance(error, DiskFull) else None))
    full = [line for _, line in gathered if line]
    if full:   # its own line says it all (the folder, the space needed), the same on every rank
        raise DiskFull(full[0]) from error
    failure = _failure_text(what, [message for message, _ in gathered])
    if failure:
        raise CheckpointError(failure) from error
    return result


def shared_failure(what: str, message: str | None) -> str | None:
    """Collective: every rank's `message` (None: no failure) -> "{what} failed on rank R (and
    on N more rank(s)): {R's message}" on every rank, or None if no rank failed."""
    return _failure_text(what, all_gather(message))


def _failure_text(what: str, messages: list) -> str | None:
    failed = [(rank, msg) for rank, msg in enumerate(messages) if msg is not None]
    if not failed:
        return None
    rank, msg = failed[0]
    others = f" (and on {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    return f"{what} failed on rank {rank}{others}: {msg}"


class NotSharedError(CheckpointError):
    """checkpoint.dir is not the same directory on every rank (a node-local disk)."""


def check_shared_directory(directory: str | os.PathLike, patience_s: float = 10.0) -> None:
    """Collective, at start-up: every rank must see the file rank 0 writes into `directory`.

    A save is made by all ranks together in one folder (rank 0 creates it, every rank writes
    its own files, rank 0 publishes): on several nodes that needs a file system they all see.
    Raises NotSharedError on every rank, naming the ranks and hosts that do not see it, before
    any training (a node-local checkpoint.dir would otherwise fail at the first save, or
    publish a checkpoint missing other nodes' files). A rank that does not see the file at
    once looks again for `patience_s` (an NFS client may have cached the folder's absence).
    """
    root, rank0 = Path(directory), dist.get_rank() == 0
    name = [f".ptdp-shared-{uuid.uuid4().hex}" if rank0 else None]

    def write():
        if not rank0:
            return
        root.mkdir(parents=True, exist_ok=True)
        sweep_leftovers(root)   # what died with an earlier job (it holds the folder's lock)
        try:
            write_text_durably(root / name[0], name[0])
        except OSError as err:
            (root / name[0]).unlink(missing_ok=True)
            if is_disk_full(err):
                raise disk_full(root, "starting") from err
            raise

    on_all_ranks(f"writing into checkpoint.dir {root}", write)
    dist.broadcast_object_list(name, src=0)
    seen = _sees(root, name[0], patience_s)
    views = all_gather((seen, socket.gethostname()))
    if rank0:
        (root / name[0]).unlink(missing_ok=True)
    dist.barrier()   # the marker is gone on every rank's return, not only on rank 0's
    blind = [(rank, host) for rank, (saw, host) in enumerate(views) if not saw]
    if blind:
        hosts = sorted({host for _, host in blind})
        ranks = ", ".join(str(rank) for rank, _ in blind[:16]) + (" ..." if len(blind) > 16 else "")
        raise NotSharedError(
            f"checkpoint.dir {root} is not shared: rank(s) {ranks} on {', '.join(hosts)} do not "
            f"see what rank 0 (on {views[0][1]}) writes there; a job on several nodes saves into "
            f"one directory every node sees (NFS, Lustre, GPFS, ...): see docs/clusters.md")


def _sees(root: Path, name: str, patience_s: float) -> bool:
    deadline = time.monotonic() + patience_s
    while True:
        try:
            if name in os.listdir(root):   # a listing revalidates a cached directory
                return (root / name).read_text() == name
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def all_gather(obj) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def write_text_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
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
