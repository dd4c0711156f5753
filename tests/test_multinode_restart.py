"""A multi-node restart rejoins: two launchers (tools/pretrain_gpt.sh with NNODES=2, one rank
each) on one machine, MAX_RESTARTS=1; node 1's rank is killed at iteration 12. Both launchers
restart into a fresh rendezvous (MASTER_PORT + attempt), meet, resume from the checkpoint of
iteration 10 and end with exit 0 and the uninterrupted run's losses. Before, node 1's quick
restart joined node 0's old rendezvous store and node 0's new agent waited 900 s for it."""

from __future__ import annotations

import os
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor

from ptdp.metrics.log import read_metrics
from ptdp.runtime.local_ranks import free_port
from tests.deadline import within
from tests.test_joblock import ITERS, JOB, uninterrupted_losses
from tools import jobs
from tools.jobs import ROOT, SCRIPT


def test_both_nodes_restart_into_a_fresh_rendezvous(tmp_path):
    metrics, marker, port = tmp_path / "metrics.jsonl", uuid.uuid4().hex, free_port()
    overrides = JOB + [f"checkpoint.dir={tmp_path / 'ck'}", f"log.metrics_file={metrics}"]
    nodes = [jobs.start(["bash", str(SCRIPT), str(ROOT / "configs/gpt_tiny.yaml"), *overrides],
                        tmp_path, MAX_RESTARTS="1", PTDP_TEST_MARKER=marker, NNODES="2",
                        NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        GPUS_PER_NODE="1") for node in (0, 1)]
    with ThreadPoolExecutor(1) as pool:   # the uninterrupted run, beside the job
        reference = pool.submit(uninterrupted_losses)
        try:
            jobs.wait_for_iteration(metrics, nodes[0], 12, timeout=within(120))
            os.kill(jobs.pid_of_rank(1, marker), signal.SIGKILL)
            outputs = [node.communicate(timeout=within(400))[0] for node in nodes]
        finally:
            for node in nodes:   # the launchers, their torchruns, every worker (own sessions)
                jobs.stop(node)
        reference = reference.result()
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    for output in outputs:
        assert f"attempt 1 meets at 127.0.0.1:{port + 1}" in output
    records = read_metrics(metrics)
    assert [r["iter"] for r in records] == list(range(1, ITERS + 1))
    assert [r["loss"] for r in records] == reference
