"""No anonymous hang: a rank that stops is named, and the job ends within train.timeout_s.

The unit tests drive the watchdog with an in-memory store; the last test stops one of 8
real ranks with SIGSTOP under torchrun and checks that the job ends, non-zero, naming it.
"""

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from ptdp.runtime.trace import NO_SPANS
from ptdp.runtime.watchdog import Watchdog, is_communication_error

ROOT = Path(__file__).resolve().parents[1]


class MemoryStore:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def multi_get(self, keys):
        return [self.data.get(k, b"") for k in keys]

    def add(self, key, amount):
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value


def _watchdogs(world: int, timeout_s: float = 30.0):
    store = MemoryStore()
    return store, [Watchdog(r, world, lambda r: f"(p={r})", timeout_s, store=store,
                            on_hang=lambda line: None) for r in range(world)]


def test_a_rank_without_heartbeat_is_named_with_its_last_action():
    store, dogs = _watchdogs(4)
    now = time.time()
    for dog in dogs:
        dog.doing("iteration 7", iteration=7)
    with dogs[2].track(NO_SPANS)("F3@s1", "forward"):
        for dog in dogs:
            dog._publish(now - (60 if dog.rank == 2 else 0))
    beats = dogs[0].heartbeats()
    line = dogs[0].diagnose(beats, now)
    assert line.startswith("rank(s) stopped making progress: rank 2 (p=2) (pid ")
    assert "no heartbeat for 60s, last in iteration 7 at F3@s1" in line
    assert [d.is_reporter(beats, now) for d in dogs] == [True, False, False, False]


def test_when_every_rank_is_alive_the_ones_not_waiting_are_named():
    store, dogs = _watchdogs(3)
    now = time.time()
    for dog in dogs:
        dog.doing("iteration 4", iteration=4)
    spans = [dog.track(NO_SPANS) for dog in dogs]
    with spans[0]("wait act mb1 s0->s1", "wait"), spans[1]("B1@s1", "backward"), \
            spans[2]("data-parallel reduce", "reduce"):
        for dog in dogs:
            dog._publish(now)
        line = dogs[0].diagnose(dogs[0].heartbeats(), now)
    assert "every rank is alive" in line
    assert "rank 1 (p=1)" in line and "at B1@s1" in line
    assert "rank 0 " not in line and "rank 2 " not in line


def test_a_lost_peer_is_named_once_with_the_backend_error():
    """Ranks whose communication failed wait for the dead rank's heartbeat to go stale;
    the first to claim the report names it, the others end quietly."""
    fired = []
    store, dogs = MemoryStore(), []
    for r in range(4):
        dogs.append(Watchdog(r, 4, lambda r: f"(p={r})", 1.0, store=store, on_hang=fired.append))
    now = time.time()
    for dog in dogs:
        dog.doing("iteration 3", iteration=3)
        dog._publish(now - (60 if dog.rank == 2 else 0))
    error = RuntimeError("[/x/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                         "by peer [10.213.0.2]:17536. This is typically caused by a remote "
                         "worker crashing.")
    assert is_communication_error(error) and not is_communication_error(ValueError("gloo"))
    dogs[3].lost_peer(error)
    dogs[0].lost_peer(error)
    assert fired[1] is None
    assert fired[0].startswith("lost rank(s): rank 2 (p=2) (pid ")
    assert "no heartbeat for 6" in fired[0] and "last in iteration 3 at iteration 3" in fired[0]
    assert fired[0].endswith("rank 3 (p=3) saw: gloo: Connection closed by peer "
                             "[10.213.0.2]:17536. Ending the job.")


