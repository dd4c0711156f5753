"""The planner and the distributed optimizer: memory term, time model, search flag, config."""

import pytest
import yaml

from ptdp.config import ModelConfig, load_config
from ptdp.planner.compute import ModelShape
from ptdp.planner.cost_model import Layout, Workload, predict
from ptdp.planner.memory import gpu_memory, optimizer_state_bytes
from tests.planner.conftest import plan, searched

GPT3 = ModelConfig(arch="gpt", num_layers=96, hidden_size=12288, num_heads=96, seq_length=2048,
                   vocab_size=51200)
# GPT-3 on 1024 A100s with t = 4: 32 GB of Adam state per GPU does not fit; 2 GB does.
T4 = dict(pipeline=16, tensor=4, data=16, chunks=6, micro_batch=1, schedule="interleaved",
          recompute="none", scatter_gather=True)


@pytest.fixture(scope="module")
def work():
    return Workload(ModelShape.from_config(GPT3), 1536, "bf16", 8)


def test_optimizer_state_is_divided_by_d():
    assert optimizer_state_bytes(1e9, "bf16") == 12e9
    assert optimizer_state_bytes(1e9, "fp32") == 8e9
    assert optimizer_state_bytes(1e9, "bf16", d=8) == 12e9     # replicated unless sharded
    assert optimizer_state_bytes(1e9, "bf16", d=8, distributed_optimizer=True) == 1.5e9
    kwargs = dict(p=2, t=2, v=1, m=8, b=1, schedule="1f1b", recompute="none", precision="bf16",
                  attention="flash", vocab_padded=51200, reserved_gb=0.0, rank=0, d=4)
    shape = ModelShape.from_config(GPT3)
    whole, sharded = (gpu_memory(shape, **kwargs, distributed_optimizer=z) for z in (False, True))
    assert sharded.optimizer == pytest.approx(whole.optimizer / 4)
    assert (sharded.weights, sharded.gradients, sharded.activations) == (
        whole.weights, whole.gradients, whole.activations)


def test_time_model_splits_the_all_reduce_and_shards_the_step(a100, work):
    whole = predict(a100, work, Layout(**T4))
    sharded = predict(a100, work, Layout(**T4, distributed_optimizer=True))
    assert not whole.fits and sharded.fits
    assert sharded.memory["optimizer"] == pytest.approx(whole.memory["optimizer"] / 16, rel=1e-3)
    assert sharded.time["optimizer"] == pytest.approx(whole.time["optimizer"] / 16)
    # Reduce-scatter of fp32 gradients + all-gather of bf16 weights: 3/4 of the ring
    # all-reduce's bytes (the tied embedding's bucket stays all-reduced: a little more).
    ratio = sharded.time["dp_allreduce"] / whole.time["dp_allreduce"]
    assert 0.75 < ratio < 0.8
    assert "distopt" in Layout(**T4, distributed_optimizer=True).describe()


def test_search_considers_it_only_when_asked(a100, work):
    plain = searched(a100, work, 1024)
    assert not any(p.layout.distributed_optimizer for p in plain.ranked)
    allowed = searched(a100, work, 1024, distributed_optimizer=True)
    assert allowed.best.layout.distributed_optimizer
    assert allowed.best.step_time_s < plain.best.step_time_s
    assert not any(p.layout.distributed_optimizer and (p.layout.data == 1 or p.layout.schedule == "2bw")
                   for p in allowed.ranked)


@pytest.mark.parametrize("flag", [[], ["--allow-distributed-optimizer"], ["--fix", "distopt=true"]])
def test_written_config_sets_the_key_the_trainer_reads(tmp_path, capsys, flag):
    model = tmp_path / "model.yaml"
    model.write_text(yaml.safe_dump({"model": {k: getattr(GPT3, k) for k in (
        "arch", "num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size")}}))
    out = tmp_path / "plan.yaml"
    assert plan([str(model), "--hardware", "a100-80gb", "--nodes", "128", "--global-batch-size",
                 "1536", "--write-config", str(out)] + flag) == 0
    table = capsys.readouterr().out
    assert "distopt" in table.splitlines()[3]     # the table's header has the column
    cfg = load_config(out, world_size=1024)
    assert cfg.train.distributed_optimizer is bool(flag)


def test_ptdp_check_predicts_the_sharded_state():
    from ptdp.job_summary import memory_per_stage, summary
    base = ["parallel.pipeline=2", "parallel.data=4", "train.precision=bf16"]
    whole, sharded = (load_config(None, base + extra, world_size=8)
                      for extra in ([], ["train.distributed_optimizer=true"]))
    for a, b in zip(memory_per_stage(whole), memory_per_stage(sharded)):
        assert b.optimizer == pytest.approx(a.optimizer / 4) and b.weights == a.weights
    assert any("optimizer state sharded over d = 4" in line for line in summary(sharded, 8))
    assert not any("sharded" in line for line in summary(whole, 8))
