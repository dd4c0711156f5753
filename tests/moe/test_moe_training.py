"""An MoE model's run: the load metrics, the selection biases moving and resuming from a
checkpoint in another layout, a checkpoint of another E refused (ptdp/training/experts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ptdp.runtime.local_ranks import run_on_ranks
from tests.equivalence import MOE, TINY

RUN = TINY + MOE + ["train.iters=4", "log.interval=1"]


def _trainer(overrides: list[str]):
    from ptdp.config import load_config
    from ptdp.training import Trainer
    return Trainer(load_config(None, RUN + overrides, world_size=dist.get_world_size()))


def _run(overrides: list[str]) -> dict:
    trainer = _trainer(overrides)
    history = trainer.train()
    return {"losses": [r["loss"] for r in history], "records": history,
            "biases": trainer.state.experts.biases().cpu(),
            "total": trainer.state.experts.total}


def save_job(root: str) -> dict:
    """d=2 saves at iteration 2 and finishes; p=2 resumes from iteration 2."""
    ckpt = [f"checkpoint.dir={root}/ckpt", "checkpoint.save_interval=2"]
    saved = _run(["parallel.data=2", *ckpt])
    resumed = _run(["parallel.pipeline=2", f"checkpoint.load={root}/ckpt/iter_0000002"])
    from ptdp.checkpoint.layout import CheckpointError
    try:
        _trainer(["parallel.data=2", "model.num_experts=2",
                  f"checkpoint.load={root}/ckpt/iter_0000002"])
        refused = None
    except CheckpointError as err:
        refused = str(err)
    return {"saved": saved, "resumed": resumed, "refused": refused}


def expert_job(root: str) -> dict:
    """e=2 (d=4) saves at iteration 2 and finishes; e=4 (c=2 x d=2) resumes from it."""
    ckpt = [f"checkpoint.dir={root}/ckpt", "checkpoint.save_interval=2"]
    saved = _run(["parallel.data=4", "parallel.expert=2", *ckpt])
    resumed = _run(["parallel.data=2", "parallel.context=2", "parallel.expert=4",
                    f"checkpoint.load={root}/ckpt/iter_0000002"])
    files = sorted(p.name for p in Path(f"{root}/ckpt/iter_0000002").glob("model_*"))
    return {"saved": saved, "resumed": resumed, "files": files}


@pytest.fixture(scope="module")
def expert_checkpoint(tmp_path_factory):
    return run_on_ranks(4, expert_job, str(tmp_path_factory.mktemp("moe_ep")), timeout_s=400)[0]


def test_a_checkpoint_saved_at_e2_resumes_at_e4(expert_checkpoint):
    saved, resumed = expert_checkpoint["saved"], expert_checkpoint["resumed"]
    assert expert_checkpoint["files"] == ["model_pp000_tp000.pt", "model_pp000_tp000_ep001.pt"]
    assert resumed["losses"] == pytest.approx(saved["losses"][2:], rel=1e-5, abs=0)
    torch.testing.assert_close(resumed["biases"], saved["biases"], rtol=0, atol=1e-7)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return run_on_ranks(2, save_job, str(root), timeout_s=400)[0]


def test_records_carry_the_aux_losses_and_the_load(job):
    record = job["saved"]["records"][0]
    assert {"aux/moe_aux_loss", "aux/moe_z_loss"} <= set(record)
    assert record["moe/load_max_over_mean"] >= 1.0
    # 7 MoE layers, every token's k = 2 choices counted once per iteration: 4 iterations of 8
    # sequences of 16 tokens
    assert job["saved"]["total"].sum(1).tolist() == [4 * 8 * 16 * 2] * 7


def test_biases_move_and_resume_in_another_layout(job):
    saved, resumed = job["saved"], job["resumed"]
    assert saved["biases"].abs().sum() > 0
    assert resumed["losses"] == pytest.approx(saved["losses"][2:], rel=1e-5, abs=0)
    torch.testing.assert_close(resumed["biases"], saved["biases"], rtol=0, atol=1e-7)


def test_a_checkpoint_of_another_expert_count_is_refused(job):
    assert job["refused"] is not None
    assert "model.num_experts=4 in the checkpoint but 2 in the config" in job["refused"]
