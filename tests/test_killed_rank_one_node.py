"""On one node, a killed rank is named by ptdp's own line: torchrun ends the node's other ranks
with SIGTERM as soon as one dies, before their lost-peer diagnosis (which waits for the dead
rank's heartbeat to go stale: seconds) can speak, so that only torchrun's 40-line report named
it. A rank's SIGTERM handler (ptdp/runtime/watchdog.py `on_terminate`) now names the ranks of
its host whose processes are gone, once; ranks that ended on purpose are not named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

from tests.test_restart import ROOT, _env, _wait_for_iteration
from tests.test_watchdog import _pid_of_rank


def test_a_killed_rank_is_named_once_by_ptdp(tmp_path):
    marker, metrics = uuid.uuid4().hex, tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "ptdp", "train", str(ROOT / "configs/gpt_tiny.yaml"), "parallel.pipeline=2",
           "train.iters=100000", "log.interval=1000", f"log.metrics_file={metrics}",
           "log.progress=false"]
    job = subprocess.Popen(cmd, cwd=tmp_path, env=_env(PTDP_TEST_MARKER=marker),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_iteration(metrics, job, 3)
        killed = _pid_of_rank(1, marker)
        assert killed, "rank 1 not found"
        os.kill(killed, signal.SIGKILL)
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    ours = [line for line in out.splitlines() if line.startswith("ptdp train: ")]
    assert job.returncode != 0
    assert len(ours) == 1, out[-3000:]
    assert ours[0].startswith("ptdp train: lost rank(s): rank 1 (p=1, d=0, t=0) (pid "
                              f"{killed} on "), ours[0]
