"""Megatron's --no-load-optim, --no-load-rng, --finetune and --grad-reduce-in-bf16 as
checkpoint.load_optimizer, load_rng, finetune and train.grad_reduce_dtype (issue 33 item 6):
each key really does what it says, on two data-parallel ranks.

The job saves a checkpoint at iteration 2 of the same layout (so the random streams load),
then loads it four ways, and trains with the gradients reduced in fp32 and in bf16 while
recording what the data-parallel reduction hands its collectives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ptdp.checkpoint.load import PROGRESS, withheld_parts
from ptdp.config import load_config
from ptdp.config.schema import CheckpointConfig, ConfigError
from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import TINY

SMALL = TINY + ["model.num_layers=2", "parallel.data=2", "model.dropout=0.1"]


def _trainer(overrides: list[str]):
    from ptdp.training import Trainer
    return Trainer(load_config(None, SMALL + overrides, world_size=dist.get_world_size()))


def _summary(trainer) -> dict:
    return {"iteration": trainer.iteration,
            "optimizer_states": len(trainer.state.optimizer.state),
            "weights": trainer.full_state(),
            "rng": trainer.state.rng.state_dict()}


class _Recorder:
    """Stands in for torch.distributed and the reduce-scatter inside ptdp/optim/grads.py:
    records the dtype and bytes of every tensor the data-parallel reduction sends."""

    def __init__(self, real, reduce_scatter):
        self.real, self.reduce_scatter, self.sent = real, reduce_scatter, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def all_reduce(self, tensor, **kw):
        if tensor.dtype == torch.float64:   # the gradient norm's sum of squares, not a bucket
            return self.real.all_reduce(tensor, **kw)
        self.sent.append((str(tensor.dtype), tensor.numel() * tensor.element_size()))
        return self.real.all_reduce(tensor, **kw)

    def reduce_scatter_single(self, output, tensor, **kw):
        self.sent.append((str(tensor.dtype), tensor.numel() * tensor.element_size()))
        return self.reduce_scatter(output, tensor, **kw)


def _reduced(overrides: list[str]) -> tuple[list, list]:
    """(losses, what the reduction sent) of 2 iterations."""
    import ptdp.optim.grads as grads
    recorder = grads.dist = _Recorder(grads.dist, grads.reduce_scatter_single)
    grads.reduce_scatter_single = recorder.reduce_scatter_single
    try:
        losses = [r["loss"] for r in _trainer(["train.iters=2"] + overrides).train()]
    finally:
        grads.dist, grads.reduce_scatter_single = recorder.real, recorder.reduce_scatter
    return losses, recorder.sent


def job(root: str) -> dict:
    root = Path(root)
    saved = _trainer(["train.iters=2", f"checkpoint.dir={root}/a"])
    saved.train()
    named = f"checkpoint.load={root}/a/iter_0000002"
    out = {"saved": _summary(saved), # a run whose seed is the one a resume at iteration 2 without streams takes
           # (ptdp/training/state.py StreamsState: train.seed 7 + 1,000,003 x 2)
           "reseeded": _summary(_trainer(["train.iters=4", "train.seed=2000013"]))}
    for name, extra in (("whole", []), ("no_optimizer", ["checkpoint.load_optimizer=false"]),
                        ("no_rng", ["checkpoint.load_rng=false"]),
                        ("finetune", ["checkpoint.finetune=true", f"checkpoint.dir={root}/b"])):
        out[name] = _summary(_trainer(["train.iters=4", named] + extra))
    for dtype in ("fp32", "bf16"):
        for distopt in ("false", "true"):
            out[f"{dtype} {distopt}"] = _reduced([f"train.grad_reduce_dtype={dtype}",
                                                  f"train.distributed_optimizer={distopt}",
                                                  "model.dropout=0.0"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_on_ranks(2, job, str(tmp_path_factory.mktemp("load_options")),
                        timeout_s=within(240))[0]


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_whole_load_restores_iteration_optimizer_and_streams(runs):
    whole, saved = runs["whole"], runs["saved"]
    assert whole["iteration"] == 2 and whole["optimizer_states"] == saved["optimizer_states"] > 0
    assert _same_weights(whole["weights"], saved["weights"])
    assert torch.equal(whole["rng"]["cpu"], saved["rng"]["cpu"])


def test_load_optimizer_false_starts_a_fresh_optimizer_at_the_saved_iteration(runs):
    no_opt = runs["no_optimizer"]
    assert no_opt["iteration"] == 2 and no_opt["optimizer_states"] == 0
    assert _same_weights(no_opt["weights"], runs["saved"]["weights"])
    assert torch.equal(no_opt["rng"]["cpu"], runs["saved"]["rng"]["cpu"])


def test_load_rng_false_leaves_the_saved_streams(runs):
    """...and reseeds them from the seed and the iteration: as a fresh run of that seed."""
    no_rng = runs["no_rng"]
    assert no_rng["iteration"] == 2 and no_rng["optimizer_states"] > 0
    assert not torch.equal(no_rng["rng"]["cpu"], runs["saved"]["rng"]["cpu"])
    for stream in ("cpu", "tensor_parallel"):
        assert torch.equal(no_rng["rng"][stream], runs["reseeded"]["rng"][stream]), stream


def test_finetune_loads_the_weights_only_and_starts_at_iteration_zero(runs):
    tuned = runs["finetune"]
    assert tuned["iteration"] == 0 and tuned["optimizer_states"] == 0
    assert _same_weights(tuned["weights"], runs["saved"]["weights"])


def test_bf16_reduction_sends_half_the_bytes_and_stays_close(runs):
    for distopt in ("false", "true"):
        fp32_losses, fp32_sent = runs[f"fp32 {distopt}"]
        bf16_losses, bf16_sent = runs[f"bf16 {distopt}"]
        assert fp32_sent and {dtype for dtype, _ in fp32_sent} == {"torch.float32"}
        assert {dtype for dtype, _ in bf16_sent} == {"torch.bfloat16"}
        assert sum(n for _, n in bf16_sent) * 2 == sum(n for _, n in fp32_sent)
        assert bf16_losses[0] == fp32_losses[0]   # the first loss precedes any reduction
        assert bf16_losses[1] == pytest.approx(fp32_losses[1], rel=1e-2)


def test_the_options_never_apply_to_the_jobs_own_checkpoints():
    ck = CheckpointConfig(dir="/run", load="/base/iter_0000100", load_optimizer=False,
                          load_rng=False)
    keys = [PROGRESS, "weights", "optimizer", "loss_scaler", "rng", "moe"]
    assert withheld_parts(ck, "/base/iter_0000100", keys) == {"optimizer", "loss_scaler", "rng"}
    assert withheld_parts(ck, "/run/iter_0000150", keys) == set()   # a restart's own newest
    ck.finetune = True
    assert withheld_parts(ck, "/base/iter_0000100", keys) == {PROGRESS, "optimizer",
                                                               "loss_scaler", "rng"}


@pytest.mark.parametrize("overrides, line", [
    (["checkpoint.finetune=true"], "checkpoint.finetune=true acts on the checkpoint"),
    (["checkpoint.load_rng=false", "checkpoint.dir=/x", "checkpoint.load=auto"],
     "checkpoint.load_rng=false acts on the checkpoint checkpoint.load names"),
    (["checkpoint.finetune=true", "checkpoint.dir=/x", "checkpoint.load=/x/iter_0000002"],
     "save the fine-tuning run to another checkpoint.dir"),
    (["log.wandb_name=run"], "log.wandb_name names a run of log.wandb_project"),
    (["train.grad_reduce_dtype=fp16"], "train.grad_reduce_dtype: 'fp16' is not one of"),
])
def test_load_options_refused_in_one_line(overrides, line):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, world_size=1)
    assert len(err.value.errors) == 1 and line in err.value.errors[0]


def test_a_null_grad_reduce_dtype_is_the_older_spelling_of_fp32():
    """train.grad_reduce_dtype: null, as older configs spelled the default, is still accepted
    and reduces every bucket in fp32, as `fp32` (the default now) does."""
    from ptdp.config.schema import TrainConfig
    from ptdp.optim.grads import DataParallelGradients

    class Grid:   # two data-parallel ranks
        def size(self, *axes):
            return 2

        def group(self, *axes):
            return None

    assert TrainConfig().grad_reduce_dtype == "fp32"
    assert load_config(None, SMALL + ["train.grad_reduce_dtype=null"],
                       world_size=2).train.grad_reduce_dtype is None
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)]
    wires = {spelling: [b.wire_dtype for b in DataParallelGradients(
        params, Grid(), 1, bucket_mb=1e-4, reduce_dtype=spelling).buckets]
        for spelling in (None, "fp32", "bf16")}
    assert wires[None] and wires[None] == wires["fp32"] == [torch.float32] * len(wires[None])
    assert wires["bf16"] == [torch.bfloat16] * len(wires[None])
