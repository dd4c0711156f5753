"""Flat buffers for model weights, fp32 master weights and gradients: only the storage
changes, so training is bit-identical to one storage per tensor (the `contiguous=False`
reference path), including data-parallel buckets, tied embeddings and fp16 loss scaling."""

import pytest
import torch
import torch.distributed as dist

from ptdp.models import build_chunk
from ptdp.models.transformer import ModelContext
from ptdp.config import ModelConfig
from ptdp.runtime.local_ranks import run_on_ranks
from ptdp.optim.buffers import ALIGN, FlatLayout
from ptdp.optim.mixed_precision import MasterWeights
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from tests.deadline import within
from tests.equivalence import TINY


def test_layout_is_aligned_disjoint_and_in_backward_order():
    shapes = [(3, 5), (7,), (64,), (2, 2, 2)]
    layout = FlatLayout(shapes)
    assert all(o % ALIGN == 0 for o in layout.offsets)
    assert layout.offsets == sorted(layout.offsets, reverse=True)  # last registered first
    ends = [o + torch.Size(s).numel() for o, s in zip(layout.offsets, shapes)]
    spans = sorted(zip(layout.offsets, ends))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert layout.numel >= max(ends) and layout.span([1, 2]) == (layout.offsets[2], ends[1])


def _chunk(dtype):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=8, vocab_size=100)
    ctx = ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")), 128)
    return build_chunk(ctx, 0, 1).to(dtype)


def _shares(tensor, buffer) -> bool:
    return tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_bf16_weights_masters_and_grads_are_views_of_one_buffer_each():
    chunk = _chunk(torch.bfloat16)
    values = [p.detach().clone() for p in chunk.parameters()]
    params = list(chunk.parameters())
    weights = MasterWeights(params, "bf16", contiguous=True)
    grads = weights.flat_grads.buffer
    assert all(torch.equal(p, v) for p, v in zip(params, values))  # moved, not changed
    assert all(_shares(p, weights.model_buffer) for p in params)
    assert all(_shares(m, weights.master_buffer) and m.dtype == torch.float32
               for m in weights.masters)
    assert all(m.grad is p.main_grad and _shares(m.grad, grads)
               for p, m in zip(params, weights.masters))
    tokens = torch.randint(0, 100, (2, 8))
    loss, _ = chunk(None, {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 8)})
    loss.backward()
    # went to main_grad and no .grad is kept: train.cuda_graphs relies on it, since a replay
    # overwrites the gradients it output (the H200 run of 2026-11-28, docs/performance.md)
    assert grads.abs().sum() > 0 and all(p.grad is None for p in params)
    weights.zero_grads()
    assert grads.abs().sum() == 0 and all(_shares(m.grad, grads) for m in weights.masters)
    with torch.no_grad():
        weights.master_buffer.add_(1.0)
    weights.masters_to_model()
    assert all(torch.equal(p, (v.float() + 1).to(torch.bfloat16)) for p, v in zip(params, values))


def test_fp32_grads_accumulate_in_place_into_the_buffer():
    chunk = _chunk(torch.float32)
    params = list(chunk.parameters())
    weights = MasterWeights(params, "fp32", contiguous=True)
    assert weights.masters is params
    tokens = torch.randint(0, 100, (2, 8))
    for _ in range(2):  # two micro-batches accumulate into the same views
        loss, _ = chunk(None, {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 8)})
        loss.backward()
    # views allocated before any CUDA graph capture, accumulated in place (train.cuda_graphs)
    assert all(_shares(p.grad, weights.flat_grads.buffer) for p in params)


RUNS = {  # name -> overrides on 2 ranks; tiny buckets so that there are several
    "bf16-d2": ["parallel.data=2", "train.precision=bf16", "train.grad_bucket_mb=0.02"],
    "fp16-d2": ["parallel.data=2", "train.precision=fp16", "train.initial_loss_scale=4096",
                "train.grad_bucket_mb=0.02"],
    "bf16-p2": ["parallel.pipeline=2", "train.precision=bf16"],  # tied embedding copies
    "fp32-d2": ["parallel.data=2", "train.grad_bucket_mb=0.02"],
}


def compare_storage(iters: int = 3) -> dict:
    from ptdp.config import load_config
    from ptdp.training import Trainer
    out = {}
    for name, overrides in RUNS.items():
        results = []
        for contiguous in (True, False):
            MasterWeights.contiguous_default = contiguous
            trainer = Trainer(load_config(None, TINY + overrides, world_size=dist.get_world_size()))
            losses = [trainer.train_step(it).loss for it in range(iters)]
            results.append((losses, [m.detach().clone() for m in trainer.state.master_params],
                            [b.in_place is not None for b in trainer.state.dp_grads.buckets]))
        (flat_losses, flat, in_place), (ref_losses, ref, ref_in_place) = results
        out[name] = {"losses": flat_losses == ref_losses,
                     "masters": len(flat) == len(ref) and all(map(torch.equal, flat, ref)),
                     "buckets_in_place": all(in_place) and not any(ref_in_place)
                     and (len(in_place) > 1 or "d2" not in name)}
    MasterWeights.contiguous_default = True
    return out


@pytest.fixture(scope="module")
def storage_runs():
    return run_on_ranks(2, compare_storage, timeout_s=within(240))


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("what", ["losses", "masters", "buckets_in_place"])
def test_flat_buffers_train_bit_identically(storage_runs, run, what):
    assert all(rank[run][what] for rank in storage_runs), (run, what)
