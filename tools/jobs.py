"""Real training jobs on CPU ranks, started the way the long-run tests (tests/test_restart.py,
tests/test_joblock.py, tests/test_multinode_restart.py, ...) and tools/attack_long_runs.py start
them: the environment, waiting for an iteration in the metrics file, finding a rank's worker,
and ending everything a job started.

A job's processes are found by PTDP_TEST_MARKER, a variable only they carry: torchrun starts
each worker in a session of its own, so neither the launcher's process group nor its session
reaches them once the launcher is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools/pretrain_gpt.sh"
MARKER = "PTDP_TEST_MARKER"


def env(**extra) -> dict:
    """This environment for 2 CPU ranks of this checkout (no rank variables of a caller that is
    itself a rank), with `extra` on top."""
    out = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                "NPROC": "2", "PYTHON": sys.executable, **extra})
    return out


def start(command: list[str], cwd, **extra) -> subprocess.Popen:
    """`command` in a session of its own, with env(**extra) and a marker of its own (unless
    `extra` names one); its output (stderr too) is text on job.stdout; job.marker is the
    marker, for pid_of_rank and stop."""
    extra.setdefault(MARKER, uuid.uuid4().hex)
    job = subprocess.Popen(command, cwd=cwd, env=env(**extra), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    job.marker = extra[MARKER]
    return job


def train_direct(overrides_of_rank: list[list[str]], port: int,
                 timeout_s: float = 120) -> list[tuple[int, str]]:
    """`ptdp train configs/gpt_tiny.yaml` on len(overrides_of_rank) ranks started directly, each
    with its own overrides and the rendezvous variables torchrun would set (rank 0 hosts the
    store, as under srun): each rank's exit code and stderr."""
    world, ranks = len(overrides_of_rank), []
    try:
        for rank, overrides in enumerate(overrides_of_rank):
            ranks.append(subprocess.Popen(
                [sys.executable, "-m", "ptdp", "train", str(ROOT / "configs/gpt_tiny.yaml"),
                 *overrides],
                env=env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port)),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        said = [rank.communicate(timeout=timeout_s)[1] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    return [(rank.returncode, err) for rank, err in zip(ranks, said)]


def stop(job: subprocess.Popen) -> None:
    """End `job` and everything it started, whether it is running, frozen or done: its process
    group (the launch script, torchrun, the script's checks) if it was started in a session of
    its own, and every process with its marker (job.marker: the workers). A stopped process is
    continued first, so that it takes the kill."""
    marked = processes(job.marker) if hasattr(job, "marker") else []
    # Its group only while it runs (once reaped, its pid may be another's: the marker serves)
    # and only if it leads one (started with start_new_session).
    leads = job.poll() is None and _group_of(job.pid) == job.pid
    for sig in (signal.SIGCONT, signal.SIGKILL):
        if leads:
            try:
                os.killpg(job.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        send(marked, sig)
    try:
        job.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def send(pids: list[int], *signals) -> None:
    """Each signal to each pid that is still there."""
    for pid in pids:
        for sig in signals:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def count_iterations(metrics: Path) -> int:
    """The iterations a metrics file (one JSON line each) has logged so far."""
    try:
        return sum(1 for line in metrics.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def wait_for_iteration(metrics: Path, job: subprocess.Popen, at_least: int,
                       timeout: float = 120) -> None:
    """Until the job has logged `at_least` iterations; fails if it ends or takes longer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.poll() is None:
        if count_iterations(metrics) >= at_least:
            return
        time.sleep(0.05)
    raise AssertionError(f"the job did not reach iteration {at_least} ({metrics})")


def _read(pid: str, what: str) -> bytes:
    try:
        return (Path("/proc") / pid / what).read_bytes()
    except OSError:   # gone, or not ours to read
        return b""


def processes(marker: str) -> list[int]:
    """Every live process started with PTDP_TEST_MARKER=marker."""
    entry = f"{MARKER}={marker}".encode()
    return sorted(int(pid) for pid in os.listdir("/proc")
                  if pid.isdigit() and entry in _read(pid, "environ").split(b"\0"))


def trainers(marker: str, agent: bool = False) -> list[int]:
    """The `ptdp train` workers of the job with `marker` (agent: its torchrun agents instead),
    not the launch script nor its checks."""
    found = []
    for pid in processes(marker):
        cmdline = _read(str(pid), "cmdline")
        if b"ptdp\0train" in cmdline and (b"torch.distributed.run" in cmdline) == agent:
            found.append(pid)
    return found


def pid_of_rank(rank: int, marker: str) -> int:
    """The worker of global rank `rank` of the job with `marker`."""
    for pid in trainers(marker):
        if f"RANK={rank}".encode() in _read(str(pid), "environ").split(b"\0"):
            return pid
    raise LookupError(f"no worker of rank {rank} found (marker {marker})")
