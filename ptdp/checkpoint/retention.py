"""What a checkpoint folder keeps, and what a full disk says.

Retention (`checkpoint.keep_last`, `checkpoint.keep_every`): after each save rank 0 deletes the
complete checkpoints beyond the newest `keep_last`, except those at a multiple of `keep_every`,
the one this job resumed from (`protect`, called by ptdp/checkpoint/load.py: it was verified,
the newer ones are not yet read back) and never the newest. A checkpoint is first renamed to
`iter_N.del.tmp` (never loaded; swept by the next save or start-up if the deletion dies), then
removed.

Start-up (`sweep_leftovers`): the temporaries of saves and start-up checks that died (`*.tmp`,
`.ptdp-shared-*` markers) go before the job writes anything, so that a job that died of a full
disk does not fill it again with its own leftovers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ptdp.checkpoint.integrity import DiskFull
from ptdp.checkpoint.layout import CHECKPOINT_NAME, TMP_SUFFIX, complete_checkpoints, latest_name

SHARED_MARKER = ".ptdp-shared-"   # ptdp/checkpoint/safety.py check_shared_directory
_protected: set[Path] = set()     # checkpoints this process loaded


def protect(directory: Path) -> None:
    """Never delete `directory` in this process (the checkpoint the job resumed from)."""
    _protected.add(Path(directory).resolve())


def prune(root: Path, keep_last: int, keep_every: int) -> list[Path]:
    """Delete what retention does not keep (module docstring); returns what was deleted."""
    if keep_last <= 0:
        return []
    checkpoints = complete_checkpoints(root)   # newest first
    named = latest_name(root)
    deleted = []
    for directory in reversed(checkpoints[keep_last:]):   # oldest first
        iteration = int(CHECKPOINT_NAME.fullmatch(directory.name).group(1))
        if ((keep_every and iteration % keep_every == 0) or directory.name == named
                or directory.resolve() in _protected):
            continue
        trash = directory.with_name(directory.name + ".del" + TMP_SUFFIX)
        directory.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(directory)
    return deleted


def sweep_leftovers(root: Path) -> None:
    """Remove what saves and start-up checks that died left in `root` (module docstring)."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.name.endswith(TMP_SUFFIX) or entry.name.startswith(SHARED_MARKER):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def directory_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def disk_full(root: Path, what: str) -> DiskFull:
    """The one line for a full disk under `root`: the folder, what is free, and what a save
    needs, estimated from the last checkpoint saved there."""
    from ptdp.metrics.report import format_bytes
    free = shutil.disk_usage(root).free if root.exists() else 0
    last = next(iter(complete_checkpoints(root)), None) if root.is_dir() else None
    if last is not None:
        size = directory_bytes(last)
        need = (f"a checkpoint needs about {format_bytes(size)} (the size of the last one, "
                f"{last.name}): free at least {format_bytes(max(size - free, 0))} more there")
    else:
        need = "free space there (no checkpoint saved yet to estimate a save's size from)"
    return DiskFull(f"no space left on the device of checkpoint.dir {root} while {what}: "
                    f"{format_bytes(free)} free; {need}, or keep fewer checkpoints "
                    f"(checkpoint.keep_last)")

