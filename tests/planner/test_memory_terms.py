"""The memory model's terms against what the trainer's code really allocates, at tiny shapes:
ZB-H1's pending weight-gradient closures and W-pass copy (ptdp/parallel/weight_grad.py), the
distributed optimizer's buffers and gloo staging (ptdp/optim/distributed.py), and which
layouts copy a gradient bucket for the data-parallel reduction (ptdp/optim/grads.py)."""

import weakref

import pytest
import torch

from ptdp.models import build_chunk
from ptdp.models.transformer import ModelContext, TransformerLayer
from ptdp.config import ModelConfig, padded_vocab_size
from ptdp.optim.distributed import ShardedMasterWeights
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from ptdp.parallel.weight_grad import defer_weight_grads
from ptdp.planner.compute import ModelShape
from ptdp.planner.memory import (gloo_sharding_staging_bytes, gpu_memory, optimizer_state_bytes,
                                 pending_weight_grad_bytes, stage_parameters)

CFG = ModelConfig(arch="gpt", num_layers=2, hidden_size=64, num_heads=4, seq_length=16,
                  vocab_size=100, dropout=0.0)
SHAPE = ModelShape.from_config(CFG)
B = 2


def _context() -> ModelContext:
    return ModelContext(CFG, TensorParallel(), 1234, TensorParallelRNG(1234, 0, torch.device("cpu")),
                        padded_vocab_size(CFG.vocab_size, 1))


def _tensors_in(obj, seen: set, depth: int = 0):
    """Tensors a closure keeps alive: its cells, the cells of closures in them, ctx objects."""
    if depth > 4 or id(obj) in seen:
        return
    seen.add(id(obj))
    if torch.is_tensor(obj):
        yield obj
    elif callable(obj) and getattr(obj, "__closure__", None):
        for cell in obj.__closure__:
            yield from _tensors_in(cell.cell_contents, seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item, seen, depth + 1)


@pytest.fixture
def pending_layer():
    """One layer after its B pass: (layer, the pending closures of its micro-batch)."""
    torch.manual_seed(0)
    layer = TransformerLayer(_context(), 0, causal=True)
    queue = defer_weight_grads(layer)
    x = torch.randn(CFG.seq_length, B, CFG.hidden_size, requires_grad=True)
    grad = torch.randn_like(x)
    with queue.defer("mb"):
        layer(x).backward(grad)
    return layer, queue._pending["mb"]


def test_pending_weight_gradients_hold_what_the_model_counts(pending_layer):
    """Between B and W a layer keeps every deferred weight gradient's input and output
    gradient (the autograd graph itself is freed): 12sbh + 2sbf elements at t = 1."""
    layer, pending = pending_layer
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages, seen = {}, set()
    for _, compute in pending:
        for t in _tensors_in(compute, seen):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                storages[ptr] = t.untyped_storage().nbytes()
    s, h, f = CFG.seq_length, CFG.hidden_size, SHAPE.ffn
    layer_norm_stats = 2 * 2 * s * B * 4          # mean and rstd of each LayerNorm, fp32
    assert sum(storages.values()) == pending_weight_grad_bytes(SHAPE, B, 1, "fp32") + layer_norm_stats
    assert pending_weight_grad_bytes(SHAPE, B, 1, "fp32") == (12 * s * B * h + 2 * s * B * f) * 4


def test_w_pass_holds_one_weight_gradient_at_a_time(pending_layer):
    """The W pass (WeightGradQueue.run) accumulates each weight's gradient as soon as it is
    computed: at most one weight's gradient is alive at once, the largest fc1's, the term
    gpu_memory adds for zb-h1 (the first stage: its embedding table's, when larger)."""
    layer, pending = pending_layer
    sizes = {g.numel() * g.element_size() for _, compute in pending for g in compute()
             if g is not None}
    live, peak = [0], [0]

    def tracked(compute):
        def run():
            grads = compute()
            for g in grads:
                if g is not None:
                    live[0] += g.numel() * g.element_size()
                    peak[0] = max(peak[0], live[0])
                    weakref.finalize(g, lambda n=g.numel() * g.element_size(): live.__setitem__(
                        0, live[0] - n))
            return grads
        return run

    queue = layer.weight_grads
    queue._pending["mb"] = [(params, tracked(compute)) for params, compute in pending]
    queue.run("mb")
    fc1 = CFG.hidden_size * SHAPE.ffn * 4
    assert max(sizes) == fc1 and peak[0] <= fc1 + CFG.hidden_size * 4   # fc1's and a bias
    assert layer.mlp.fc1.weight.grad is not None
    kwargs = dict(p=2, t=1, v=1, m=8, b=B, recompute="none", precision="fp32", attention="flash",
                  vocab_padded=128, reserved_gb=0.0)
    zb, flush = (gpu_memory(SHAPE, schedule=s, rank=0, **kwargs) for s in ("zb-h1", "gpipe"))
    assert zb.buffers - flush.buffers == pytest.approx(max(fc1, 128 * CFG.hidden_size * 4))


def test_zb_h1_ranks_hold_forward_stashes_and_pending_weight_gradients():
    """Rank r: 1F1B's p - r forward stashes plus r pending W sets (at m >= p)."""
    kwargs = dict(p=4, t=1, v=1, m=8, b=B, recompute="none", precision="fp32", attention="flash",
                  vocab_padded=128, reserved_gb=0.0)
    shape = ModelShape.from_config(ModelConfig(**{**CFG.__dict__, "num_layers": 4}))
    for rank in range(4):
        zb = gpu_memory(shape, schedule="zb-h1", rank=rank, **kwargs)
        flush = gpu_memory(shape, schedule="1f1b", rank=rank, **kwargs)
        assert zb.activations - flush.activations == pytest.approx(
            rank * pending_weight_grad_bytes(shape, B, 1, "fp32"))


