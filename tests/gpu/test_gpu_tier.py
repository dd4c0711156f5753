"""The GPU tier: what only a GPU can show (CUDA, NCCL, compiled kernels, pinned copies).

Run on a machine with a GPU: `PTDP_GPU_TESTS=1 pytest -m gpu` (tools/gpu_check.sh does, and
then benchmarks). Without CUDA every test here is skipped (tests/conftest.py), so the plain
suite never needs a GPU. One process, a world of one rank: NCCL for CUDA tensors, gloo for CPU
ones (`cpu:gloo,cuda:nccl`), so CPU and GPU trainers share it. Small shapes: the tier takes a
few minutes on one H100, most of it compiling.

Written without a GPU at hand (issue 22): it has never run on one yet; a failure here is as
likely to be the test's as the code's, and worth reading as such.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.seq_length=64",
         "model.vocab_size=512", "model.dropout=0.0", "train.micro_batch_size=4",
         "train.global_batch_size=16", "train.lr=1e-3", "train.lr_warmup_iters=0",
         "log.progress=false", "log.interval=1000", "train.seed=5"]
EXACT = ["train.precision=fp32", "train.tf32=false", "train.compile=false"]


def _trainer(*overrides):
    from ptdp.config import load_config
    from ptdp.training import Trainer
    return Trainer(load_config(None, SMALL + list(overrides), world_size=1))


def _losses(trainer) -> list[float]:
    return [record["loss"] for record in trainer.train()]


@pytest.mark.parametrize("arch", ["gpt", "bert"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_rank_trains_on_cuda_in_half_precision_like_fp32(world, arch, precision):
    """Half precision follows the fp32 run of the same model and data. (BERT's synthetic
    tokens and sentence pairs are uniformly random: its loss has nothing to learn and stays
    at ln V + ln 2, so "the loss falls" is checked for GPT only.)"""
    run = ["model.arch=" + arch, "train.iters=30", "train.compile=false"]
    trainer = _trainer(*run, f"train.precision={precision}")
    assert trainer.state.device.type == "cuda"
    assert trainer.state.params[0].dtype == getattr(torch, {"bf16": "bfloat16",
                                                            "fp16": "float16"}[precision])
    losses = _losses(trainer)
    reference = _losses(_trainer(*run, *EXACT))
    assert all(math.isfinite(x) for x in losses)
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 0.05, (losses, reference)
    if arch == "gpt":
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05, losses


def test_fp16_overflow_skips_steps_and_halves_the_scale(world):
    trainer = _trainer("train.precision=fp16", "train.initial_loss_scale=1e12", "train.compile=false")
    steps = [trainer.train_step(it) for it in range(3)]
    assert [s.skipped for s in steps][:1] == [True]
    assert trainer.state.loss_scaler.scale < 1e12


@pytest.mark.parametrize("region", [1, 2])
def test_compiled_layers_equal_eager(world, region):
    """train.compile fuses the elementwise chains: round-off apart, the same layers, compiled
    one by one or as one region of both (train.compile_layers)."""
    import dataclasses

    from ptdp.config import load_config
    from ptdp.models.transformer import TransformerStack
    from ptdp.profiler.timing import layer_context
    from ptdp.runtime.startup import set_tf32
    set_tf32(False)
    model = load_config(None, SMALL, world_size=1).model
    device = torch.device("cuda", 0)
    eager = TransformerStack(layer_context(model, 1, device), 0, 2, True).to(device)
    ctx = dataclasses.replace(layer_context(model, 1, device, compile=True), compile_layers=region)
    compiled = TransformerStack(ctx, 0, 2, True).to(device)
    compiled.load_state_dict(eager.state_dict())
    x = torch.randn(64, 4, 64, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    a, b = eager(x), compiled(x2)
    a.square().mean().backward()
    b.square().mean().backward()
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-3, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-6, msg=name)


def test_compiled_dropout_is_replayed_by_recomputation_on_cuda(world):
    """One tensor rank: a compiled region draws its hidden and attention dropout in the graph
    (flash attention's own random state for the latter, models/attention.py); recompute=full
    restores the generator and replays the same masks, so the gradients equal those of the
    same region kept whole."""
    import dataclasses

    from ptdp.config import load_config
    from ptdp.models.transformer import TransformerStack
    from ptdp.profiler.timing import layer_context
    model = dataclasses.replace(load_config(None, SMALL, world_size=1).model, dropout=0.1)
    device = torch.device("cuda", 0)
    grads, outs, weights = [], [], None
    for recompute in ("none", "full"):
        ctx = dataclasses.replace(layer_context(model, 1, device, recompute, compile=True),
                                  compile_layers=2, recompute_num_layers=2)
        stack = TransformerStack(ctx, 0, 2, True).to(device).train()
        if weights is None:
            weights = stack.state_dict()
        stack.load_state_dict(weights)
        x = torch.randn(64, 4, 64, device=device, generator=torch.Generator(device).manual_seed(1),
                        requires_grad=True)
        torch.cuda.manual_seed(7)
        out = stack(x)
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append([p.grad for p in stack.parameters()] + [x.grad])
    torch.testing.assert_close(outs[1], outs[0])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want)


def test_flat_buffers_and_fused_adamw_on_cuda(world):
    trainer = _trainer("train.precision=bf16", "train.compile=false")
    weights = trainer.state.weights
    buffer = weights.model_buffer
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    assert buffer.is_cuda
    assert all(start <= p.data_ptr() < end for p in trainer.state.params)
    assert trainer.state.optimizer.defaults.get("fused") is True
    trainer.train_step(0)


def test_distributed_optimizer_at_world_size_one_equals_the_plain_one(world):
    plain = _trainer(*EXACT, "train.iters=3")   # one trainer for all steps, as the sharded one
    sharded = _trainer(*EXACT, "train.iters=3", "train.distributed_optimizer=true")
    assert ([sharded.train_step(it).loss for it in range(3)]
            == pytest.approx([plain.train_step(it).loss for it in range(3)], rel=1e-6))


@pytest.fixture(scope="module")
def checkpoints(world, tmp_path_factory):
    """GPU: 4 iterations saving at 2; CPU: the same. Losses of each, and where they saved."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for device in ("cuda", "cpu"):
        trainer = _trainer(*EXACT, f"train.device={device}", "train.iters=4",
                           f"checkpoint.dir={root}/{device}", "checkpoint.save_interval=2")
        out[device] = _losses(trainer)
    return root, out


@pytest.mark.parametrize("saved,resumed", [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_checkpoint_saved_on_one_device_resumes_on_the_other(checkpoints, saved, resumed):
    root, losses = checkpoints
    trainer = _trainer(*EXACT, f"train.device={resumed}", "train.iters=4",
                       f"checkpoint.load={root}/{saved}/iter_0000002")
    assert trainer.iteration == 2
    assert _losses(trainer) == pytest.approx(losses[saved][2:], rel=1e-4)


def test_generation_on_gpu_equals_cpu(checkpoints):
    from ptdp.inference.generate import Sampling, generate
    from ptdp.inference.local_model import LocalModel
    root, _ = checkpoints
    out = {}
    for device in ("cpu", "cuda"):
        model = LocalModel.from_checkpoint(root / "cuda" / "iter_0000004").to(device)
        out[device] = generate(model, [5, 6, 7], 8, Sampling(0.0, 0, 1.0, 1))
    assert len(out["cuda"]) == 8 and out["cuda"] == out["cpu"]


def test_device_progress_with_cuda_events(world):
    """The hang detector's device marks: recorded after enqueuing, complete once the GPU has
    run past them; the first incomplete one is where the device is."""
    from ptdp.runtime.progress import DeviceProgress, Label, device_events
    progress = DeviceProgress(device_events(torch.device("cuda", 0)))
    torch.cuda._sleep(2_000_000_000)          # keep the GPU busy for about a second
    for k in range(3):
        progress.record(Label(f"F{k}@s0", "forward", k, 0))
    progress.poll()
    assert progress.stuck_in() == Label("F0@s0", "forward", 0, 0)
    torch.cuda.synchronize()
    progress.poll()
    assert progress.stuck_in() is None and progress.last_done.name == "F2@s0"


def test_freed_stage_output_keeps_its_graph_on_cuda(world):
    """The executor's freed outputs (Megatron's deallocate_output_tensor) on the GPU: the
    memory goes, the backward through the engine gives the same gradients."""
    from torch.autograd.graph import _engine_run_backward

    from ptdp.pipeline.executor import _free_data
    layer = torch.nn.Linear(256, 256, device="cuda")
    x = torch.randn(64, 256, device="cuda")
    grad = torch.randn(64, 256, device="cuda")
    out = torch.nn.functional.gelu(layer(x)) + 1.0
    before = torch.cuda.memory_allocated()
    _free_data(out)
    assert torch.cuda.memory_allocated() < before and out.numel() == 1
    out2 = torch.nn.functional.gelu(layer(x)) + 1.0
    torch.autograd.backward(out2, grad)
    reference = layer.weight.grad.clone()
    layer.weight.grad = None
    _engine_run_backward((out,), (grad,), False, False, (), allow_unreachable=True,
                         accumulate_grad=True)
    torch.testing.assert_close(layer.weight.grad, reference)


def test_data_workers_stage_pinned_batches_for_the_gpu(world):
    from ptdp.config import load_config
    from ptdp.data.batching import MicroBatches
    from ptdp.data.loader import PrefetchedBatches
    from ptdp.data.synthetic import synthetic_datasets
    dataset = synthetic_datasets(load_config(None, SMALL, world_size=1).model, 3)["train"]

    def batches():
        return MicroBatches(dataset, global_batch=16, micro_batch_size=4, data_rank=0,
                            data_size=1, device=torch.device("cuda", 0))

    plain, ahead = batches(), PrefetchedBatches(batches(), num_workers=2)
    for it in range(2):
        for mb in range(4):
            x, y = plain.get(it, mb), ahead.get(it, mb)
            assert all(y[k].is_cuda and torch.equal(x[k], y[k]) for k in x)
    ahead.close()


def test_profiler_on_cuda(tmp_path):
    """`ptdp profile` on the GPU: layers timed compiled, as training runs them (its
    collectives are measured between CPU ranks over gloo: docs/planner.md)."""
    out = tmp_path / "here.yaml"
    run = subprocess.run([sys.executable, "-m", "ptdp", "profile", str(ROOT / "configs/gpt_tiny.yaml"),
                          "--out", str(out), "--device", "cuda", "--precision", "bf16",
                          "--micro-batches", "2", "--tensor", "1", "--ranks", "2", "--iters", "2",
                          "--base", "h100-80gb"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout + run.stderr
    text = out.read_text()
    assert "compiled: true" in text and "forward_s" in text


def test_bench_gpu_tiny_on_cuda(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(ROOT / "tools/bench_gpu.py"), "--device", "cuda",
                          "--tiny", "--steps", "3", "--warmup", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["device"].startswith("cuda") and result["tf32"] is True
    assert result["data_workers"] == 2 and result["compile"] is True
    ours, ref = result["rows"]
    assert ours["step_ms"] > 0 and ref["step_ms"] > 0 and ours["peak_memory_gb"] > 0
