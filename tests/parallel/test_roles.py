"""A parameter's role says which grid axes its gradient is summed over and which ranks write it.

On a d = 2, c = 2 grid (rank = 2*d + c), a parameter reduced over ("data",) only, as an expert
parameter will be (the context axis standing in for the expert axis: each context rank holds
its own tensor), is summed over the two data ranks of its context coordinate, counted once
per context coordinate in the gradient norm, and written by data rank 0 of each; a dense
parameter beside it is summed over all four ranks and written by rank 0 alone.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within

DATA_ONLY = ("data",)


def _params():
    """[dense (3), data-only (5), dense (4)]: in the flat gradient buffer (reverse order,
    aligned) the data-only tensor sits between the two dense ones."""
    from ptdp.parallel.roles import declare_role
    dense_a, expert, dense_b = (nn.Parameter(torch.zeros(n)) for n in (3, 5, 4))
    declare_role(expert, reduce_axes=DATA_ONLY)
    return [dense_a, expert, dense_b]


def _backward(params, rank):
    """Gradient of parameter i on `rank`: (rank + 1) * (i + 1) everywhere."""
    loss = sum((rank + 1) * (i + 1) * p.sum() for i, p in enumerate(params))
    loss.backward()


def roles_on_a_rank(flat: bool):
    import torch.distributed as dist

    from ptdp.checkpoint import save
    from ptdp.checkpoint.layout import PARAMETERS, StatePart
    from ptdp.optim.distributed import ShardedMasterWeights, shard_group
    from ptdp.optim.grads import DataParallelGradients, global_grad_norm
    from ptdp.optim.mixed_precision import MasterWeights
    from ptdp.parallel.grid import RankGrid
    from ptdp.parallel.roles import writes
    grid, rank = RankGrid(1, 1, 2, timeout_s=60, context=2), dist.get_rank()
    params = _params()
    weights = MasterWeights(params, "fp32", contiguous=flat)
    reduction = DataParallelGradients(params, grid, 1, flat=weights.flat_grads)
    _backward(params, rank)
    reduction.finish()
    out = {"flat": flat, "grads": [p.grad[0].item() for p in params],
           "views_of_the_buffer": flat and all(
               p.grad.untyped_storage().data_ptr()
               == weights.flat_grads.buffer.untyped_storage().data_ptr() for p in params),
           "norm": global_grad_norm(params, grid, device=torch.device("cpu")).item(),
           "writes": [writes(p, grid) for p in params]}
    state = SimpleNamespace(
        grid=grid, params=params, device=torch.device("cpu"), tp=SimpleNamespace(size=1),
        cfg=SimpleNamespace(model=SimpleNamespace(vocab_size=8)),
        rng=SimpleNamespace(state_dict=lambda: {}),
        named_parameters=lambda: zip(("dense_a", "expert", "dense_b"), params))
    weight_part = StatePart("weights", None, per_parameter=True)
    parts = [(weight_part, {PARAMETERS: [{"value": p.detach()} for p in params]})]
    files, _ = save._snapshot_rank_files(state, Path("ckpt"), parts)
    out["written"] = {path.name: sorted(shards) for path, shards in files.items()
                      if path.name.startswith("model_")}
    # The distributed optimizer shards a data-only parameter over the data group alone.
    expert = _params()[1]
    group, index, size = shard_group([expert], grid)
    sharded = ShardedMasterWeights([expert], "fp32", group, index, size, bucket_mb=1.0)
    reduction = DataParallelGradients([expert], grid, 1, sharded=sharded.shard_layout)
    _backward([expert], rank)
    reduction.finish()
    out["sharded"] = (index, size, sharded.full_grads()[0].tolist())
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["own storage", "flat buffer"])
def ranks(request):
    return run_on_ranks(4, roles_on_a_rank, request.param, timeout_s=within(120))


def test_a_dense_gradient_is_summed_over_data_and_context_a_data_only_one_over_data(ranks):
    dense = 1 + 2 + 3 + 4                      # every rank's (rank + 1)
    by_context = {0: 1 + 3, 1: 2 + 4}          # ranks 0, 2 (c = 0) and 1, 3 (c = 1)
    for rank, out in enumerate(ranks):
        assert out["grads"] == [dense * 1, by_context[rank % 2] * 2, dense * 3], rank


def test_the_flat_buffer_keeps_holding_the_summed_gradients(ranks):
    """The dense bucket spans the data-only tensor in the buffer: it is reduced as a copy and
    the sums go back into the buffer's views."""
    assert all(out["views_of_the_buffer"] == out["flat"] for out in ranks)


def test_the_norm_counts_each_parameter_once(ranks):
    dense = (10 * 1) ** 2 * 3 + (10 * 3) ** 2 * 4
    experts = (4 * 2) ** 2 * 5 + (6 * 2) ** 2 * 5    # one tensor per context coordinate
    for out in ranks:
        assert out["norm"] == pytest.approx((dense + experts) ** 0.5, rel=1e-6)   # (float32 norms)


def test_the_checkpoint_writes_a_parameter_from_the_first_rank_of_its_reduce_group(ranks):
    assert [out["writes"] for out in ranks] == [[True, True, True], [False, True, False],
                                                [False, False, False], [False, False, False]]
    shard = "model_pp000_tp000.pt"
    assert [out["written"] for out in ranks] == [{shard: ["dense_a", "dense_b", "expert"]},
                                                 {shard: ["expert"]}, {}, {}]


def test_the_distributed_optimizer_shards_over_the_reduce_group(ranks):
    for rank, out in enumerate(ranks):
        index, size, grad = out["sharded"]
        assert (index, size) == (rank // 2, 2)
        assert grad == [{0: 1 + 3, 1: 2 + 4}[rank % 2]] * 5


def test_the_distributed_optimizer_refuses_parameters_of_two_reduce_groups():
    from ptdp.optim.distributed import shard_group
    with pytest.raises(ValueError, match=r"one reduce group.*\('data', 'context'\).*\('data',\)"):
        shard_group(_params(), grid=None)
