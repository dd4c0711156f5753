"""What makes saving and loading safe on every rank: failures are shared (so no rank waits in
a collective for one that failed), and every file and rename is durable before the next step.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ptdp.checkpoint.layout import CheckpointError


def on_all_ranks(what: str, fn):
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


def all_gather(obj) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def save_durably(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


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
