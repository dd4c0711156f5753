"""One job per checkpoint directory, and no worker outliving its launcher.

Every rank of a job holds a shared lock (fcntl.flock, LOCK_SH) on `checkpoint.dir/.ptdp-lock`
from start-up until its process ends (the kernel releases it however the process dies), and
leaves a file `.ptdp-holder-<host>-<pid>` naming itself beside it. Before starting torchrun,
the launch script (tools/pretrain_gpt.sh, on node 0) runs `python -m ptdp.runtime.joblock
CONFIG [key=value ...]`, which takes the lock exclusively for a moment: it succeeds once no
process of an earlier job holds it, waiting up to PTDP_LOCK_WAIT_S seconds (default 60) for
such processes to end, and otherwise stops with one line naming them (exit 2). So a restart
never runs beside its predecessor, and two jobs never share a checkpoint.dir and metrics file.

`die_with_parent`: a rank asks the kernel to kill it when the process that started it (the
torchrun agent) dies (prctl PR_SET_PDEATHSIG, Linux), so that a killed agent leaves no
workers training behind it.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import sys
import time
from pathlib import Path

LOCK_FILE = ".ptdp-lock"
HOLDER_PREFIX = ".ptdp-holder-"
PR_SET_PDEATHSIG = 1
_held: list = []   # this process's open lock file: closing it (at exit) releases the lock


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; a no-op elsewhere).
    If the parent is already gone (it died before the request), exit now."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def hold(directory: str | os.PathLike, rank: int) -> None:
    """Hold the shared lock of `directory` for this process's lifetime, and name this process
    beside it. Waits while a launcher checks the folder (a moment)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    handle = open(root / LOCK_FILE, "a+")
    fcntl.flock(handle, fcntl.LOCK_SH)
    _held.append(handle)
    holder = root / f"{HOLDER_PREFIX}{socket.gethostname()}-{os.getpid()}"
    holder.write_text(f"rank {rank} pid {os.getpid()} on {socket.gethostname()}\n")
    import atexit
    atexit.register(lambda: holder.unlink(missing_ok=True))


def holders(directory: Path) -> list[str]:
    """Who holds the lock, as the holder files say ('rank R pid P on HOST'); files of processes
    known dead (on this host) are removed."""
    here, out = socket.gethostname(), []
    for path in sorted(directory.glob(HOLDER_PREFIX + "*")):
        host, _, pid = path.name[len(HOLDER_PREFIX):].rpartition("-")
        if host == here and pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            continue
        try:
            out.append(path.read_text().strip())
        except OSError:
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_until_free(directory: Path, patience_s: float) -> list[str]:
    """Take and release the exclusive lock of `directory` within `patience_s`; returns [] once
    free, else who holds it."""
    if not directory.is_dir():
        return []
    deadline = time.monotonic() + patience_s
    with open(directory / LOCK_FILE, "a+") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(handle, fcntl.LOCK_UN)
                return []
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return holders(directory) or ["a process this host cannot name"]
                time.sleep(0.2)


def main(argv: list[str]) -> int:
    """`python -m ptdp.runtime.joblock CONFIG [key=value ...]`: 0 when the config's
    checkpoint.dir is free (or there is none), 2 with one line naming its holders."""
    from ptdp.config import ConfigError, load_config
    config = argv[0] if argv and "=" not in argv[0] else None
    overrides = argv[1:] if config else argv
    try:
        directory = load_config(config, overrides).checkpoint.dir
    except ConfigError:
        return 0   # reported by `ptdp check`, which runs first
    if not directory:
        return 0
    patience = float(os.environ.get("PTDP_LOCK_WAIT_S") or 60)
    held = wait_until_free(Path(directory), patience)
    if held:
        print(f"checkpoint.dir {directory} is in use by another job (waited {patience:.0f} s): "
              f"{'; '.join(held)}; stop it, or give this job another checkpoint.dir",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
