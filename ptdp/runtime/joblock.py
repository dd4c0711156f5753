"""One job per checkpoint directory and metrics file, and no worker outliving its launcher.

A job's outputs (`targets`: checkpoint.dir, and log.metrics_file with or without one) are each
guarded by a lock in their folder. Every rank holds a shared lock (fcntl.flock, LOCK_SH) on
the output's lock file (`.ptdp-lock` for checkpoint.dir, `.<metrics file name>.ptdp-lock` for
the metrics file) from start-up until its process ends (the kernel releases it however the
process dies), and leaves a file `.ptdp-holder-<host>-<pid>` naming itself and its job beside it.

Two ways a second job is kept out:
- Launched by the launch script (tools/pretrain_gpt.sh, on node 0): before torchrun it runs
  `python -m ptdp.runtime.joblock CONFIG [key=value ...]`, which takes each lock exclusively
  for a moment: it succeeds once no process of an earlier job holds it, waiting up to
  PTDP_LOCK_WAIT_S seconds (default 60) for such processes to end, and otherwise stops with one
  line naming them (exit 2).
- Launched directly (torchrun, srun): each rank, under a short exclusive gate, looks for
  holders of another job (`job_key`: the rendezvous and run ids that every rank of one job
  shares). Each job also holds a lock of its own (`.ptdp-lock-<job>`), so whether another job
  is alive is asked of the kernel, on any host: a job whose lock is free is dead and its
  holder files go; a live one refuses this job in one line (`JobInUse`, exit 2 before any
  process group starts).
So a restart never runs beside its predecessor, and two jobs never share an output.

Ranks can disagree: a folder that nodes see differently (a node's own disk), or two jobs
starting at the same moment, each of whose ranks may find the other's. `ptdp train` therefore
makes the verdict one with the start-up checks' (ptdp/runtime/agreement.py, before any process
group): if any rank was refused, every rank exits 2 and rank 0 prints the refusal, naming the
rank that found it when not all did; no rank is left waiting in the process group's rendezvous
for one that left.

`die_with_parent`: a rank asks the kernel to kill it when the process that started it (the
torchrun agent) dies (prctl PR_SET_PDEATHSIG, Linux), so that a killed agent leaves no
workers training behind it.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1
JOB_LINE = "job "   # the holder file's second line: its job's digest
_held: list = []    # this process's open lock files: closing them (at exit) releases the locks


class JobInUse(RuntimeError):
    """An output of this job is held by another live job (one line naming its holders)."""


@dataclass(frozen=True)
class Target:
    """A job's output and the files that guard it in its folder (module docstring)."""

    folder: Path
    stem: str      # prefix of the guard files' names
    key: str       # the config key that names the output
    shown: str     # how the output is shown

    @property
    def lock(self) -> Path:
        return self.folder / f"{self.stem}lock"

    @property
    def holder_prefix(self) -> str:
        return f"{self.stem}holder-"

    def job_lock(self, job: str) -> Path:
        return self.folder / f"{self.stem}lock-{job}"


def checkpoint_target(directory: str | os.PathLike) -> Target:
    return Target(Path(directory), ".ptdp-", "checkpoint.dir", str(directory))


def targets(cfg) -> list[Target]:
    """The outputs a job must have to itself: checkpoint.dir and the metrics file."""
    out = [checkpoint_target(cfg.checkpoint.dir)] if cfg.checkpoint.dir else []
    if cfg.log.metrics_file:
        metrics = Path(cfg.log.metrics_file)
        out.append(Target(metrics.parent, f".{metrics.name}.ptdp-", "log.metrics_file",
                          str(metrics)))
    return out


