"""The master weights interface (ptdp/optim/weights.py): both kinds, replicated and sharded,
offer every operation, and what one saves the other loads, tensor for tensor (in one process:
the sharded kind with one data rank still cuts its buckets into pieces)."""

import typing

import pytest
import torch

from ptdp.config import ModelConfig, TrainConfig
from ptdp.models import build_chunk
from ptdp.models.transformer import ModelContext
from ptdp.optim.distributed import ShardedMasterWeights
from ptdp.optim.mixed_precision import MasterWeights
from ptdp.optim.optimizer import build_optimizer
from ptdp.optim.weights import MOMENTS, Weights
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG


def _params(precision: str) -> list:
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_heads=2, seq_length=8, vocab_size=50)
    ctx = ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")), 64)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    return list(build_chunk(ctx, 0, 1).to(dtype).parameters())


def _kinds(precision: str) -> dict:
    return {"replicated": MasterWeights(_params(precision), precision),
            "sharded": ShardedMasterWeights(_params(precision), precision, group=None, rank=0,
                                            size=1, bucket_mb=0.001)}


def _step(weights, seed: int):
    """One AdamW step on made-up gradients; returns the optimizer."""
    optimizer = build_optimizer(weights.masters, TrainConfig(lr=1e-2))
    gen = torch.Generator().manual_seed(seed)
    for master in weights.masters:
        master.grad = torch.randn(master.shape, generator=gen)
    optimizer.step()
    weights.masters_to_model()
    return optimizer


def test_both_kinds_offer_every_operation_of_the_interface():
    members = [name for name in dir(Weights) if not name.startswith("_")]
    members += list(typing.get_type_hints(Weights))
    for kind, weights in _kinds("fp32").items():
        missing = [name for name in members if not hasattr(weights, name)]
        assert not missing, f"{kind} lacks {missing}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("source,target", [("sharded", "replicated"), ("replicated", "sharded")])
def test_what_one_kind_saves_the_other_loads(precision, source, target):
    kinds = _kinds(precision)
    saver, loader = kinds[source], kinds[target]
    optimizer = _step(saver, seed=1)
    values, moments = saver.state_dict(), saver.optimizer_state_dict(optimizer)
    assert len(values) == len(saver.params) and all(
        v.shape == p.shape and v.dtype == torch.float32 for v, p in zip(values, saver.params))
    fresh = build_optimizer(loader.masters, TrainConfig(lr=1e-2))
    assert loader.optimizer_state_dict(fresh) == [{} for _ in loader.params]
    loader.load_state_dict(values)
    loader.load_optimizer_state_dict(fresh, moments)
    for a, b in zip(loader.state_dict(), values):
        assert torch.equal(a, b)
    for a, b in zip(loader.params, saver.params):   # the model's weights followed
        assert torch.equal(a, b)
    for a, b in zip(loader.optimizer_state_dict(fresh), moments):
        assert list(a) == [*MOMENTS, "step"] and all(torch.equal(a[k], b[k]) for k in a)


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """The elements of every tensor an op creates (factories and copies), by op."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.zeros, torch.ops.aten.empty,
                                   torch.ops.aten.new_zeros, torch.ops.aten._to_copy,
                                   torch.ops.aten.clone, torch.ops.aten.cat):
            self.sizes.append(out.numel())
        return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_save_gathers_bucket_by_bucket_the_values_of_one_gather(precision):
    """The sharded kind saves (state_dict, optimizer_state_dict) one bucket at a time: no
    allocation beyond the largest bucket's span but the per-parameter host copies, where a
    whole gather allocates the full flat layout; the values equal that gather's."""
    weights = _kinds(precision)["sharded"]
    optimizer = _step(weights, seed=3)
    assert len(weights.buckets) > 3
    with _Allocations() as seen:
        values, moments = weights.state_dict(), weights.optimizer_state_dict(optimizer)
    largest_bucket = max(end - start for start, end in weights.layout.bucket_spans)
    assert max(seen.sizes) <= largest_bucket < weights.layout.numel / 3
    full = torch.zeros(weights.layout.numel)   # the whole gather it replaces
    for piece in weights.masters:
        at = weights.layout.offsets[piece.param_index]
        full[at + piece.param_range[0]: at + piece.param_range[1]] = piece.detach()
    for i, value in enumerate(values):
        assert value.device.type == "cpu" and value.is_contiguous()
        assert torch.equal(value, weights.layout.view(full, i))
    for entry, param in zip(moments, weights.params):
        assert entry["exp_avg"].shape == param.shape and entry["step"].item() == 1


@pytest.mark.parametrize("kind", ["replicated", "sharded"])
def test_cpu_optimizer_runs_foreach_and_equals_the_per_tensor_loop(kind):
    """On CPU build_optimizer steps all tensors per op (foreach) instead of torch's default
    Python loop over them; the weights after three steps are bit-identical to that loop's."""
    steppers = {}
    for name in ("ours", "loop"):
        weights = _kinds("fp32")[kind]
        optimizer = build_optimizer(weights.masters, TrainConfig(lr=1e-2, weight_decay=0.1))
        if name == "loop":
            for group in optimizer.param_groups:
                group["foreach"] = False
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            for master in weights.masters:
                master.grad = torch.randn(master.shape, generator=gen)
            optimizer.step()
        steppers[name] = (optimizer, [m.detach().clone() for m in weights.masters])
    assert all(g["foreach"] for g in steppers["ours"][0].param_groups)
    for ours, loop in zip(steppers["ours"][1], steppers["loop"][1]):
        assert torch.equal(ours, loop)
