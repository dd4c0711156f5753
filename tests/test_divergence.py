"""No silent divergence: a non-finite loss or gradient stops the run at once, naming the
iteration, the ranks' coordinates and the first parameter whose gradient is not finite; fp16
stops after train.fp16_max_skips overflows in a row at the minimum scale; no checkpoint is
ever written from non-finite weights."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import TINY

ROOT = Path(__file__).resolve().parents[1]
EXPLODE = ["train.lr=1e6", "train.lr_decay_style=constant", "train.clip_grad=0", "train.iters=20"]


def _train_until_it_stops(overrides):
    from ptdp.config import load_config
    from ptdp.training import DivergenceError, Trainer

    trainer = Trainer(load_config(None, TINY + overrides, world_size=dist.get_world_size()))
    try:
        trainer.train()
    except DivergenceError as err:
        return {"error": str(err), "iteration": trainer.iteration,
                "skips": trainer.state.loss_scaler.skips_at_min_scale}
    return {"error": None, "iteration": trainer.iteration}


def _checkpoints(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("iter_*"))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_non_finite_loss_stops_the_run_before_any_bad_checkpoint(tmp_path, precision):
    ckpt = tmp_path / "ckpt"
    out = run_on_ranks(2, _train_until_it_stops,
                       ["parallel.pipeline=2", f"train.precision={precision}", *EXPLODE,
                        f"checkpoint.dir={ckpt}", "checkpoint.save_interval=1",
                        f"log.metrics_file={tmp_path}/m.jsonl"], timeout_s=within(120))
    errors = {r["error"] for r in out}
    assert len(errors) == 1 and None not in errors, errors     # every rank stops together
    error = errors.pop()
    stopped = out[0]["iteration"] + 1                           # the iteration that diverged
    assert error.startswith(f"iteration {stopped}: loss "), error
    assert "first non-finite gradient: " in error and "(p=" in error and "no checkpoint" in error
    # Checkpoints exist for the finite iterations before, none for the diverged one.
    assert _checkpoints(ckpt) == [f"iter_{i:07d}" for i in range(1, stopped)]
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "m.jsonl")]
    assert len(losses) == stopped - 1 and all(math.isfinite(x) for x in losses)


def test_fp16_gives_up_after_max_skips_at_the_minimum_scale():
    out = run_on_ranks(2, _train_until_it_stops,
                       ["parallel.tensor=2", "train.precision=fp16", "train.initial_loss_scale=4",
                        "train.fp16_max_skips=3", *EXPLODE], timeout_s=within(120))
    for rank in out:
        assert "fp16 overflowed on 3 consecutive steps at the minimum loss scale 1" in rank["error"]
        assert rank["skips"] == 3 and rank["iteration"] < 20


def test_ptdp_train_prints_one_line_and_exits_3(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "ptdp", "train", str(ROOT / "configs/gpt_tiny.yaml"), *TINY,
                          "parallel.pipeline=2", *EXPLODE, "log.progress=false"],
                         cwd=tmp_path, env=env, text=True, capture_output=True, timeout=within(180))
    text = res.stdout + res.stderr
    ours = [line for line in text.splitlines() if line.startswith("ptdp train: iteration")]
    assert res.returncode != 0 and len(ours) == 1, text
    assert "first non-finite gradient" in ours[0], text
    assert not re.search(r'File ".*/ptdp/', text), text      # torchrun's report is the only traceback
