"""Deferred weight gradients as zb-h1 uses them: a chunk's own queue
(ptdp/parallel/weight_grad.py), bound after construction to every layer that owns weights.
B leaves them all to W (but the fused chains' biases and the position table), W then equals
a plain backward to the bit, and chunks on one rank defer into separate queues."""

import contextlib

import pytest
import torch

from ptdp.config import ModelConfig
from ptdp.models import build_chunk
from ptdp.models.transformer import ModelContext, TransformerStack
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from ptdp.parallel.weight_grad import (PLAIN, defer_weight_grads, pending_weight_grads,
                                       weight_grads_of)
from tests.equivalence import relative_error

MODELS = {"gpt": dict(arch="gpt"), "bert": dict(arch="bert"),
          "llama": dict(arch="gpt", preset="llama", num_kv_heads=2, ffn_hidden_size=64)}
# Weights whose gradients B computes: the biases added inside the fused elementwise chains
# (ptdp/kernels/fused.py) and the learned position table's slice. Llama has neither.
IN_B = ("attention.proj.bias", "mlp.fc1.bias", "mlp.fc2.bias", "embedding.position")


def _context(arch: str, compile: bool = False) -> ModelContext:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=8, vocab_size=100,
                      **MODELS[arch])
    return ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")),
                        128, compile=compile)


def _batch() -> dict:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 100, (2, 8), generator=g)
    return {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(2, 8),
            "types": torch.randint(0, 2, (2, 8), generator=g), "sop_label": torch.tensor([0, 1]),
            "padding_mask": torch.tensor([[1] * 8, [1] * 5 + [0] * 3])}


def _plain_grads(arch: str) -> tuple[torch.Tensor, dict]:
    chunk = build_chunk(_context(arch), 0, 1).train()
    loss, _ = chunk(None, _batch())
    loss.backward()
    return loss, {n: p.grad for n, p in chunk.named_parameters()}


@pytest.mark.parametrize("arch", MODELS)
def test_a_chunks_w_pass_equals_its_plain_backward_to_the_bit(arch):
    loss, expected = _plain_grads(arch)
    chunk = build_chunk(_context(arch), 0, 1).train()
    queue = defer_weight_grads(chunk)
    with queue.defer(0):
        deferred_loss, _ = chunk(None, _batch())
        deferred_loss.backward()
    in_b = {n for n, p in chunk.named_parameters() if p.grad is not None}
    assert in_b == {n for n in expected if n.endswith(IN_B)}
    assert queue.pending() == [0]
    queue.run(0)
    assert torch.equal(deferred_loss, loss) and queue.pending() == []
    for name, param in chunk.named_parameters():
        assert torch.equal(param.grad, expected[name]), name


def test_binding_reaches_every_layer_that_owns_weights():
    """A 2-layer GPT chunk: 6 per layer (2 norms, 4 GEMMs), the embedding and its word table,
    the final norm and the chunk itself (the logits); unbound, all compute plainly."""
    chunk = build_chunk(_context("gpt"), 0, 1)
    owners = [m for m in chunk.modules() if hasattr(m, "weight_ops")]
    assert len(owners) == 2 * 6 + 2 + 1 + 1 and all(m.weight_ops is PLAIN for m in owners)
    queue = defer_weight_grads(chunk)
    assert chunk.weight_grads is queue and all(m.weight_ops is queue for m in owners)


def test_each_chunk_defers_into_its_own_queue():
    """Two chunks of one rank (interleaved stages): B of one leaves the other's weights alone,
    and what is pending is reported by (micro-batch, stage)."""
    first, second = (TransformerStack(_context("gpt"), i, 1, causal=True) for i in range(2))
    queues = defer_weight_grads(first), defer_weight_grads(second)
    assert queues[0] is not queues[1]
    x = torch.randn(8, 2, 32, requires_grad=True)
    with queues[0].defer(5):
        (first(x) + second(x)).sum().backward()
    assert first.layers[0].mlp.fc2.weight.grad is None
    assert second.layers[0].mlp.fc2.weight.grad is not None   # outside its own B pass: now
    assert pending_weight_grads({3: first, 4: second}) == [(5, 3)]
    queues[0].run(5)
    assert first.layers[0].mlp.fc2.weight.grad is not None
    assert pending_weight_grads({3: first, 4: second}) == []


def test_a_w_pass_needs_its_b_pass():
    with pytest.raises(RuntimeError, match="W pass of 1 without its B pass"):
        defer_weight_grads(torch.nn.Linear(2, 2)).run(1)


