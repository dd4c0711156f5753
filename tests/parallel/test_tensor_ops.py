"""f/g operators, parallel linears, vocab-parallel cross-entropy and dropout RNG on 2 ranks.

Every check runs inside one spawned 2-rank job (start-up dominates); each returns a named
result that the tests below assert on.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ptdp.runtime.local_ranks import run_on_ranks
from ptdp.parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                  full_normal)
from ptdp.parallel.mappings import (TensorParallel, copy_to_tensor_region, gather_from_tensor_region,
                                    reduce_from_tensor_region)
from ptdp.parallel.sequence import gather_from_sequence_region, reduce_scatter_to_sequence_region
from ptdp.pipeline.p2p import P2P
from ptdp.parallel.rng import TensorParallelRNG
import ptdp.parallel.cross_entropy as ce
from ptdp.parallel.cross_entropy import vocab_parallel_cross_entropy
from tests.deadline import within

T = 2


def _tp() -> TensorParallel:
    return TensorParallel(dist.group.WORLD, dist.get_rank(), dist.get_world_size())


def _gradcheck_mlp(tp):
    """g(GeLU(f(x) A_i) B_i) as a function of the replicated activation x, in float64.

    Every rank perturbs the same element of x at once, so finite differences see the true
    function of x; the analytic gradient needs f's backward all-reduce to match. (Weight
    shards can't be checked this way: perturbing them on all ranks at once changes the
    function; their gradients are compared with the dense model in _mlp_matches_dense.)
    """
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64, generator=g).requires_grad_()
    a = torch.randn(6, 4, dtype=torch.float64, generator=g).chunk(tp.size, 0)[tp.rank]
    b = torch.randn(4, 6, dtype=torch.float64, generator=g).chunk(tp.size, 1)[tp.rank]

    def mlp(x):
        hidden = F.gelu(F.linear(copy_to_tensor_region(x, tp), a))
        return reduce_from_tensor_region(F.linear(hidden, b), tp)

    return torch.autograd.gradcheck(mlp, (x,), eps=1e-6, atol=1e-6)


def _mlp_matches_dense(tp):
    """Column -> Row on t ranks equals the dense two-layer MLP (output and all grads)."""
    col = ColumnParallelLinear(6, 8, tp, seed=3, key="c", std=0.5, bias=True)
    row = RowParallelLinear(8, 6, tp, seed=3, key="r", std=0.5, bias=True)
    torch.nn.init.normal_(col.bias, generator=torch.Generator().manual_seed(tp.rank))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(9), requires_grad=True)
    y = row(F.gelu(col(x)))
    y.square().sum().backward()
    w1, w2 = full_normal((8, 6), 0.5, 3, "c.weight"), full_normal((6, 8), 0.5, 3, "r.weight")
    b1 = torch.cat([torch.empty(8 // tp.size).normal_(generator=torch.Generator().manual_seed(r))
                    for r in range(tp.size)]).requires_grad_()
    w1.requires_grad_(), w2.requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y_ref = F.linear(F.gelu(F.linear(x_ref, w1, b1)), w2)
    y_ref.square().sum().backward()
    shard = lambda t, d: t.chunk(tp.size, d)[tp.rank]  # noqa: E731
    return {"out": torch.allclose(y, y_ref, atol=1e-6),
            "x_grad": torch.allclose(x.grad, x_ref.grad, atol=1e-5),
            "w1_grad": torch.allclose(col.weight.grad, shard(w1.grad, 0), atol=1e-5),
            "w2_grad": torch.allclose(row.weight.grad, shard(w2.grad, 1), atol=1e-5),
            "b1_grad": torch.allclose(col.bias.grad, shard(b1.grad, 0), atol=1e-5)}


def _cross_entropy(tp, fused=False):
    """Vocab-parallel CE over padded logits equals F.cross_entropy on the real vocabulary
    (`fused`: train.compile's compiled passes, to round-off)."""
    vocab, padded = 13, 16
    g = torch.Generator().manual_seed(5)
    full = torch.randn(5, 3, padded, generator=g, dtype=torch.float64)
    target = torch.randint(0, vocab, (5, 3), generator=g)
    target[0, 0], target[1, 1] = 0, vocab - 1  # both edges of the vocabulary
    local = full.chunk(tp.size, -1)[tp.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, vocab, tp, fused=fused)
    loss.sum().backward()
    ref_logits = full[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none")
    ref.sum().backward()
    ref_grad = torch.cat([ref_logits.grad, torch.zeros(5, 3, padded - vocab, dtype=torch.float64)], -1)
    return {"loss": torch.allclose(loss, ref.view(5, 3), atol=1e-10),
            "grad": torch.allclose(local.grad, ref_grad.chunk(tp.size, -1)[tp.rank], atol=1e-10),
            "padding_grad_zero": bool((local.grad[..., max(0, vocab - tp.rank * 8):] == 0).all())}


class _CountFullSizeFloat32(TorchDispatchMode):
    """Counts new (non-aliasing) fp32 tensors with `numel` elements made by any op."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() == self.numel
                    and t.untyped_storage().data_ptr() not in inputs):
                self.count += 1
        return out


def _cross_entropy_low_precision(tp, vocab=13, padded=16, fused=False):
    """bf16 logits: the loss equals F.cross_entropy on the fp32 upcast, the gradient comes back
    in bf16, and forward + backward make exactly one fp32 [s, b, V/t] tensor (eager; `fused`:
    the compiled passes, which keep the bf16 logits themselves for backward and no fp32
    tensor of their shape). With vocab=6 the second rank holds only padding columns."""
    g = torch.Generator().manual_seed(6)
    full = torch.randn(5, 3, padded, generator=g).to(torch.bfloat16)
    target = torch.randint(0, vocab, (5, 3), generator=g)
    local = full.chunk(tp.size, -1)[tp.rank].clone().requires_grad_()
    counter = _CountFullSizeFloat32(local.numel())
    with counter:
        loss = vocab_parallel_cross_entropy(local, target, vocab, tp, fused=fused)
        kept = loss.grad_fn.saved_tensors
        loss.sum().backward()
    full_size = [x for x in kept if x.numel() == local.numel()]
    ref_logits = full[..., :vocab].float().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none")
    ref.sum().backward()
    ref_grad = torch.cat([ref_logits.grad, torch.zeros(5, 3, padded - vocab)], -1)
    return {"loss": torch.allclose(loss, ref.view(5, 3), rtol=1e-6, atol=1e-6),
            "grad_dtype": local.grad.dtype == torch.bfloat16,
            "grad": torch.allclose(local.grad.float(), ref_grad.chunk(tp.size, -1)[tp.rank].to(
                torch.bfloat16).float(), atol=1e-2),
            "one_fp32_copy": (counter.count == 1 if not fused else
                              [x.dtype for x in full_size] == [torch.bfloat16]
                              and full_size[0].data_ptr() == local.data_ptr())}


class _NewBytes(TorchDispatchMode):
    """Bytes of every new storage made by any op (collectives write into their arguments)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                inputs.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
        return out


def _collective_copies(tp):
    """Bytes each communication pattern allocates, in units of its result: the all-reduces of
    f and g work in place (0), the sequence all-gather and the scatter/gather reassembly
    gather straight into their result (1); the last-dimension gather needs one buffer more
    (its slices interleave: 2). The values equal those of the dense computation."""
    g = torch.Generator().manual_seed(8)
    full = torch.randn(8, 3, 4, generator=g)
    mine = full.chunk(tp.size, 0)[tp.rank].clone()
    extra, exact = {}, {}

    def measure(name, fn, *args):
        with _NewBytes() as counter:
            out = fn(*args)
        extra[name] = counter.bytes / out.untyped_storage().nbytes()
        return out

    partial = full * (tp.rank + 1)
    exact["g"] = torch.equal(measure("g forward", reduce_from_tensor_region, partial.clone(), tp),
                             full * sum(range(1, tp.size + 1)))
    x = full.clone().requires_grad_()
    y, grad = copy_to_tensor_region(x, tp), partial.clone()
    exact["f"] = torch.equal(measure("f backward", lambda: torch.autograd.grad(y, x, grad)[0]),
                             full * sum(range(1, tp.size + 1)))
    sp = TensorParallel(tp.group, tp.rank, tp.size, sequence_parallel=True)
    exact["sequence gather"] = torch.equal(measure("sequence gather", gather_from_sequence_region,
                                                   mine, sp), full)
    exact["sequence reduce-scatter"] = torch.equal(
        measure("sequence reduce-scatter", reduce_scatter_to_sequence_region, full.clone(), sp),
        mine * tp.size)
    exact["last-dim gather"] = torch.equal(
        measure("last-dim gather", gather_from_tensor_region,
                full.chunk(tp.size, -1)[tp.rank].contiguous(), tp), full)
    p2p = P2P([0], tensor_group=tp.group, tp_rank=tp.rank, tp_size=tp.size, scatter_gather=True)
    exact["scatter/gather"] = torch.equal(
        measure("scatter/gather", p2p._assemble, full.reshape(-1).chunk(tp.size)[tp.rank].clone(),
                full.shape), full)
    return {"extra": extra, "exact": exact}


def _gather_and_scatter_modes(tp):
    """Column with gather_output and Row with a replicated input both equal a dense linear."""
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(4))
    col = ColumnParallelLinear(6, 8, tp, seed=5, key="g", std=0.5, gather_output=True)
    row = RowParallelLinear(6, 4, tp, seed=5, key="s", std=0.5, input_is_parallel=False)
    torch.nn.init.constant_(row.bias, 0.25)
    dense_col = F.linear(x, full_normal((8, 6), 0.5, 5, "g.weight"))
    dense_row = F.linear(x, full_normal((4, 6), 0.5, 5, "s.weight")) + 0.25
    return {"gather_output": torch.allclose(col(x), dense_col, atol=1e-6),
            "input_is_parallel=False": torch.allclose(row(x), dense_row, atol=1e-6)}


def _embedding(tp):
    emb = VocabParallelEmbedding(10, 16, 4, tp, seed=2, key="e", std=1.0)
    ids = torch.tensor([[0, 7, 9], [3, 8, 1]])
    ref = full_normal((10, 4), 1.0, 2, "e.weight")[ids]
    return torch.allclose(emb(ids), ref)


def _dropout_streams(tp):
    """Inside the tensor region masks differ across ranks; outside they agree."""
    torch.manual_seed(11)  # the default stream: same seed on every tensor rank
    rng = TensorParallelRNG(11, tp.rank, torch.device("cpu"))
    with rng.fork():
        inside = F.dropout(torch.ones(64), 0.5)
    outside = F.dropout(torch.ones(64), 0.5)
    both = [torch.empty(2, 64) for _ in range(tp.size)]
    dist.all_gather(both, torch.stack([inside, outside]))
    state_after_fork = rng.get_state()
    with rng.fork():
        again = F.dropout(torch.ones(64), 0.5)
    return {"inside_differs": not torch.equal(both[0][0], both[1][0]),
            "outside_agrees": torch.equal(both[0][1], both[1][1]),
            "stream_advances": not torch.equal(again, inside),
            "fork_keeps_state": not torch.equal(state_after_fork, rng.get_state())}


def _full_tensors(tp):
    """Sharded values to full fp32 tensors, every split value in as many all-gathers as batches
    of GATHER_BATCH elements allow: a column weight (split on rows), a row weight (on columns),
    a padded vocabulary table in bf16 (trimmed, exact in fp32), a replicated bias."""
    import ptdp.parallel.sharding as sharding
    from ptdp.parallel.roles import declare_role
    col = ColumnParallelLinear(6, 8, tp, seed=5, key="c", std=0.5)
    row = RowParallelLinear(8, 4, tp, seed=5, key="r", std=0.5)
    table = full_normal((12, 4), 1.0, 5, "v").to(torch.bfloat16)    # vocabulary 10, padded to 12
    shard = declare_role(table.chunk(tp.size)[tp.rank].clone(), tp_split_dim=0, vocab_padded=True)
    bias = torch.full((3,), 0.5)
    items = [(col.weight, col.weight), (row.weight, row.weight), (shard, shard), (bias, bias)]
    expected = [full_normal((8, 6), 0.5, 5, "c.weight"), full_normal((4, 8), 0.5, 5, "r.weight"),
                table.float()[:10], bias]
    original, counted = dist.all_gather, []
    out = {}
    try:
        dist.all_gather = lambda *a, **k: counted.append(1) or original(*a, **k)
        for batch in (1 << 26, 48, 1):   # all in one; the two weights (40), the table; each alone
            sharding.GATHER_BATCH, counted[:] = batch, []
            full = sharding.full_tensors(items, tp, vocab_size=10)
            out[batch] = (len(counted), all(torch.equal(f, e) and f.dtype == torch.float32
                                            for f, e in zip(full, expected)))
    finally:
        dist.all_gather, sharding.GATHER_BATCH = original, 1 << 26
    return out


def run_checks():
    torch.set_default_dtype(torch.float32)
    tp = _tp()
    return {"gradcheck_mlp": _gradcheck_mlp(tp), "mlp": _mlp_matches_dense(tp),
            "ce": _cross_entropy(tp), "ce_bf16": _cross_entropy_low_precision(tp),
            "ce_padding_rank": _cross_entropy_low_precision(tp, vocab=6),
            "modes": _gather_and_scatter_modes(tp),
            "embedding": _embedding(tp), "dropout": _dropout_streams(tp),
            "copies": _collective_copies(tp), "full_tensors": _full_tensors(tp)}


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(T, run_checks, timeout_s=within(120))


def test_f_and_g_pass_gradcheck(results):
    assert all(r["gradcheck_mlp"] for r in results)


@pytest.mark.parametrize("what", ["out", "x_grad", "w1_grad", "w2_grad", "b1_grad"])
def test_parallel_mlp_equals_dense(results, what):
    assert all(r["mlp"][what] for r in results), what


@pytest.mark.parametrize("what", ["loss", "grad", "padding_grad_zero"])
def test_vocab_parallel_cross_entropy(results, what):
    assert all(r["ce"][what] for r in results), what


def test_fused_cross_entropy_equals_torch_in_fp64():
    """train.compile's fused loss on one rank with padded columns: F.cross_entropy's loss and
    gradient to 1e-10."""
    assert all(_cross_entropy(TensorParallel(), fused=True).values())


def test_the_fused_loss_silences_only_inductors_online_softmax_warning():
    """Inductor warns, in every BERT job's log, that online softmax is off when it splits a
    pass's reduction over few long rows (one H200 run); the passes take the max as an input,
    so that one warning is filtered, and no other."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ce._quiet_inductor():
            warnings.warn("\nOnline softmax is disabled on the fly since Inductor decides to\n"
                          "split the reduction.", UserWarning)
            warnings.warn("another warning", UserWarning)
    assert [str(w.message) for w in caught] == ["another warning"]


def test_fused_cross_entropy_passes_on_two_vocabulary_halves():
    """The fused loss's compiled passes on each rank's half of a padded vocabulary (the second
    half all padding), their sums added as the all-reduce adds them: F.cross_entropy's loss
    and gradient. (The max and the all-reduces are the eager loss's, checked on 2 ranks
    above; the fused loss on 2 tensor ranks runs in tests/kernels/test_compile.py's compiled
    model, against eager.)"""
    vocab, padded = 6, 16
    g = torch.Generator().manual_seed(7)
    full = torch.randn(5, 3, padded, generator=g, dtype=torch.float64)
    target = torch.randint(0, vocab, (5, 3), generator=g)
    logits_max = full[..., :vocab].amax(-1)
    halves = [(half, ce._Slice(half, target, vocab, TensorParallel(None, rank, 2)))
              for rank, half in enumerate(full.chunk(2, -1))]
    sums = [ce._compiled(ce._target_and_sum_exp)(half, logits_max, part.local_target,
                                                   part.outside, part.real_here)
            for half, part in halves]
    assert [part.real_here for _, part in halves] == [6, 0]
    target_logit, sum_exp = (sum(pair[i] for pair in sums) for i in (0, 1))
    grad = torch.cat([ce._compiled(ce._logits_grad)(half, logits_max, sum_exp, part.local_target,
                                                     part.outside, torch.ones_like(sum_exp),
                                                     part.real_here)
                      for half, part in halves], -1)
    ref_logits = full[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none")
    ref.sum().backward()
    torch.testing.assert_close(sum_exp.log() - target_logit, ref.view(5, 3).detach(),
                               rtol=0, atol=1e-10)
    torch.testing.assert_close(grad[..., :vocab], ref_logits.grad, rtol=0, atol=1e-10)
    assert (grad[..., vocab:] == 0).all()


@pytest.mark.parametrize("case", ["ce_bf16", "ce_padding_rank"])
@pytest.mark.parametrize("what", ["loss", "grad_dtype", "grad", "one_fp32_copy"])
def test_vocab_parallel_cross_entropy_low_precision(results, case, what):
    assert all(r[case][what] for r in results), (case, what)


@pytest.mark.parametrize("fused", [False, True])
def test_single_process_cross_entropy_low_precision(fused):
    assert all(_cross_entropy_low_precision(TensorParallel(), fused=fused).values())
    assert all(_cross_entropy_low_precision(TensorParallel(), vocab=6).values())


@pytest.mark.parametrize("mode", ["gather_output", "input_is_parallel=False"])
def test_linear_modes_equal_dense(results, mode):
    assert all(r["modes"][mode] for r in results), mode


@pytest.mark.parametrize("pattern,extra", [
    ("g forward", 0), ("f backward", 0), ("sequence gather", 1), ("sequence reduce-scatter", 1),
    ("scatter/gather", 1), ("last-dim gather", 2)])
def test_collectives_write_in_place(results, pattern, extra):
    """No clone before an all-reduce, no list all-gather + cat: bytes allocated per rank, in
    units of the result (before: 1, 1, 2, 1, 2, 2); and the result is exact."""
    for r in results:
        assert r["copies"]["extra"][pattern] == extra, (pattern, r["copies"]["extra"])
        assert all(r["copies"]["exact"].values()), r["copies"]["exact"]


def test_full_tensors_gather_the_shards_in_batches(results):
    for r in results:   # (all-gathers, every full tensor exact)
        assert r["full_tensors"] == {1 << 26: (1, True), 48: (2, True), 1: (3, True)}


def test_vocab_parallel_embedding_equals_lookup(results):
    assert all(r["embedding"] for r in results)


@pytest.mark.parametrize("what", ["inside_differs", "outside_agrees", "stream_advances",
                                  "fork_keeps_state"])
def test_dropout_rng_streams(results, what):
    assert results[0]["dropout"][what], what


def test_single_process_cross_entropy_matches_torch():
    tp = TensorParallel()
    logits = torch.randn(4, 2, 128, requires_grad=True)
    target = torch.randint(0, 100, (4, 2))
    ours = vocab_parallel_cross_entropy(logits, target, 100, tp)
    ref = F.cross_entropy(logits[..., :100].reshape(-1, 100), target.reshape(-1), reduction="none")
    torch.testing.assert_close(ours, ref.view(4, 2))
