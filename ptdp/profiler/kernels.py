"""Kernel times of one rank: a transformer layer's shard, the embedding and head, the device's
GEMM rate and memory bandwidth, and the optimizer step."""

from __future__ import annotations

from ptdp.planner.formulas import ModelShape
from ptdp.profiler.timing import DTYPES, best_time, layer_context, param_storages, saved_bytes


def measure_layer(model_cfg, t: int, b: int, precision: str, device, iters: int) -> dict:
    """One row of `measured.layers`: a layer shard's times and bytes at micro-batch b, compiled
    as training compiles it by default (on CUDA: train.compile's null; the first timed call
    of each is a warm-up, which absorbs the compilation). The split backward of zb-h1 is timed
    eagerly, as it runs (ptdp/parallel/weight_grad.py)."""
    import torch
    from ptdp.kernels import should_compile
    from ptdp.models.transformer import TransformerStack
    from ptdp.parallel.weight_grad import defer_weight_grads
    dtype = getattr(torch, DTYPES[precision])
    causal = model_cfg.family.causal
    m = model_cfg
    row = dict(hidden=m.hidden_size, heads=m.num_heads, ffn=m.ffn_hidden_size, seq=m.seq_length,
               tensor=t, precision=precision, micro_batch=b,
               **ModelShape.from_config(m).block_key())   # which block the times are of
    x = torch.randn(m.seq_length, b, m.hidden_size, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    compiled = should_compile(None, device)
    row["compiled"] = compiled
    for recompute in ("none", "full"):   # selective's: "none" less memory.selective_saving
        stack = TransformerStack(layer_context(m, t, device, recompute, compiled), 0, 1,
                                 causal).to(device, dtype)
        stack.train()
        out, nbytes = saved_bytes(lambda: stack(x), param_storages(stack) | {x.untyped_storage().data_ptr()})
        out.backward(grad)
        # The layer input is kept by the previous layer's LayerNorm or the checkpoint: count it.
        row[f"activation_bytes_{recompute}"] = nbytes + x.numel() * x.element_size()
        if recompute == "none":
            layer = stack
    state = {}

    def forward():
        state["y"] = layer(x)

    def backward():
        state["y"].backward(grad)

    row["forward_s"] = best_time(forward, device, iters)
    fwd_bwd = best_time(lambda: (forward(), backward()), device, iters)
    row["backward_s"] = max(fwd_bwd - row["forward_s"], 1e-9)
    row["attention_forward_s"] = _attention_time(layer.layers[0].attention, x, device, iters)
    split = TransformerStack(layer_context(m, t, device), 0, 2, causal).to(device, dtype)
    row["backward_split_s"] = _split_backward_time(   # per layer: 2 layers, halved
        defer_weight_grads(split), lambda: split(x), lambda out: out.backward(grad), device,
        iters) / 2
    return row


def _split_backward_time(queue, forward, backward, device, iters: int,
                         deferred: int = 4) -> float:
    """Seconds of one micro-batch's backward split in two, B now and W later (zb-h1):
    `forward()` returns what `backward(out)` back-propagates, its weight gradients deferred to
    `queue`; the `deferred` micro-batches' B passes all run before their W passes, as when a
    rank holds W back for a bubble. The W pass then finds its inputs gone from the caches,
    which costs more than the split itself (on a CPU core: ~10-25 % over a plain backward)."""
    forwards = best_time(lambda: [forward() for _ in range(deferred)], device, iters)

    def split_passes():
        for mb, out in enumerate([forward() for _ in range(deferred)]):
            with queue.defer(mb):
                backward(out)
        for mb in range(deferred):
            queue.run(mb)

    total = best_time(split_passes, device, iters)
    return max(total - forwards, 1e-9) / deferred


def _attention_time(attention, x, device, iters: int) -> float:
    import torch
    s, b, _ = x.shape
    heads = attention.local_heads
    q, k, v = (torch.randn(b, heads, s, dh, device=device, dtype=x.dtype, requires_grad=True)
               for dh in (attention.qk_head_dim, attention.qk_head_dim, attention.v_head_dim))
    return best_time(lambda: attention.core_attention(q, k, v, None), device, iters)


def measure_head(model_cfg, t: int, b: int, precision: str, device, iters: int) -> dict:
    """One row of `measured.heads`: embedding and final LN + logits + loss at micro-batch b, the
    loss fused as training runs it by default (compiled on CUDA: train.compile's null)."""
    import torch
    from ptdp.kernels import should_compile
    from ptdp.models.embedding import Embedding, logits
    from ptdp.models.norms import layer_norm
    from ptdp.parallel.cross_entropy import vocab_parallel_cross_entropy
    from ptdp.parallel.weight_grad import defer_weight_grads
    m = model_cfg
    dtype = getattr(torch, DTYPES[precision])
    ctx = layer_context(m, t, device, compile=should_compile(None, device))
    embedding = Embedding(ctx).to(device, dtype)
    final_ln = layer_norm(m.hidden_size, m.layernorm_eps).to(device, dtype)
    tokens = torch.randint(0, m.vocab_size, (b, m.seq_length), device=device)
    hidden = torch.randn(m.seq_length, b, m.hidden_size, device=device, dtype=dtype,
                         requires_grad=True)
    state = {}

    def embed():
        state["e"] = embedding(tokens)

    def head():
        out = logits(final_ln(hidden), embedding.word.weight, ctx)
        state["h"] = vocab_parallel_cross_entropy(out, tokens.t(), m.vocab_size, ctx.tp,
                                                  fused=ctx.compile).mean()

    row = dict(hidden=m.hidden_size, seq=m.seq_length, tensor=t, vocab=ctx.padded_vocab_size,
               precision=precision, micro_batch=b)
    row["embed_forward_s"] = best_time(embed, device, iters)
    grad = torch.randn(m.seq_length, b, m.hidden_size, device=device, dtype=dtype)
    both = best_time(lambda: (embed(), state["e"].backward(grad)), device, iters)
    row["embed_backward_s"] = max(both - row["embed_forward_s"], 1e-9)
    row["head_forward_s"] = best_time(head, device, iters)
    both = best_time(lambda: (head(), state["h"].backward()), device, iters)
    row["head_backward_s"] = max(both - row["head_forward_s"], 1e-9)
    split_embedding = Embedding(ctx).to(device, dtype)
    queue = defer_weight_grads(split_embedding)
    row["embed_backward_split_s"] = _split_backward_time(
        queue, lambda: split_embedding(tokens), lambda out: out.backward(grad), device, iters)
    row["head_backward_split_s"] = _split_backward_time(
        queue, lambda: vocab_parallel_cross_entropy(
            logits(final_ln(hidden), split_embedding.word.weight, ctx, ops=queue), tokens.t(),
            m.vocab_size, ctx.tp, fused=ctx.compile).mean(),
        lambda loss: loss.backward(), device, iters)
    return row


def _gemm_seconds(m: int, n: int, k: int, dtype, device, iters: int) -> float:
    import torch
    a = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(k, n, device=device, dtype=dtype)
    return best_time(lambda: torch.mm(a, w), device, iters)


def measure_device(precision: str, device, iters: int) -> dict:
    """Peak GEMM FLOP/s, the half-efficiency dimension, HBM/DRAM bandwidth, launch cost."""
    import torch
    dtype = getattr(torch, DTYPES[precision])
    big = 4096 if device.type == "cuda" else 768
    peak = 2 * big**3 / _gemm_seconds(big, big, big, dtype, device, iters)
    launch = best_time(lambda: torch.add(torch.ones(1, device=device), 1), device, iters * 20)
    shapes = [(32, 32, 32), (64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 64, 512),
              (512, 512, 32), (1024, 128, 256)]
    samples = [(shape, _gemm_seconds(*shape, dtype, device, iters)) for shape in shapes]
    nbytes = (256 if device.type == "cuda" else 64) * 2**20
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * nbytes / best_time(lambda: dst.copy_(src), device, iters)
    return {"peak_flops": peak, "launch_s": launch, "memory_Bps": bandwidth,
            "half_dim": fit_half_dim(samples, peak, launch),
            "optimizer_s_per_param": measure_optimizer(device, iters)}


def measure_optimizer(device, iters: int, numel: int = 2**22) -> float:
    """Seconds per parameter of clip-by-global-norm + AdamW step (what the trainer runs after
    backward); on CPU the foreach implementation makes several passes over the state."""
    import torch
    params = [torch.nn.Parameter(torch.randn(numel // 8, device=device)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True if device.type == "cuda" else None)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    return best_time(step, device, iters) / numel


def fit_half_dim(samples, peak: float, launch: float) -> float:
    """The gemm_half_dim that best explains the measured GEMM times (log-error grid search)."""
    import math

    def error(half):
        total = 0.0
        for (m, n, k), seconds in samples:
            sat = (m / (m + half)) * (n / (n + half)) * (k / (k + half))
            predicted = 2 * m * n * k / (peak * sat) + launch
            total += math.log(predicted / seconds) ** 2
        return total

    return min((1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256), key=error)