def test_an_unbound_queue_splits_only_the_micro_batches_run_bound():
    """The executor's queue (`weight_grads_of` on a chunk without one): the layers keep torch's
    own ops except inside `bound()`, so a micro-batch run outside it backpropagates whole even
    inside a B pass, and one run inside it leaves its weight gradients to W, equal to the
    plain ones to the bit. 1F1B splits only its drain's micro-batches this way."""
    torch.manual_seed(0)
    chunk = build_chunk(_context("gpt"), 0, 1)
    layers = [m for m in chunk.modules() if hasattr(m, "weight_ops")]
    queue = weight_grads_of(chunk)
    assert weight_grads_of(chunk) is queue and all(m.weight_ops is PLAIN for m in layers)
    fc2 = chunk.stack.layers[0].mlp.fc2.weight

    def step(mb, bound):
        with queue.bound() if bound else contextlib.nullcontext():
            loss, _ = chunk(None, _batch())
        with queue.defer(mb), queue.bound() if bound else contextlib.nullcontext():
            loss.backward()

    step(0, bound=False)
    plain = fc2.grad.clone()
    assert all(m.weight_ops is PLAIN for m in layers) and queue.pending() == [0]
    queue.run(0)   # nothing was deferred
    chunk.zero_grad(set_to_none=True)
    step(1, bound=True)
    assert fc2.grad is None and queue.pending() == [1]
    assert all(m.weight_ops is PLAIN for m in layers)   # restored after the pass
    queue.run(1)
    assert torch.equal(fc2.grad, plain)
    with pytest.raises(ValueError), queue.bound():
        assert all(m.weight_ops is queue for m in layers)
        raise ValueError
    assert all(m.weight_ops is PLAIN for m in layers)   # restored after an error too


def test_a_compiled_layer_defers_its_weight_gradients():
    """train.compile with zb-h1: the queue's custom operators inside the compiled layer, bound
    after the layer was compiled, hand their weight gradients over at run time."""
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(5), requires_grad=True)
    eager = TransformerStack(_context("gpt"), 0, 1, causal=True)
    eager(x).square().sum().backward()
    compiled = TransformerStack(_context("gpt", compile=True), 0, 1, causal=True)
    queue = defer_weight_grads(compiled)
    with queue.defer(0):
        compiled(x).square().sum().backward()
    assert compiled.layers[0].mlp.fc1.weight.grad is None
    queue.run(0)
    expected = dict(eager.named_parameters())
    for name, param in compiled.named_parameters():
        assert relative_error(param.grad, expected[name].grad) <= 1e-5, name


def test_a_deferring_layer_compiles_into_one_graph():
    """zb-h1 keeps one graph per compiled layer (issue 34): the queue's ops are custom
    operators dynamo traces as one op each, not graph breaks around every linear and norm."""
    from torch._dynamo.utils import counters
    for arch in ("gpt", "llama"):   # LayerNorm and RMSNorm's gain
        stack = TransformerStack(_context(arch), 0, 2, causal=True)
        defer_weight_grads(stack)
        for layer in stack.layers:
            layer.compile(backend="eager")   # dynamo's graphs without inductor's compilation
        torch._dynamo.reset()
        counters.clear()
        x = torch.randn(8, 2, 32, requires_grad=True)
        stack(x).sum().backward()
        assert counters["stats"]["unique_graphs"] == 1, arch   # both layers share it
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_compiled_layers_split_per_micro_batch_without_recompiling():
    """1F1B's cooldown binds a compiled chunk to its queue for some micro-batches only: dynamo
    keeps one graph for each binding (shared by the chunks, whatever their queues), none after
    the first iteration, and the split micro-batches' weight gradients equal the whole ones."""
    from torch._dynamo.utils import counters
    stacks = [TransformerStack(_context("gpt"), 0, 2, causal=True) for _ in range(3)]
    for stack in stacks:
        for layer in stack.layers:
            layer.compile(backend="eager")   # dynamo's graphs without inductor's compilation
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(5), requires_grad=True)
    graphs = []
    for _ in range(2):
        for stack in stacks:
            queue = weight_grads_of(stack)
            grads = []
            for mb, split in enumerate((False, True)):
                binding = queue.bound() if split else contextlib.nullcontext()
                with binding:
                    y = stack(x)
                with queue.defer(mb), queue.bound() if split else contextlib.nullcontext():
                    y.square().sum().backward()
                deferred = stack.layers[0].mlp.fc1.weight.grad is None
                assert deferred == split
                queue.run(mb)
                grads.append({n: p.grad.clone() for n, p in stack.named_parameters()})
                stack.zero_grad(set_to_none=True)
            for name, grad in grads[0].items():
                assert torch.equal(grads[1][name], grad), name
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [2, 2], graphs   # plain and bound
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_the_owner_table_forgets_the_weights_of_dropped_chunks():
    """The table that finds a weight's queue at backward time (deferred_ops.OWNERS) holds live
    weights only: building, training and dropping chunks leaves it as it was."""
    import gc

    from ptdp.parallel import deferred_ops
    gc.collect()
    before = len(deferred_ops.OWNERS)
    x = torch.randn(8, 2, 32, requires_grad=True)
    for _ in range(2):
        stack = TransformerStack(_context("gpt"), 0, 1, causal=True)
        queue = defer_weight_grads(stack)
        with queue.defer(0):
            stack(x).sum().backward()
        queue.run(0)
        assert len(deferred_ops.OWNERS) > before   # its weights are known while it lives
        del stack, queue
        gc.collect()
        assert len(deferred_ops.OWNERS) == before
