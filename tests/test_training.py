"""The training loop as a user sees it: mixed precision, fp16 overflow handling, metrics."""

import json
from collections import Counter

import pytest
import torch.distributed as dist

from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import TINY, reference

REQUIRED_METRICS = {"iter", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s",
                    "tflops_per_gpu", "mfu", "loss_scale", "skipped", "mem_gb"}


def run_jobs(metrics_dir: str) -> dict:
    from ptdp.config import load_config
    from ptdp.training import Trainer

    def trainer(*overrides):
        return Trainer(load_config(None, TINY + list(overrides), world_size=dist.get_world_size()))

    out = {}
    bf16 = trainer("parallel.pipeline=2", "parallel.tensor=2", "train.precision=bf16")
    out["bf16"] = [bf16.train_step(it).loss for it in range(3)]
    out["bf16_param_dtype"] = str(bf16.state.params[0].dtype)
    out["bf16_master_dtype"] = str(bf16.state.master_params[0].dtype)

    overflow = trainer("parallel.tensor=4", "train.precision=fp16", "train.initial_loss_scale=1e12")
    before = overflow.full_state()["layers.0.mlp.fc1.weight"]
    steps = [overflow.train_step(it) for it in range(3)]
    out["overflow_skipped"] = [s.skipped for s in steps]
    out["overflow_scales"] = overflow.state.loss_scaler.scale
    out["overflow_unchanged"] = bool((overflow.full_state()["layers.0.mlp.fc1.weight"] == before).all())

    fp16 = trainer("parallel.pipeline=2", "parallel.data=2", "train.precision=fp16",
                   "train.initial_loss_scale=4096")
    out["fp16"] = [fp16.train_step(it).loss for it in range(3)]

    buckets = trainer("parallel.pipeline=2", "parallel.data=2", "train.grad_bucket_mb=0.02")
    buckets.step.forward_backward(0)
    out["buckets"] = len(buckets.state.dp_grads.buckets)
    out["buckets_launched_in_backward"] = buckets.state.dp_grads.launched_during_backward

    for mode in ("none", "full", "selective"):  # dropout on: recomputation must replay both streams
        run = trainer("parallel.tensor=2", "parallel.data=2", "model.dropout=0.1",
                      f"train.recompute={mode}", "train.recompute_num_layers=3")
        step = run.step.forward_backward(0)
        run.step.reduce_gradients()
        out[f"dropout_{mode}"] = (step.loss, run.full_state(grads=True))
    # every other module (the default above: layernorm, activation), tensor-parallel dropout on
    run = trainer("parallel.tensor=2", "parallel.data=2", "model.dropout=0.1",
                  "train.recompute=selective", "train.recompute_modules=[core_attn,layernorm,mlp]")
    step = run.step.forward_backward(0)
    run.step.reduce_gradients()
    out["dropout_modules"] = (step.loss, run.full_state(grads=True))

    path = f"{metrics_dir}/metrics.jsonl"
    logged = trainer("parallel.pipeline=2", "parallel.tensor=2", "model.arch=bert", "train.iters=4",
                     "train.eval_interval=2", "train.eval_iters=1", f"log.metrics_file={path}",
                     f"log.trace_file={metrics_dir}/trace.json")
    out["history"] = logged.train()
    return out


@pytest.fixture(scope="module")
def metrics_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("metrics")


@pytest.fixture(scope="module")
def jobs(metrics_dir):
    return run_on_ranks(4, run_jobs, str(metrics_dir), timeout_s=within(240))[0]


def test_bf16_trains_with_fp32_master_weights_close_to_fp32(jobs):
    assert jobs["bf16_param_dtype"] == "torch.bfloat16"
    assert jobs["bf16_master_dtype"] == "torch.float32"
    for got, want in zip(jobs["bf16"], reference("gpt")["losses"]):
        assert abs(got - want) < 0.02 * want


def test_fp16_with_loss_scaling_is_close_to_fp32(jobs):
    for got, want in zip(jobs["fp16"], reference("gpt")["losses"]):
        assert abs(got - want) < 0.01 * want


def test_fp16_overflow_skips_steps_and_halves_the_scale(jobs):
    assert jobs["overflow_skipped"] == [True, True, True]
    assert jobs["overflow_scales"] == 1e12 / 8
    assert jobs["overflow_unchanged"]


def test_metrics_file_has_one_record_per_iteration(jobs, metrics_dir):
    from ptdp.metrics.log import read_metrics
    history = read_metrics(metrics_dir / "metrics.jsonl")
    assert history == json.loads(json.dumps(jobs["history"]))  # written once, by rank 0 only
    assert [r["iter"] for r in history] == [1, 2, 3, 4]
    for record in history:
        assert REQUIRED_METRICS <= record.keys()
        assert {"lm_loss", "sop_loss"} <= record.keys()  # BERT
        assert abs(record["lm_loss"] + record["sop_loss"] - record["loss"]) < 1e-5
        assert record["tflops_per_gpu"] > 0 and record["mfu"] is None  # CPU: no known peak
    assert "valid_loss" in history[1] and "valid_loss" in history[3]
    assert "valid_loss" not in history[0]


def test_data_parallel_buckets_are_launched_during_backward(jobs):
    """Every bucket's all-reduce starts from a gradient hook, before backward has finished."""
    assert jobs["buckets"] > 3
    assert jobs["buckets_launched_in_backward"] == jobs["buckets"]


@pytest.mark.parametrize("mode", ["full", "selective", "modules"])
def test_recomputation_replays_dropout_exactly(jobs, mode):
    from tests.equivalence import relative_error
    loss, grads = jobs[f"dropout_{mode}"]
    ref_loss, ref_grads = jobs["dropout_none"]
    assert loss == ref_loss
    for name, ref in ref_grads.items():
        assert relative_error(grads[name], ref) < 1e-6, name


def test_trace_file_has_every_rank_and_action(jobs, metrics_dir):
    """Iterations 2-4 of a (p, t) = (2, 2) BERT run with m = 4: per iteration each rank runs
    4 F and 4 B (stage 1 also its last backward's Wg: the cooldown sends the input gradient
    first), waits for 4 received tensors (activations on stage 1, gradients on stage 0),
    reduces twice (data-parallel, then embedding + norm) and steps the optimizer once."""
    events = json.loads((metrics_dir / "trace.json").read_text())["traceEvents"]
    actions = [e for e in events if e["ph"] == "X"]
    assert sorted({e["pid"] for e in actions}) == [0, 1, 2, 3]
    for rank in range(4):
        mine = [e for e in actions if e["pid"] == rank]
        counts = Counter(e["cat"] for e in mine)
        assert counts == {"forward": 12, "backward": 12 if rank < 2 else 15, "wait": 12,
                          "reduce": 6, "optimizer": 3}, rank
        assert sum(e["name"].startswith("Wg3@s1") for e in mine) == (0 if rank < 2 else 3)
        waited = "grad" if rank < 2 else "act"
        assert all(e["name"].startswith(f"wait {waited}") for e in mine if e["cat"] == "wait")
        assert {e["args"]["iteration"] for e in mine} == {2, 3, 4}
        assert all(e["dur"] > 0 for e in mine)