def job_key() -> str:
    """A digest of what every rank of one job shares and another job does not: the
    rendezvous address (torchrun's MASTER_ADDR:MASTER_PORT), torchrun's run id, SLURM's job
    and step."""
    ids = [os.environ.get(name, "") for name in ("MASTER_ADDR", "MASTER_PORT",
                                                  "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                                                  "SLURM_STEP_ID")]
    return hashlib.sha1("/".join(ids).encode()).hexdigest()[:12]


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


def hold_outputs(cfg, rank: int) -> None:
    """Hold every output of the job (`targets`) for this process's lifetime; JobInUse when
    another live job holds one."""
    for target in targets(cfg):
        hold(target, rank)


def hold(target: Target | str | os.PathLike, rank: int) -> None:
    """Hold the shared lock of `target` (a checkpoint directory when given a path) for this
    process's lifetime and name this process and its job beside it; JobInUse, holding
    nothing, when a live process of another job holds it."""
    if not isinstance(target, Target):
        target = checkpoint_target(target)
    target.folder.mkdir(parents=True, exist_ok=True)
    common = open(target.lock, "a+")
    fcntl.flock(common, fcntl.LOCK_SH)   # (waits while a launcher checks the folder: a moment)
    job = job_key()
    with open(target.folder / f"{target.stem}gate", "a+") as gate:
        fcntl.flock(gate, fcntl.LOCK_EX)   # one rank at a time looks and registers
        others = _other_live_jobs(target, job)
        if others:
            common.close()
            raise JobInUse(f"{target.key} {target.shown} is in use by another job: "
                           f"{'; '.join(others)}; stop it, or give this job another {target.key}")
        mine = open(target.job_lock(job), "a+")
        fcntl.flock(mine, fcntl.LOCK_SH)
        holder = target.folder / f"{target.holder_prefix}{socket.gethostname()}-{os.getpid()}"
        holder.write_text(f"rank {rank} pid {os.getpid()} on {socket.gethostname()}\n"
                          f"{JOB_LINE}{job}\n")
    _held.extend([common, mine])
    import atexit
    atexit.register(lambda: holder.unlink(missing_ok=True))


def _other_live_jobs(target: Target, job: str) -> list[str]:
    """The holders of jobs other than `job` that are alive (their job lock is held); the
    holder files and job locks of dead jobs are removed."""
    by_job: dict[str, list[Path]] = {}
    for path in target.folder.glob(target.holder_prefix + "*"):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        other = next((line[len(JOB_LINE):] for line in lines if line.startswith(JOB_LINE)), "")
        if other != job:
            by_job.setdefault(other, []).append(path)
    alive = []
    for other, paths in sorted(by_job.items()):
        # (a file without a job line, written by older code: alive unless its process is
        # known dead, which `holders` checks)
        if not other or _job_alive(target, other):
            alive += holders(target, only=paths)
        else:
            for path in paths:
                path.unlink(missing_ok=True)
    return alive


def _job_alive(target: Target, job: str) -> bool:
    """Whether a process still holds `job`'s lock; a dead job's lock file goes."""
    path = target.job_lock(job)
    if not path.exists():
        return False
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        path.unlink(missing_ok=True)
    return False


def holders(target: Target, only: list | None = None) -> list[str]:
    """Who holds the lock of `target`, as the holder files say ('rank R pid P on HOST';
    `only`: these files); files of processes known dead (on this host) are removed."""
    here, out = socket.gethostname(), []
    for path in sorted(only if only is not None else
                       target.folder.glob(target.holder_prefix + "*")):
        host, _, pid = path.name[len(target.holder_prefix):].rpartition("-")
        if host == here and pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            continue
        try:
            out.append(path.read_text().splitlines()[0].strip())
        except (OSError, IndexError):
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


def wait_until_free(target: Target | Path, patience_s: float) -> list[str]:
    """Take and release the exclusive lock of `target` (a checkpoint directory when given a
    path) within `patience_s`; returns [] once free, else who holds it."""
    if not isinstance(target, Target):
        target = checkpoint_target(target)
    if not target.lock.exists():
        return []
    deadline = time.monotonic() + patience_s
    with open(target.lock, "a+") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(handle, fcntl.LOCK_UN)
                return []
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return (holders(target)
                            or ["a process this host cannot name"])
                time.sleep(0.2)


def main(argv: list[str]) -> int:
    """`python -m ptdp.runtime.joblock CONFIG [key=value ...]`: 0 when the config's outputs
    (checkpoint.dir, log.metrics_file) are free (or there are none), 2 with one line naming
    the holders of the first one in use."""
    from ptdp.config import ConfigError, load_config
    config = argv[0] if argv and "=" not in argv[0] else None
    overrides = argv[1:] if config else argv
    try:
        outputs = targets(load_config(config, overrides))
    except ConfigError:
        return 0   # reported by `ptdp check`, which runs first
    patience = float(os.environ.get("PTDP_LOCK_WAIT_S") or 60)
    for target in outputs:
        held = wait_until_free(target, patience)
        if held:
            print(f"{target.key} {target.shown} is in use by another job (waited "
                  f"{patience:.0f} s): {'; '.join(held)}; stop it, or give this job another "
                  f"{target.key}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
