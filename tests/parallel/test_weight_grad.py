"""The split backward (ptdp/parallel/weight_grad.py): B leaves weight gradients for W, which
then equals a plain backward exactly; each weight accumulates (and fires its hooks) once."""

import pytest
import torch
import torch.nn.functional as F

from ptdp.parallel.weight_grad import WeightGradQueue


@pytest.fixture
def parts():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, requires_grad=True)
    w, b = torch.nn.Parameter(torch.randn(5, 8)), torch.nn.Parameter(torch.randn(5))
    norm = torch.nn.LayerNorm(5)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    table, ids = torch.nn.Parameter(torch.randn(10, 5)), torch.randint(0, 10, (4, 3))
    return x, w, b, norm, table, ids


def _loss(y):
    return (y * torch.arange(5.0)).sum()


def test_split_backward_equals_plain_backward_exactly(parts):
    x, w, b, norm, table, ids = parts
    tensors = (x, w, b, norm.weight, norm.bias, table)
    _loss(F.layer_norm(F.linear(x, w, b), (5,), norm.weight, norm.bias) + F.embedding(ids, table)).backward()
    expected = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    calls = {id(t): 0 for t in tensors}
    for t in tensors[1:]:
        t.register_post_accumulate_grad_hook(lambda p: calls.__setitem__(id(p), calls[id(p)] + 1))
    queue = WeightGradQueue()
    with queue.defer("mb0"):
        _loss(queue.layer_norm(queue.linear(x, w, b), (5,), norm.weight, norm.bias, norm.eps)
              + queue.embedding(ids, table)).backward()
    assert x.grad is not None and all(t.grad is None for t in tensors[1:])   # B: input only
    assert all(calls[id(t)] == 0 for t in tensors[1:])                      # no hook in B
    queue.run("mb0")
    for t, e in zip(tensors, expected):
        assert torch.equal(t.grad, e)
    assert all(calls[id(t)] == 1 for t in tensors[1:])
    assert queue.pending() == []


def test_an_embedding_alone_gets_its_gradient(parts):
    """A lookup of integer ids has no input that needs a gradient; W must still see it."""
    *_, table, ids = parts
    queue = WeightGradQueue()
    with queue.defer("mb1"):
        _loss(queue.embedding(ids, table)).backward()
    queue.run("mb1")
    expected = torch.zeros_like(table).index_add_(0, ids.reshape(-1), torch.arange(5.0).expand(12, 5))
    assert torch.equal(table.grad, expected)


def test_a_weight_used_twice_accumulates_once_per_pass(parts):
    """Like the tied word table with p = 1 (lookup and logits): one sum, one hook call."""
    x = parts[0]
    w = torch.nn.Parameter(torch.randn(8, 8))
    linear_twice = lambda f: f(f(x, w), w).sum()  # noqa: E731
    linear_twice(F.linear).backward()
    expected, w.grad = w.grad.clone(), None
    calls = []
    w.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    queue = WeightGradQueue()
    with queue.defer("tied"):
        linear_twice(queue.linear).backward()
    queue.run("tied")
    assert len(calls) == 1 and torch.allclose(w.grad, expected, rtol=1e-6, atol=1e-6)


def test_w_without_b_is_an_error():
    with pytest.raises(RuntimeError, match="without its B pass"):
        WeightGradQueue().run("never")
