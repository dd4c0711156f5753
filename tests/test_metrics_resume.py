"""Metrics continue where the checkpoint is: every (re)start cuts the metrics file back to the
iteration it starts from (0 without a checkpoint), so each iteration appears once.

The case that duplicated iterations before: a job crashes at iteration 3 of a run that saves
every 10, so its restart finds no checkpoint and starts afresh; it used to append 1, 2, ...
after the 1, 2 already there.
"""

from __future__ import annotations

import json

import torch.distributed as dist

from ptdp.metrics.log import read_metrics
from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import TINY


class Crash(RuntimeError):
    pass


def _crash_then_restart(directory: str, metrics: str) -> dict:
    from ptdp.config import load_config
    from ptdp.training import Trainer
    overrides = TINY + ["parallel.pipeline=2", "train.iters=4", "checkpoint.save_interval=10",
                        f"checkpoint.dir={directory}", "checkpoint.load=auto",
                        f"log.metrics_file={metrics}", "log.progress=false"]
    cfg = load_config(None, overrides, world_size=dist.get_world_size())
    crashing = Trainer(cfg)
    step = crashing.train_step

    def dying_step(iteration, *args, **kwargs):
        if iteration == 2:   # the third iteration: two records written, no checkpoint yet
            raise Crash("simulated crash in iteration 3")
        return step(iteration, *args, **kwargs)
    crashing.train_step = dying_step
    try:
        crashing.train()
    except Crash:
        pass
    written_before = [r["iter"] for r in read_metrics(metrics)] if dist.get_rank() == 0 else None
    losses = [r["loss"] for r in Trainer(cfg).train()]
    return {"before": written_before, "losses": losses}


def test_a_restart_without_a_checkpoint_starts_the_metrics_afresh(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    out = run_on_ranks(2, _crash_then_restart, str(tmp_path / "ck"), str(metrics),
                       timeout_s=within(300))[0]
    assert out["before"] == [1, 2]
    records = read_metrics(metrics)
    assert [r["iter"] for r in records] == [1, 2, 3, 4]
    assert [r["loss"] for r in records] == out["losses"]


def test_the_file_is_cut_back_to_the_first_iteration(tmp_path):
    from ptdp.config import load_config
    from ptdp.metrics.log import MetricsLog
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"iter": i, "loss": 1.0}) + "\n" for i in (1, 2, 3))
                       + '{"iter": 4, "lo')   # and a torn last line
    cfg = load_config(None, [f"log.metrics_file={metrics}", "log.progress=false"])
    MetricsLog(cfg, is_writer=True, first_iteration=2).close()
    assert [r["iter"] for r in read_metrics(metrics)] == [1, 2]
    MetricsLog(cfg, is_writer=True).close()   # a fresh start
    assert metrics.read_text() == ""
