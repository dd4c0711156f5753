"""The distributed optimizer (train.distributed_optimizer=true, ptdp/optim/distributed.py).

* fp32, (p, t, d) = (1, 1, 2), (1, 2, 2) (with 17 small buckets), (2, 2, 2), GPT and BERT:
  the single-process losses, first-step gradients and updated weights (the layouts live in
  tests/equivalence.py, whose spawned jobs they share);
* bf16 and fp16: the same numbers as the unsharded optimizer; an fp16 overflow in one rank's
  shard skips the step on every rank;
* each data rank holds 1/d of the optimizer state, every element exactly once;
* checkpoints: exact resume (fp32 with dropout, bf16), the saved tensors equal the unsharded
  optimizer's, and saves with and without it load into other layouts with and without it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ptdp.runtime.local_ranks import run_on_ranks
from ptdp.optim.buffers import ALIGN, FlatLayout
from tests.deadline import within
from tests.equivalence import ARCHS, RTOL, TINY, assert_equivalent, layout_result, reference

DISTOPT = ["train.distributed_optimizer=true"]
T2_D2 = ["parallel.tensor=2", "parallel.data=2"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["d2-distopt", "t2-d2-distopt", "p2-t2-d2-distopt"])
def test_distributed_optimizer_matches_single_process(arch, layout):
    for rank in layout_result(layout, arch):
        assert_equivalent(rank, reference(arch), f"{arch} {layout} rank {rank['coords']}")


def test_bucket_padding_cuts_every_bucket_into_aligned_equal_shards():
    shapes = [(3, 5), (7,), (64,), (2, 2, 2), (100,)]
    layout = FlatLayout(shapes, buckets=[[4, 3], [2], [1, 0]], bucket_shards=4)
    assert layout.bucket_spans[0][0] == 0 and layout.bucket_spans[-1][1] == layout.numel
    for (start, end), (next_start, _) in zip(layout.bucket_spans, layout.bucket_spans[1:]):
        assert end == next_start
    for start, end in layout.bucket_spans:
        assert (end - start) % (4 * ALIGN) == 0 and end > start
    assert layout.offsets[4] == 0 and layout.offsets[2] == layout.bucket_spans[1][0]
    assert all(o % ALIGN == 0 for o in layout.offsets)


# --------------------------------------------------------------------------------------------
# Mixed precision, overflow and memory (one job of 2 ranks)
# --------------------------------------------------------------------------------------------

def _trainer(overrides: list[str]):
    from ptdp.config import load_config
    from ptdp.training import Trainer
    return Trainer(load_config(None, TINY + overrides, world_size=dist.get_world_size()))


def precision_job() -> dict:
    out = {}
    for precision in ("bf16", "fp16"):
        for sharded in (False, True):
            trainer = _trainer(["parallel.data=2", f"train.precision={precision}",
                                "train.clip_grad=0", "train.iters=3"] + (DISTOPT if sharded else []))
            out[(precision, sharded)] = [r["loss"] for r in trainer.train()]
    # Memory: the state of d=2 with and without sharding, after one step.
    for sharded in (False, True):
        trainer = _trainer(["parallel.data=2", "train.precision=bf16", "train.iters=1"]
                           + (DISTOPT if sharded else []))
        trainer.train()
        out[("state_bytes", sharded)] = trainer.state.weights.state_bytes(trainer.state.optimizer)
        out[("moment_elements", sharded)] = sum(s["exp_avg"].numel()
                                                for s in trainer.state.optimizer.state.values())
        if sharded:
            out["owned"] = sorted((m.param_index, *m.param_range) for m in trainer.state.master_params)
            out["padded"] = trainer.state.weights.layout.numel
    # An overflow (inf) in a gradient only data rank 1's shard holds: both ranks skip.
    trainer = _trainer(["parallel.data=2", "train.precision=fp16"] + DISTOPT)
    trainer.step.forward_backward(0)
    out["finite_before"] = bool(torch.isfinite(trainer.step.reduce_gradients()))
    before = trainer.state.weights.master_shard.clone()
    if trainer.state.grid.dp_rank == 1:
        trainer.state.master_params[0].grad[0] = float("inf")
    out["own_shard_finite"] = all(torch.isfinite(m.grad).all() for m in trainer.state.master_params)
    from ptdp.optim.grads import global_grad_norm
    norm = global_grad_norm(trainer.state.master_params, trainer.state.grid, sharded=True,
                            device=trainer.state.device)
    scale = trainer.state.loss_scaler.scale
    out["skipped"] = trainer.step.optimizer_step(0, norm)
    out["scale_halved"] = trainer.state.loss_scaler.scale == scale / 2
    out["masters_unchanged"] = torch.equal(before, trainer.state.weights.master_shard)
    out["failed_save"] = _save_failing_on_rank_1()
    return out


def _save_failing_on_rank_1() -> dict:
    """A save's gather (`gather_to_host`, three buckets) whose values fail on data rank 1 in
    the second bucket: what each rank raised and how long it took, then a normal gather (the
    collectives must still pair up) against the weights."""
    import time

    from ptdp.optim.distributed import ShardedMasterWeights
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(100)) for _ in range(3)]
    weights = ShardedMasterWeights(params, "fp32", dist.group.WORLD, dist.get_rank(), 2,
                                   bucket_mb=400 / 2**20)
    second = {id(p) for p in weights.buckets[1].params}

    def value_of(piece):
        if dist.get_rank() == 1 and id(weights.params[piece.param_index]) in second:
            raise ValueError("injected on rank 1")
        return piece.detach()

    start, raised = time.monotonic(), None
    try:
        weights.gather_to_host(value_of)
    except Exception as err:   # noqa: BLE001 - the test reports what was raised
        raised = f"{type(err).__name__}: {err}"
    after = weights.gather_to_host(lambda piece: piece.detach())
    return {"buckets": len(weights.buckets), "raised": raised,
            "seconds": time.monotonic() - start,
            "then_whole": all(torch.equal(a, p.detach()) for a, p in zip(after, params))}


@pytest.fixture(scope="module")
def precision_ranks():
    return run_on_ranks(2, precision_job, timeout_s=within(240))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_losses_equal_the_unsharded_optimizer(precision_ranks, precision):
    out = precision_ranks[0]
    sharded, whole = out[(precision, True)], out[(precision, False)]
    assert sharded == whole, (precision, sharded, whole)


def test_fp16_overflow_in_one_shard_skips_the_step_on_every_rank(precision_ranks):
    rank0, rank1 = precision_ranks
    assert rank0["own_shard_finite"] and not rank1["own_shard_finite"]
    for rank in (rank0, rank1):
        assert rank["finite_before"] and rank["skipped"] and rank["scale_halved"] and rank["masters_unchanged"]


def test_a_save_failing_on_one_rank_raises_on_every_rank(precision_ranks):
    """The failing rank raises its own error, the other one line naming it, both promptly and
    at the same bucket (the next gather still pairs up: collectives stayed in step)."""
    rank0, rank1 = (r["failed_save"] for r in precision_ranks)
    assert rank0["buckets"] == 3
    assert rank1["raised"] == "ValueError: injected on rank 1"
    assert rank0["raised"] == ("RuntimeError: distributed-optimizer save stopped before bucket "
                               "1 of 3: rank(s) [1] of its data group failed (their own error "
                               "says why)")
    for rank in (rank0, rank1):
        assert rank["seconds"] < 20 and rank["then_whole"], rank


def test_each_data_rank_keeps_half_of_the_optimizer_state(precision_ranks):
    rank0, rank1 = precision_ranks
    whole = rank0[("moment_elements", False)]
    assert rank1[("moment_elements", False)] == whole   # replicated without sharding
    # Sharded: every element's moments are kept by exactly one data rank ...
    assert rank0[("moment_elements", True)] + rank1[("moment_elements", True)] == whole
    owned = rank0["owned"] + rank1["owned"]
    by_param: dict = {}
    for index, lo, hi in owned:
        by_param.setdefault(index, []).append((lo, hi))
    for ranges in by_param.values():
        ranges.sort()
        assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    # ... and each keeps about half: at most the alignment padding more.
    for rank in (rank0, rank1):
        assert rank[("moment_elements", True)] <= whole / 2 + (rank["padded"] - whole) / 2
        # bf16: fp32 masters (4 B) + two moments (8 B) per element, now split two ways
        assert rank[("state_bytes", False)] == 12 * whole
        # (the fp32 master shard also spans its alignment padding)
        bound = 12 * (whole + rank["padded"]) / 2 / 2 + 4 * (rank["padded"] - whole) / 2
        assert 12 * rank[("moment_elements", True)] <= rank[("state_bytes", True)] <= bound


# --------------------------------------------------------------------------------------------
# Checkpoints (one job of 4 ranks, one of 1)
# --------------------------------------------------------------------------------------------

def _ckpt(directory: Path, load: Path | None = None) -> list[str]:
    out = [f"checkpoint.dir={directory}", "checkpoint.save_interval=2"]
    return out + ([f"checkpoint.load={load}"] if load else [])


def _losses(trainer) -> list[float]:
    return [record["loss"] for record in trainer.train()]


LOADERS = {   # layouts of 4 ranks that load the distopt (1, 2, 2) checkpoint of iteration 2
    "p2-t2-d1": ["parallel.pipeline=2", "parallel.tensor=2"],
    "p1-t2-d2 unsharded": T2_D2,
    "p2-t1-d2-v2 distopt": ["parallel.pipeline=2", "parallel.data=2", "parallel.chunks=2",
                            "schedule.name=interleaved"] + DISTOPT,
    "p1-t1-d4 distopt": ["parallel.data=4", "train.grad_bucket_mb=0.01"] + DISTOPT,
}


def checkpoint_job(root: str) -> dict:
    root, out = Path(root), {}
    four = ["train.iters=4"]
    # Exact resume with dropout: sharded state, RNG and data position.
    dropout = T2_D2 + DISTOPT + four + ["model.dropout=0.1"]
    out["dropout_full"] = _losses(_trainer(dropout + _ckpt(root / "dropout")))
    resumed = _trainer(dropout + _ckpt(root / "dropout", root / "dropout" / "iter_0000002"))
    out["dropout_resumed"] = _losses(resumed)
    # bf16: the fp32 masters come back exactly, not from the bf16 weights.
    bf16 = T2_D2 + DISTOPT + four + ["train.precision=bf16"]
    out["bf16_full"] = _losses(_trainer(bf16 + _ckpt(root / "bf16")))
    out["bf16_resumed"] = _losses(_trainer(bf16 + [f"checkpoint.load={root}/bf16/iter_0000002"]))
    # The same run with and without sharding saves the same tensors.
    ref = _trainer(T2_D2 + DISTOPT + four + _ckpt(root / "distopt"))
    out["ref"] = _losses(ref)
    _trainer(T2_D2 + four + _ckpt(root / "unsharded")).train()   # same LR schedule
    for name, layout in LOADERS.items():
        trainer = _trainer(layout + four + [f"checkpoint.load={root}/distopt/iter_0000002"])
        out[f"load {name}"] = _losses(trainer)
    # An unsharded save loads into the distributed optimizer.
    out["into distopt"] = _losses(_trainer(T2_D2 + DISTOPT + four
                                           + [f"checkpoint.load={root}/unsharded/iter_0000002"]))
    return out


def single_job(root: str) -> dict:
    trainer = _trainer([f"checkpoint.load={root}/distopt/iter_0000002", "train.iters=4"])
    return {"losses": _losses(trainer)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("distopt_checkpoints")
    world4 = run_on_ranks(4, checkpoint_job, str(root), timeout_s=within(400))
    world1 = run_on_ranks(1, single_job, str(root), timeout_s=within(120))[0]
    return root, world4[0], world1


def test_resume_is_exact(checkpoints):
    _, out, _ = checkpoints
    assert out["dropout_resumed"] == out["dropout_full"][2:]
    assert out["bf16_resumed"] == out["bf16_full"][2:]


def test_saved_tensors_equal_the_unsharded_optimizers(checkpoints):
    root, _, _ = checkpoints
    for tp in (0, 1):
        name = f"model_pp000_tp{tp:03d}.pt"
        sharded = torch.load(root / "distopt" / "iter_0000002" / name, weights_only=True)
        whole = torch.load(root / "unsharded" / "iter_0000002" / name, weights_only=True)
        assert sharded.keys() == whole.keys()
        for param, entry in whole.items():
            assert sharded[param].keys() == entry.keys() == {"value", "exp_avg", "exp_avg_sq", "step"}
            for key, want in entry.items():
                got = sharded[param][key]
                assert got.shape == want.shape, (param, key)
                assert torch.allclose(got, want, rtol=RTOL, atol=1e-7), (param, key)


@pytest.mark.parametrize("loader", [*LOADERS, "into distopt", "p1-t1-d1"])
def test_checkpoints_load_across_layouts_with_and_without_sharding(checkpoints, loader):
    _, out, single = checkpoints
    got = single["losses"] if loader == "p1-t1-d1" else out[f"load {loader}" if loader in LOADERS
                                                            else loader]
    want = out["ref"][2:]
    assert len(got) == len(want) == 2
    for x, y in zip(got, want):
        assert abs(x - y) <= RTOL * abs(y), f"{loader}: {got} vs {want}"


def test_divergence_names_the_parameter_from_the_shards():
    from tests.test_divergence import EXPLODE, _train_until_it_stops
    out = run_on_ranks(2, _train_until_it_stops, ["parallel.data=2", *DISTOPT, *EXPLODE],
                       timeout_s=within(120))
    errors = {r["error"] for r in out}
    assert len(errors) == 1 and None not in errors, errors     # every rank stops together
    error = errors.pop()
    assert re.search(r"first non-finite gradient: \S+\.(weight|bias|position) on rank", error), error
