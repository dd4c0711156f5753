"""Two simulated nodes (tools/simcluster.sh: network namespaces, a 200 Mbit/s link between
them), launched the way clusters launch: tools/slurm_pretrain.sh under a stand-in srun, which
runs one tools/pretrain_gpt.sh per node with NNODES, NODE_RANK, MASTER_ADDR and GPUS_PER_NODE
(the same command a job launched by hand runs on each node).

The tiny GPT in (p, t, d) = (2, 2, 1) over 2 nodes x 2 ranks must reproduce one process's
loss sequence; a node that dies must end the other node's ranks with one line naming the
lost ranks, within 60 s. Skipped where namespaces cannot be made (not root, no iproute2).
`srun` starting one task per rank without torchrun needs no namespaces (the last test).
The jobs run at once (fixture `started`), the node-death test's on a cluster of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from tests.deadline import within
from tools.jobs import MARKER, stop

ROOT = Path(__file__).resolve().parents[1]
SIMCLUSTER = ROOT / "tools/simcluster.sh"
NAME = f"ptdpsimt{os.getpid() % 100000}"
# train.timeout_s=15: heartbeats every 0.5 s (not 1 s at 30), so a lost node's ranks are
# found stale, and named, within ~2 s of the failure instead of ~4 s.
LAYOUT = ["parallel.pipeline=2", "parallel.tensor=2", "train.device=cpu", "log.progress=false",
          "log.interval=1", "train.timeout_s=15"]
ITERS = 3


def _cannot_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not (shutil.which("ip") or Path("/usr/sbin/ip").exists()) or not (
            shutil.which("tc") or Path("/usr/sbin/tc").exists()):
        return "needs iproute2 (ip, tc)"
    probe = f"ptdpsimprobe{os.getpid() % 100000}"
    made = subprocess.run(["/usr/sbin/ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["/usr/sbin/ip", "netns", "delete", probe], capture_output=True)
    return None


# The node-death test kills every process of node 1 of its cluster: it gets a cluster of its
# own, so that it runs beside the SLURM test's job (module fixture `started`).
DEATH = f"{NAME}d"


def _sim(*args, check=True, name=NAME, **kwargs):
    env = {**os.environ, "SIMCLUSTER_NAME": name}
    return subprocess.run([str(SIMCLUSTER), *args], env=env, check=check, text=True,
                          capture_output=True, timeout=within(60), **kwargs)


def _job_env(name=NAME, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", SIMCLUSTER_NAME=name,
               PYTHON=sys.executable, **extra)
    return env


def _launch_node(name: str, node: int, overrides: list[str], log: Path,
                 port: int) -> subprocess.Popen:
    """tools/pretrain_gpt.sh on one node of cluster `name`, exactly as on a cluster."""
    return _started([str(SIMCLUSTER), "run", str(node), str(ROOT / "tools/pretrain_gpt.sh"),
                     "configs/gpt_tiny.yaml", *LAYOUT, *overrides], log,
                    _job_env(name, NNODES="2", NODE_RANK=str(node), MASTER_ADDR=f"{name}-n0",
                             MASTER_PORT=str(port), GPUS_PER_NODE="2"))


def _started(command: list[str], log: Path, env: dict) -> subprocess.Popen:
    """`command` in a session of its own with a marker of its own, for tools/jobs.py's `stop`
    to end it and every process it started (torchrun's workers have sessions of their own)."""
    marker = uuid.uuid4().hex
    job = subprocess.Popen(command, cwd=ROOT, env={**env, MARKER: marker}, stdout=log.open("w"),
                           stderr=subprocess.STDOUT, start_new_session=True)
    job.marker = marker
    return job


def _losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def _wait_all(jobs, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for job in jobs:
            job.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for job in jobs:
            stop(job)


def _one_process(overrides: list[str]) -> list[float]:
    from ptdp.config import load_config
    from ptdp.training import Trainer
    cfg = load_config(str(ROOT / "configs/gpt_tiny.yaml"), overrides, world_size=1)
    return [record["loss"] for record in Trainer(cfg).train()]


def _single_process_losses() -> list[float]:
    """The oracle: the same model, data and seed in one process (p = t = d = 1)."""
    from ptdp.runtime.local_ranks import run_on_ranks
    return run_on_ranks(1, _one_process, ["train.device=cpu", "log.progress=false",
                                          f"train.iters={ITERS}"], timeout_s=within(120))[0]


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Every job of the tests below, started at once: the one process, the srun job (no
    namespaces needed) and, where namespaces can be made, the SLURM job and the node-death
    job, each on a simulated cluster of its own (their start-ups, rendezvous and the wait for
    a lost node's heartbeats leave cores idle). Yields (why there are no clusters, or None;
    {name: future of what the job left})."""
    reason, clusters = _cannot_make_namespaces(), []
    futures: dict = {}
    with ThreadPoolExecutor(4) as pool:
        try:
            futures["one process"] = pool.submit(_single_process_losses)
            futures["srun"] = pool.submit(_srun_job, tmp_path_factory.mktemp("srun"))
            if reason is None:
                for name in (NAME, DEATH):
                    _sim("up", "2", "--inter-node-rate", "200mbit", name=name)
                    clusters.append(name)
                futures["slurm"] = pool.submit(_slurm_job, tmp_path_factory.mktemp("slurm"))
                futures["death"] = pool.submit(_death_job, tmp_path_factory.mktemp("death"))
            yield reason, futures
        finally:
            wait(list(futures.values()))
            for name in clusters:
                _sim("down", check=False, name=name)


def _cluster_job(started, name: str):
    reason, futures = started
    if reason:
        pytest.skip(reason)
    return futures[name].result()


def _slurm_job(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho {NAME}-n0\necho {NAME}-n1\n")
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        f'for i in 0 1; do SLURM_NODEID=$i "{SIMCLUSTER}" run $i "$@" & done\n'
        "status=0; for job in $(jobs -p); do wait $job || status=1; done; exit $status\n")
    for shim in bin_dir.iterdir():
        shim.chmod(0o755)
    metrics = tmp_path / "metrics.jsonl"
    env = _job_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242",
                   SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST=f"{NAME}-n[0-1]",
                   SLURM_SUBMIT_DIR=str(ROOT), SLURM_GPUS_ON_NODE="2")
    res = subprocess.run([str(ROOT / "tools/slurm_pretrain.sh"), "configs/gpt_tiny.yaml", *LAYOUT,
                          f"train.iters={ITERS}", f"log.metrics_file={metrics}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=within(180))
    return {"result": res, "losses": _losses(metrics) if res.returncode == 0 else None}


def test_slurm_script_launches_one_node_per_namespace(started):
    """tools/slurm_pretrain.sh with stand-ins for scontrol and srun: srun starts the task on
    every node at once, each inside its namespace, with SLURM_NODEID set; each runs
    tools/pretrain_gpt.sh with NNODES, NODE_RANK, MASTER_ADDR and GPUS_PER_NODE, exactly as a
    node of a job launched by hand does, and the 2 x 2 ranks train like one process."""
    out = _cluster_job(started, "slurm")
    res = out["result"]
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"master {NAME}-n0:24242" in res.stderr
    for node in (0, 1):
        assert f"pretrain_gpt.sh: node {node} of 2, 2 ranks here" in res.stderr
    assert "world size 4" in res.stderr
    assert out["losses"] == pytest.approx(started[1]["one process"].result(), rel=1e-5)


def _death_job(tmp_path: Path) -> dict:
    metrics = tmp_path / "metrics.jsonl"
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    jobs = [_launch_node(DEATH, n, ["train.iters=100000", f"log.metrics_file={metrics}"],
                         logs[n], 29412) for n in (0, 1)]
    try:
        deadline = time.monotonic() + within(150)
        while time.monotonic() < deadline and jobs[0].poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        if jobs[0].poll() is not None:
            return {"running": False, "log": logs[0].read_text()}
        _sim("kill", "1", name=DEATH)
        killed = time.monotonic()
        jobs[0].wait(timeout=within(90))
        elapsed = time.monotonic() - killed
    finally:
        for job in jobs:
            stop(job)
    return {"running": True, "log": logs[0].read_text(), "rc": jobs[0].returncode,
            "elapsed": elapsed}


def test_a_node_that_dies_ends_the_other_with_a_line_naming_its_ranks(started):
    res = _cluster_job(started, "death")
    out = res["log"]
    assert res["running"], out[-3000:]
    ours = [line for line in out.splitlines() if line.startswith("ptdp train: ")]
    assert res["rc"] != 0
    assert len(ours) == 1, out[-3000:]
    assert ours[0].startswith("ptdp train: lost rank(s): rank 2 (p=1, d=0, t=0) (pid ")
    for rank in (2, 3):   # node 1's ranks, named with their host
        assert f"rank {rank} (p=1, " in ours[0]
    assert ours[0].count(f"on {DEATH}-n1; no heartbeat for") == 2
    assert "gloo: " in ours[0] and "Ending the job." in ours[0]
    assert res["elapsed"] < 60, res["elapsed"]


def _srun_job(tmp_path: Path) -> dict:
    metrics = tmp_path / "metrics.jsonl"
    slurm = dict(SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)",
                 SLURM_STEP_NODELIST="localhost", SLURM_JOB_ID=str(os.getpid()))
    logs = [tmp_path / f"task{task}.log" for task in (0, 1)]
    jobs = [_started([sys.executable, "-m", "ptdp", "train", "configs/gpt_tiny.yaml", *LAYOUT[1:],
                      f"train.iters={ITERS}", f"log.metrics_file={metrics}"], log,
                     _job_env(SLURM_PROCID=str(task), SLURM_LOCALID="0", SLURM_NODEID=str(task),
                              **slurm))
            for task, log in zip((0, 1), logs)]
    _wait_all(jobs, timeout_s=within(120))
    codes = [job.returncode for job in jobs]
    return {"codes": codes, "out": [log.read_text() for log in logs],
            "losses": _losses(metrics) if codes == [0, 0] else None}


def test_srun_one_task_per_rank_without_torchrun_forms_the_job(started):
    """`srun --nodes 2 --ntasks-per-node 1 python -m ptdp train ...` (no torchrun, no namespaces
    needed; both "nodes" are this host): each task has only SLURM's variables, the two ranks
    train like one process, and the tensor group that spans the two nodes is warned about once
    (the node size comes from SLURM_TASKS_PER_NODE, as torchrun's LOCAL_WORLD_SIZE)."""
    res = started[1]["srun"].result()
    out = res["out"]
    for code, text in zip(res["codes"], out):
        assert code == 0, text[-3000:]
    assert "(p, t, d) = (1, 2, 1)" in out[0]
    warnings = [line for text in out for line in text.splitlines()
                if line.startswith("ptdp train: warning: ")]
    assert len(warnings) == 1, out
    assert "parallel.tensor=2 does not divide the 1 ranks per node" in warnings[0]
    assert res["losses"] == pytest.approx(started[1]["one process"].result(), rel=1e-5)
