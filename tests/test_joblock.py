"""One job per checkpoint directory (ptdp/runtime/joblock.py), and no worker outliving its agent.

* A killed torchrun agent (kill -9 at iteration 12 of a job under tools/pretrain_gpt.sh with
  MAX_RESTARTS=1): its workers die with it (they used to train on as orphans beside the
  restarted job, clash over its `.tmp` directory and lose iterations), the restart resumes,
  and the run ends with exit 0, every iteration once and the uninterrupted run's losses.
* A second launch on a checkpoint.dir in use waits, then stops with one line naming the
  processes that hold it (exit 2).
* A refusal found by one rank only ends every rank with exit 2 and one line.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ptdp.metrics.log import read_metrics
from ptdp.runtime.joblock import wait_until_free
from ptdp.runtime.local_ranks import free_port, run_on_ranks
from tests.deadline import within
from tests.test_restart import _reference_losses
from tools import jobs
from tools.jobs import ROOT, SCRIPT, env as _env

ITERS = 20
# train.timeout_s=15: heartbeats every 0.5 s (the shortest), so a rank lost in
# tests/test_multinode_restart.py is found stale within ~2 s.
JOB = ["parallel.pipeline=2", f"train.iters={ITERS}", "checkpoint.save_interval=10",
       "checkpoint.load=auto", "model.dropout=0.1", "train.timeout_s=15", "log.progress=false",
       "log.interval=1000"]

HOLDER = """
import sys, time
from ptdp.runtime.joblock import hold
hold(sys.argv[1], 3)
print("held", flush=True)
time.sleep(600)
"""


@functools.lru_cache(maxsize=None)
def uninterrupted_losses() -> list[float]:
    """JOB's losses without a fault (once: tests/test_multinode_restart.py asks too)."""
    return run_on_ranks(2, _reference_losses, [o for o in JOB if not o.startswith("checkpoint.")],
                        timeout_s=within(180))[0]


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:   # a zombie is gone too (its parent, killed, cannot reap it)
            if (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """The three scenarios of real jobs below, started at once (the killed agent's job waits
    out start-ups and a restart, the others mostly a lock's patience and rank 0's time to
    speak): {name: future of what the scenario saw}; each test asserts on its own."""
    with ThreadPoolExecutor(3) as pool:
        yield {"killed agent": pool.submit(_killed_agent, tmp_path_factory.mktemp("agent")),
               "second job": pool.submit(_second_job, tmp_path_factory.mktemp("second")),
               "refusal": pool.submit(_refusal, tmp_path_factory.mktemp("refusal"))}


def _killed_agent(tmp_path: Path) -> dict:
    """The job of the first test below, its agent killed at iteration 12: whether its workers
    went with it, the job's exit code, output and metrics, and the uninterrupted losses."""
    metrics = tmp_path / "metrics.jsonl"
    overrides = JOB + [f"checkpoint.dir={tmp_path / 'ck'}", f"log.metrics_file={metrics}"]
    job = jobs.start(["bash", str(SCRIPT), str(ROOT / "configs/gpt_tiny.yaml"), *overrides],
                     tmp_path, MAX_RESTARTS="1", GPUS_PER_NODE="2")   # (no torch to count GPUs)
    with ThreadPoolExecutor(1) as pool:   # the uninterrupted run, beside the job
        reference = pool.submit(uninterrupted_losses)
        try:
            jobs.wait_for_iteration(metrics, job, 12, timeout=within(120))
            workers = [jobs.pid_of_rank(rank, job.marker) for rank in (0, 1)]
            [agent] = jobs.trainers(job.marker, agent=True)
            os.kill(agent, signal.SIGKILL)
            gone = [_gone(pid, 10) for pid in workers]
            output = job.communicate(timeout=within(300))[0] if all(gone) else ""
        finally:
            jobs.stop(job)   # whatever happened: the workers too
        reference = reference.result()
    return {"gone": gone, "rc": job.returncode, "output": output,
            "records": read_metrics(metrics), "reference": reference}


def test_a_killed_agent_takes_its_workers_and_the_restart_loses_nothing(scenarios):
    out = scenarios["killed agent"].result()
    assert all(out["gone"])   # no orphan trains on
    assert out["rc"] == 0, out["output"][-3000:]
    records = out["records"]
    assert [r["iter"] for r in records] == list(range(1, ITERS + 1))
    assert [r["loss"] for r in records] == out["reference"]


def _holder(program: str, *args: str, timeout_s: float = 60) -> subprocess.Popen:
    """A process running `program` that prints "held" once it holds its lock; killed (never
    left holding the lock for its 600 s) if it does not say so within `timeout_s`."""
    holder = subprocess.Popen([sys.executable, "-c", program, *args], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.append(holder.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not said or said[0].strip() != "held":
        holder.kill()
        _, err = holder.communicate()
        raise AssertionError(f"the holder did not take its lock: {said} {err[-2000:]}")
    return holder


def _second_job(tmp_path: Path) -> dict:
    """A launch on a checkpoint.dir a live process holds: what the lock's own wait saw, the
    launch's exit code and lines, and whether the lock was free once the holder died."""
    directory = tmp_path / "ck"
    holder = _holder(HOLDER, str(directory))
    try:
        held = wait_until_free(directory, patience_s=0.5)
        result = subprocess.run(
            ["bash", str(SCRIPT), str(ROOT / "configs/gpt_tiny.yaml"), "train.iters=2",
             f"checkpoint.dir={directory}"], cwd=tmp_path, capture_output=True, text=True,
            env=_env(PTDP_LOCK_WAIT_S="1", GPUS_PER_NODE="2"), timeout=within(120))
    finally:
        holder.kill()
        holder.wait()
    return {"directory": directory, "holder": holder.pid, "held": held, "result": result,
            "free after": wait_until_free(directory, patience_s=5)}


def test_a_second_job_on_a_checkpoint_dir_in_use_stops_naming_the_holder(scenarios):
    out = scenarios["second job"].result()
    directory, pid, result = out["directory"], out["holder"], out["result"]
    assert out["held"] == [f"rank 3 pid {pid} on {os.uname().nodename}"]
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "is in use by another job" in line]
    assert lines == [f"checkpoint.dir {directory} is in use by another job (waited 1 s): rank 3 "
                     f"pid {pid} on {os.uname().nodename}; stop it, or give this job "
                     f"another checkpoint.dir"]
    assert out["free after"] == []   # the kernel released its lock


METRICS_HOLDER = """
import os, sys, time
from types import SimpleNamespace
os.environ["MASTER_PORT"] = sys.argv[2]   # its job: another rendezvous than the test's
from ptdp.runtime.joblock import hold_outputs
cfg = SimpleNamespace(checkpoint=SimpleNamespace(dir=None),
                      log=SimpleNamespace(metrics_file=sys.argv[1]))
hold_outputs(cfg, 3)
print("held", flush=True)
time.sleep(600)
"""


def _metrics_holder(metrics: Path, port: str) -> subprocess.Popen:
    return _holder(METRICS_HOLDER, str(metrics), port)


def _refusal(tmp_path: Path) -> dict:
    """Two ranks started directly, rank 1's metrics file held by another job."""
    held = tmp_path / "1" / "metrics.jsonl"
    holder = _metrics_holder(held, "1")
    try:   # (no hang: seconds)
        ended = jobs.train_direct([["train.iters=1",
                                    f"log.metrics_file={tmp_path / str(rank) / 'metrics.jsonl'}"]
                                   for rank in (0, 1)], free_port(), timeout_s=within(120))
    finally:
        holder.kill()
        holder.wait()
    return {"held": held, "holder": holder.pid, "ended": ended}


def test_a_refusal_found_by_one_rank_only_ends_every_rank_in_one_line(scenarios):
    """Rank 1 alone finds its output held, as when nodes see a folder differently (here each
    rank is given a metrics file of its own): both ranks exit 2 before any process group, and
    rank 0 prints the refusal, naming rank 1. Rank 1 used to leave without a word, and rank 0
    to wait for it in the process group's rendezvous until the backend's timeout."""
    out = scenarios["refusal"].result()
    held, pid, ended = out["held"], out["holder"], out["ended"]
    said = [err for _, err in ended]
    assert [code for code, _ in ended] == [2, 2], said
    lines = [[line for line in err.splitlines() if line.startswith("ptdp train")] for err in said]
    assert lines == [[f"ptdp train: rank 1 (1 of 2 ranks found it): log.metrics_file {held} is "
                      f"in use by another job: rank 3 pid {pid} on {os.uname().nodename}; "
                      f"stop it, or give this job another log.metrics_file"], []], said


# (Last: it sets MASTER_PORT in this process, which the scenarios' launches above read.)
def test_a_direct_launch_on_a_metrics_file_in_use_is_refused_in_one_line(tmp_path, monkeypatch,
                                                                         capsys):
    """No checkpoint.dir, no launch script: the job's metrics file is locked, and a second job
    (another rendezvous) started directly, as by torchrun, stops before any process group."""
    from ptdp.cli import main
    metrics = tmp_path / "metrics.jsonl"
    holder = _metrics_holder(metrics, "1")
    try:
        monkeypatch.setenv("MASTER_PORT", "2")
        code = main(["train", str(ROOT / "configs/gpt_tiny.yaml"), "train.iters=1",
                     f"log.metrics_file={metrics}"])
        lines = capsys.readouterr().err.splitlines()
        assert code == 2 and lines == [
            f"ptdp train: log.metrics_file {metrics} is in use by another job: rank 3 pid "
            f"{holder.pid} on {os.uname().nodename}; stop it, or give this job another "
            f"log.metrics_file"]
        assert not metrics.exists()   # nothing written
    finally:
        holder.kill()
        holder.wait()
    # The dead job's lock is free: the next job (yet another rendezvous) takes the file over.
    second = _metrics_holder(metrics, "3")
    second.kill()
    second.wait()
    assert sorted(p.name for p in tmp_path.glob(".metrics.jsonl.ptdp-holder-*")) == \
        [f".metrics.jsonl.ptdp-holder-{os.uname().nodename}-{second.pid}"]