def test_distributed_optimizer_terms_match_its_buffers():
    """Weights, gradients, Adam moments and gloo's staging per rank, from the buffers
    ShardedMasterWeights really allocates for a whole tiny GPT (p = 1, d = 2)."""
    chunk = build_chunk(_context(), 0, 1)
    params = list(chunk.parameters())
    d = 2
    sharded = ShardedMasterWeights(params, "fp32", group=None, rank=0, size=d, bucket_mb=0.02)
    vocab = padded_vocab_size(CFG.vocab_size, 1)
    planned = stage_parameters(SHAPE, 1, 1, vocab, True, True)
    assert planned == sum(p.numel() for p in params)
    assert len(sharded.buckets) > 2 and not any(b.all_reduce for b in sharded.buckets)
    padded = sharded.layout.numel          # buckets padded to ALIGN * d: within 2 %
    assert sharded.model_buffer.numel() * 4 == pytest.approx(planned * 4, rel=0.02)
    assert sharded.flat_grads.buffer.numel() * 4 == pytest.approx(planned * 4, rel=0.02)
    moments = 2 * sharded.shard_numel * 4
    assert moments == pytest.approx(optimizer_state_bytes(planned, "fp32", d, True), rel=0.02)
    # gloo: per bucket, the reduce-scatter's whole fp32 input copy and 1/d output chunk, and
    # the all-gather's whole copy in the model's dtype
    spans = [end - start for start, end in (b.span for b in sharded.buckets)]
    staged = sum(n * 4 * (1 + 1 / d) + n * 4 for n in spans)
    assert sum(spans) == padded
    assert staged == pytest.approx(gloo_sharding_staging_bytes(planned, "fp32", d), rel=0.02)


def test_only_unflattened_gradients_copy_a_bucket():
    """Flat gradient buffers are all-reduced in place; 2BW's per-tensor gradients are
    concatenated into one copy per bucket first (ptdp/optim/grads.py)."""
    kwargs = dict(p=2, t=1, v=1, m=8, b=B, recompute="none", precision="fp32", attention="flash",
                  vocab_padded=128, reserved_gb=0.0, rank=1)
    for schedule, copies in (("1f1b", False), ("zb-h1", False), ("2bw", True)):
        one, two = (gpu_memory(SHAPE, schedule=schedule, d=d, **kwargs) for d in (1, 2))
        stage = stage_parameters(SHAPE, 1, 2, 128, False, True)
        assert two.buffers - one.buffers == pytest.approx(stage * 4 if copies else 0.0)


def _loss_kept_bytes(rows: int, vocab_padded: int) -> int:
    """What the vocab-parallel loss keeps for its backward from [rows, V] logits (saved-tensor
    hooks on the real function; its index tensors left out)."""
    from ptdp.parallel.cross_entropy import vocab_parallel_cross_entropy
    logits = torch.randn(rows, 1, vocab_padded, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda x: kept.append(x) or x, lambda x: x):
        vocab_parallel_cross_entropy(logits * 1.0, torch.zeros(rows, 1, dtype=torch.long), 100,
                                     TensorParallel())
    return sum(x.numel() * x.element_size() for x in kept if x.is_floating_point())


def test_gpipe_keeps_every_micro_batchs_loss_state_on_the_last_stage():
    """All m forwards run before the first backward: the last stage holds what the loss keeps
    for each micro-batch, where 1F1B holds one at a time (only the logits' terms depend on V)."""
    rows, m = SHAPE.seq * B, 4
    per_logit = _loss_kept_bytes(rows, 256) - _loss_kept_bytes(rows, 128)
    assert per_logit == rows * 128 * 4     # the fp32 softmax, [rows, V]

    def last_stage(schedule, vocab):
        return gpu_memory(SHAPE, p=2, t=1, v=1, m=m, b=B, schedule=schedule, rank=1,
                          recompute="none", precision="fp32", attention="flash",
                          vocab_padded=vocab, reserved_gb=0.0).activations

    assert last_stage("gpipe", 256) - last_stage("gpipe", 128) == (m - 1) * per_logit
    assert last_stage("1f1b", 256) == last_stage("1f1b", 128)


def _saved_activation_bytes(layer, x) -> int:
    """Bytes of the distinct storages a layer's forward saves for backward, its weights
    excepted."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(saved.values())


def test_token_dropping_keeps_what_the_moe_term_counts():
    """An MoE layer with capacity factor 0.5 (every expert reaches its capacity here) keeps
    exactly moe_activation_bytes' difference less than with factor 4 (no drop): the expert
    inputs, fc1's and the activation's outputs of the dropped half; the expert outputs the
    combine keeps stay whole."""
    from ptdp.planner.moe import moe_activation_bytes
    measured, modelled = [], []
    for factor in (4.0, 0.5):
        cfg = ModelConfig(arch="gpt", num_layers=1, hidden_size=64, num_heads=4, seq_length=32,
                          vocab_size=100, dropout=0.0, num_experts=4, moe_top_k=2,
                          moe_ffn_hidden_size=96, moe_capacity_factor=factor)
        ctx = ModelContext(cfg, TensorParallel(), 1234,
                           TensorParallelRNG(1234, 0, torch.device("cpu")),
                           padded_vocab_size(cfg.vocab_size, 1))
        torch.manual_seed(0)
        layer = TransformerLayer(ctx, 0, causal=True)
        measured.append(_saved_activation_bytes(layer, torch.randn(32, B, 64)))
        modelled.append(moe_activation_bytes(ModelShape.from_config(cfg), 32 * B, 1, 4))
    assert measured[0] - measured[1] == modelled[0] - modelled[1] == \
        0.5 * 2 * 64 * (64 + 2 * 96) * 4
