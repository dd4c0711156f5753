"""The experts' grouped GEMMs and permutations (ptdp/parallel/experts.py) against the plain
ops autograd would run: values and gradients, the `torch._grouped_mm` path against the loop,
and zb-h1's deferral of their weight gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ptdp.parallel.experts import Groups, grouped_linear, inverse_permutation, permute
from ptdp.parallel.weight_grad import PLAIN, WeightGradQueue

SIZES = [5, 0, 11, 8]   # an expert without rows: its weight's gradient is zeros


def _reference(x, weights, halves):
    """Each expert's F.linear on its rows, each row set of its weight apart."""
    outs = [[] for _ in range(halves)]
    for part, weight in zip(x.split(SIZES), weights):
        for j in range(halves):
            outs[j].append(F.linear(part, weight[j::halves]))
    return [torch.cat(out) for out in outs]


def _run(groups, halves, ops=PLAIN, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(SIZES), 16, generator=gen).requires_grad_()
    weights = [torch.randn(8 * halves, 16, generator=gen).requires_grad_() for _ in SIZES]
    outs = grouped_linear(x, weights, groups, ops, halves) if groups else _reference(
        x, weights, halves)
    grads = [torch.randn(out.shape, generator=gen) for out in outs]
    torch.autograd.backward(list(outs), grads)
    return outs, x, weights


@pytest.mark.parametrize("halves", [1, 2])
@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_grouped_linear_equals_a_linear_per_expert(halves, kernel):
    if kernel == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    groups = (Groups(sizes=SIZES) if kernel == "loop"
              else Groups(ends=torch.tensor(SIZES).cumsum(0).to(torch.int32)))
    outs, x, weights = _run(groups, halves)
    ref_outs, ref_x, ref_weights = _run(None, halves)
    for out, ref in zip(outs, ref_outs):
        torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, ref_x.grad)
    for weight, ref in zip(weights, ref_weights):
        torch.testing.assert_close(weight.grad, ref.grad)
    assert weights[1].grad.count_nonzero() == 0


def test_a_queue_defers_the_weight_gradients_to_its_w_pass():
    queue = WeightGradQueue()
    with queue.defer("mb0"):
        outs, x, weights = _run(Groups(sizes=SIZES), 2, queue)
    assert x.grad is not None and all(w.grad is None for w in weights)
    queue.run("mb0")
    _, _, plain = _run(Groups(sizes=SIZES), 2)
    assert all(w.grad.equal(p.grad) for w, p in zip(weights, plain))


def test_a_permutation_backward_equals_index_selects():
    """The dispatch (each token k times, sorted by expert) and the combine's un-permutation:
    the gathers' gradients equal autograd's zero fill + scatter-add to the bit (k = 2)."""
    gen = torch.Generator().manual_seed(1)
    n, k = 12, 2
    x = torch.randn(n, 6, generator=gen, requires_grad=True)
    order = torch.argsort(torch.randint(0, 4, (n * k,), generator=gen), stable=True)
    inverse = inverse_permutation(order)
    assert inverse.equal(torch.argsort(order))
    grad = torch.randn(n * k, 6, generator=gen)
    rows = permute(x, order // k, inverse, k)
    back = permute(rows, inverse, order)
    (rows * grad).sum().backward(retain_graph=True)
    ours = x.grad.clone()
    x.grad = None
    (x.index_select(0, order // k) * grad).sum().backward()
    assert rows.equal(x.index_select(0, order // k)) and back.equal(x.repeat_interleave(k, 0))
    assert ours.equal(x.grad)


@pytest.mark.parametrize("halves", [1, 2])
def test_grouped_mm_calls_pass_the_cuda_kernels_checks(halves):
    """The bf16 `torch._grouped_mm` calls of forward, input and weight gradients against the
    CUDA kernel's own checks (dtype, contraction sizes, 16-byte strides), on meta tensors (no
    GPU here; torch's meta function implements the checks of `_grouped_mm_cuda`)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    ends = torch.tensor([5, 5, 16, 24], dtype=torch.int32, device="meta")
    meta = dict(dtype=torch.bfloat16, device="meta", requires_grad=True)
    for inner, out, sets in ((64, 32 * halves, halves), (32, 64, 1)):   # fc1, then fc2
        x = torch.empty(24, inner, **meta)
        weights = [torch.empty(out, inner, **meta) for _ in range(4)]
        outs = grouped_linear(x, weights, Groups(ends=ends), PLAIN, sets)
        assert [o.shape for o in outs] == [(24, out // sets)] * sets
        torch.autograd.backward(list(outs), [torch.empty_like(o) for o in outs])
        assert x.grad.shape == x.shape and all(w.grad.shape == w.shape for w in weights)
    with pytest.raises(RuntimeError, match="16 bytes"):   # the check is live: 60 columns fail it
        torch._grouped_mm(torch.empty(24, 60, dtype=torch.bfloat16, device="meta"),
                          torch.empty(4, 60, 32, dtype=torch.bfloat16, device="meta"), offs=ends)
