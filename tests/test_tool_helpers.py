"""What the tools and the long-run tests share: tools/harness.py's alternating rounds and
tools/jobs.py's stop, which must end a job's workers in sessions of their own."""

import os
import subprocess
import sys
import time

import pytest

from tools import harness, jobs


def test_alternating_rounds_warm_up_then_swap_the_order_and_count_the_steps():
    calls = []
    sides = {name: (lambda i, name=name: calls.append((name, i)) or f"{name}{i}")
             for name in ("a", "b")}
    rounds = harness.alternating(sides, rounds=3, warmup=1, swap=True, first=1)
    assert calls == [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("b", 3), ("a", 3), ("a", 4),
                     ("b", 4)]
    assert [list(laps) for laps in rounds] == [["a", "b"]] * 3          # named, in `sides` order
    assert [laps["b"].result for laps in rounds] == ["b2", "b3", "b4"]  # warm-up left out
    assert all(lap.wall >= 0 and lap.cpu >= 0 for laps in rounds for lap in laps.values())
    calls.clear()
    harness.alternating(sides, rounds=2)                                # no swap: in order
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]


# A stand-in for torchrun: a worker in a session of its own (as torchrun starts each), which
# outlives its parent and the parent's process group.
LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                          start_new_session=True)
print(worker.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_stop_ends_the_job_and_its_workers_in_their_own_sessions(tmp_path):
    job = jobs.start([sys.executable, "-c", LAUNCHER], tmp_path)
    try:
        worker = int(job.stdout.readline())
        assert os.getsid(worker) != os.getsid(job.pid)   # beyond the job's group and session
        assert jobs.processes(job.marker) == sorted([job.pid, worker])
    finally:
        jobs.stop(job)
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.returncode == -9 and not _alive(worker)
    job.stdout.close()


def test_iterations_are_the_metrics_lines_and_a_job_that_ends_first_fails_the_wait(tmp_path):
    metrics = tmp_path / "m.jsonl"
    assert jobs.count_iterations(metrics) == 0
    metrics.write_text('{"iter": 1}\n{"iter": 2}\n\n')
    assert jobs.count_iterations(metrics) == 2
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    with pytest.raises(AssertionError, match="did not reach iteration 3"):
        jobs.wait_for_iteration(metrics, ended, 3, timeout=5)