def test_stall_check_fires_only_from_the_second_iteration_and_not_in_checkpoint_saves():
    fired = []
    dog = Watchdog(0, 2, str, timeout_s=1.0, store=MemoryStore(), first_iteration=5,
                   on_hang=fired.append)
    assert dog.stall_s == pytest.approx(0.8) and dog.interval_s == 0.5
    dog.start()
    try:
        dog.doing("iteration 5", iteration=5)      # the job's first: may be slow
        time.sleep(1.6)
        assert fired == []
        dog.doing("checkpoint save", iteration=6, watch=False)
        time.sleep(1.6)
        assert fired == []
        dog.doing("iteration 7", iteration=7)
        time.sleep(1.6)
    finally:
        dog.stop()
    assert len(fired) == 1


def test_a_rank_that_does_not_report_gives_the_reporter_time_to_speak():
    """Rank 1 sees the stall first but rank 0 reports: rank 1 ends only after a grace, so that
    torchrun does not stop rank 0 before it has printed (the job's one line)."""
    calls = []
    store = MemoryStore()
    dogs = [Watchdog(r, 2, str, timeout_s=2.0, store=store, first_iteration=1,
                     on_hang=lambda line, r=r: calls.append((r, line, time.time())))
            for r in range(2)]
    assert dogs[1].reporter_grace_s == pytest.approx(1.0)   # two heartbeat intervals
    for dog in dogs:
        dog.start()
    try:
        dogs[1].doing("iteration 2", iteration=2)
        time.sleep(0.1)                          # rank 0 blocks later than rank 1
        dogs[0].doing("iteration 2", iteration=2)
        deadline = time.monotonic() + 10
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for dog in dogs:
            dog.stop()
    (first, line, at), (second, quiet, end) = sorted(calls, key=lambda c: c[2])
    assert first == 0 and line.startswith("no progress for") and (second, quiet) == (1, None)


def _pid_of_rank(rank: int, marker: str) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PTDP_TEST_MARKER={marker}".encode() in env and f"RANK={rank}".encode() in env \
                and b"TORCHELASTIC_RUN_ID" in b"\0".join(env):
            cmdline = (entry / "cmdline").read_bytes()
            if b"ptdp" in cmdline and b"torch.distributed.run" not in cmdline:
                return int(entry.name)
    return None


def _continue_when_named(job, stopped: int, lines: list) -> None:
    """Collect the job's output; once it names the stopped rank, let that rank run again, so
    that it takes torchrun's SIGTERM at once instead of torchrun waiting out its 30 s grace
    for a frozen process (the job has already ended by then, and said why)."""
    for line in job.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("ptdp train: rank(s) stopped making progress"):
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_sigstop_on_one_of_8_ranks_ends_the_job_naming_it(tmp_path):
    marker, metrics = uuid.uuid4().hex, tmp_path / "metrics.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), PTDP_TEST_MARKER=marker, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
           "-m", "ptdp", "train", str(ROOT / "configs/gpt_tiny.yaml"), "parallel.pipeline=2",
           "parallel.tensor=2", "train.iters=100000", "train.timeout_s=10", "log.interval=1000",
           f"log.metrics_file={metrics}", "log.progress=false"]
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    stopped, lines, reader = None, [], None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.5)
        stopped = _pid_of_rank(5, marker)
        assert stopped, "rank 5 not found"
        reader = threading.Thread(target=_continue_when_named, args=(job, stopped, lines),
                                  daemon=True)
        reader.start()
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        job.wait(timeout=150)
        elapsed = time.monotonic() - start
        reader.join(timeout=10)
    finally:
        if stopped:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(stopped, sig)
                except ProcessLookupError:
                    pass
        if job.poll() is None:
            job.kill()
    out = "\n".join(lines)
    ours = [line for line in lines if line.startswith("ptdp train: ")]
    assert job.returncode != 0
    assert len(ours) == 1, out
    assert ours[0].startswith("ptdp train: rank(s) stopped making progress: rank 5 (p=1, d=0, t=1)")
    assert "no heartbeat for" in ours[0] and "last in iteration" in ours[0]
    assert elapsed < 10 + 45, elapsed   # the stall check, then torchrun's shutdown
