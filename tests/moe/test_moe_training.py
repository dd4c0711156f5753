"""An MoE model's run: the load metrics, the selection biases moving and resuming from a
checkpoint in another layout, a checkpoint of another E refused (ptdp/training/experts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import MOE, TINY

RUN = TINY + MOE + ["train.iters=4", "log.interval=1"]


def _trainer(overrides: list[str]):
    from ptdp.config import load_config
    from ptdp.training import Trainer
    return Trainer(load_config(None, RUN + overrides, world_size=dist.get_world_size()))


PROBE = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(3))


def _forward_choices(chunk, biases: bool = True) -> dict:
    """A whole model's (p = 1) final hidden states on PROBE and every router's expert choices,
    in eval mode; `biases=False`: with its selection biases set to 0."""
    from ptdp.models.moe import routers_by_layer
    routers = routers_by_layer(chunk)
    saved = {layer: router.expert_bias for layer, router in routers.items()}
    choices = {}
    hooks = [router.register_forward_hook(
        lambda module, inputs, out, layer=layer: choices.__setitem__(layer, out[0]))
        for layer, router in routers.items()]
    if not biases:
        for router in routers.values():
            router.expert_bias = torch.zeros_like(router.expert_bias)
    chunk.eval()
    try:
        with torch.no_grad():
            hidden = chunk.final_ln(chunk.stack(chunk.embedding(PROBE, None), None))
    finally:
        for hook in hooks:
            hook.remove()
        for layer, router in routers.items():
            router.expert_bias = saved[layer]
    return {"hidden": hidden, "choices": choices}


def _run(overrides: list[str], probe: bool = False) -> dict:
    trainer = _trainer(overrides)
    history = trainer.train()
    return {"losses": [r["loss"] for r in history], "records": history,
            "biases": trainer.state.experts.biases().cpu(),
            "total": trainer.state.experts.total,
            "probe": _forward_choices(trainer.state.chunks[0]) if probe else None}


def save_job(root: str) -> dict:
    """d=2 saves at iteration 2 and finishes; p=2 resumes from iteration 2."""
    ckpt = [f"checkpoint.dir={root}/ckpt", "checkpoint.save_interval=2"]
    saved = _run(["parallel.data=2", *ckpt], probe=True)
    resumed = _run(["parallel.pipeline=2", f"checkpoint.load={root}/ckpt/iter_0000002"])
    from ptdp.checkpoint.layout import CheckpointError
    try:
        _trainer(["parallel.data=2", "model.num_experts=2",
                  f"checkpoint.load={root}/ckpt/iter_0000002"])
        refused = None
    except CheckpointError as err:
        refused = str(err)
    return {"saved": saved, "resumed": resumed, "refused": refused, "root": root}


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
    return run_on_ranks(4, expert_job, str(tmp_path_factory.mktemp("moe_ep")),
                        timeout_s=within(400))[0]


def test_a_checkpoint_saved_at_e2_resumes_at_e4(expert_checkpoint):
    saved, resumed = expert_checkpoint["saved"], expert_checkpoint["resumed"]
    assert expert_checkpoint["files"] == ["model_pp000_tp000.pt", "model_pp000_tp000_ep001.pt"]
    assert resumed["losses"] == pytest.approx(saved["losses"][2:], rel=1e-5, abs=0)
    torch.testing.assert_close(resumed["biases"], saved["biases"], rtol=0, atol=1e-7)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return run_on_ranks(2, save_job, str(root), timeout_s=within(400))[0]


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


def test_generation_picks_experts_with_the_trained_biases(job):
    """ptdp generate's model (LocalModel.from_checkpoint) loads the selection biases: on the
    same tokens its routers choose what the trained model's do, and its hidden states are the
    trained model's; without the biases the choices differ (so the biases matter here)."""
    from ptdp.inference.local_model import LocalModel
    model = LocalModel.from_checkpoint(f"{job['root']}/ckpt/iter_0000004")
    trained, ours = job["saved"]["probe"], _forward_choices(model.chunk)
    assert ours["choices"].keys() == trained["choices"].keys()
    for layer, chosen in trained["choices"].items():
        assert ours["choices"][layer].equal(chosen), f"layer {layer}"
    assert ours["hidden"].equal(trained["hidden"])
    unbiased = _forward_choices(model.chunk, biases=False)["choices"]
    assert any(not unbiased[layer].equal(chosen) for layer, chosen in trained["choices"].items())
