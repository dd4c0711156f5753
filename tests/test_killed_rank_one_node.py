"""On one node, a killed rank is named by ptdp's own line: torchrun ends the node's other ranks
with SIGTERM as soon as one dies, before their lost-peer diagnosis (which waits for the dead
rank's heartbeat to go stale: seconds) can speak, so that only torchrun's 40-line report named
it. A rank's SIGTERM handler (ptdp/runtime/watchdog.py `on_terminate`) now names the ranks of
its host whose processes are gone, once; ranks that ended on purpose are not named."""

from __future__ import annotations

import os
import signal
import sys

from tests.deadline import within
from tools import jobs
from tools.jobs import ROOT


def test_a_killed_rank_is_named_once_by_ptdp(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "ptdp", "train", str(ROOT / "configs/gpt_tiny.yaml"), "parallel.pipeline=2",
           "train.iters=100000", "log.interval=1000", f"log.metrics_file={metrics}",
           "log.progress=false"]
    job = jobs.start(cmd, tmp_path)
    try:
        jobs.wait_for_iteration(metrics, job, 3, timeout=within(120))
        killed = jobs.pid_of_rank(1, job.marker)
        os.kill(killed, signal.SIGKILL)
        out, _ = job.communicate(timeout=within(120))
    finally:
        jobs.stop(job)   # the other worker too, whatever happened
    ours = [line for line in out.splitlines() if line.startswith("ptdp train: ")]
    assert job.returncode != 0
    assert len(ours) == 1, out[-3000:]
    assert ours[0].startswith("ptdp train: lost rank(s): rank 1 (p=1, d=0, t=0) (pid "
                              f"{killed} on "), ours[0]
