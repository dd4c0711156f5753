"""Compute time of one tensor-parallel shard of a transformer layer, the embedding and the head.

Two sources, in order of preference:
1. the profile's `measured` table (from `ptdp profile`), when it holds this exact shape and
   block (rows without block keys were measured on the dissertation's GPT block); times are
   interpolated linearly in the micro-batch size;
2. an analytic roofline per kernel: GEMMs at an efficiency that depends on their shape
   (see `hardware.Efficiency`), attention kernels, memory-bound elementwise kernels, and a
   launch cost per kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ptdp.config.recompute import selective_modules
from ptdp.hardware import HardwareProfile
from ptdp.planner.formulas import ModelShape
from ptdp.planner.latent import attention_elementwise, attention_gemms

BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class LayerTimes:
    """Seconds for one micro-batch through one layer shard (no communication)."""

    forward: float
    backward: float
    attention_forward: float   # the core attention part of `forward` (recomputed by core_attn)
    backward_split: float      # backward as zb-h1 runs it: B now, W held back for a bubble


@dataclass(frozen=True)
class HeadTimes:
    """Embedding on the first stage; final LayerNorm + logits + loss on the last."""

    embed_forward: float
    embed_backward: float
    head_forward: float
    head_backward: float
    embed_backward_split: float   # as zb-h1 runs them (B, then W later)
    head_backward_split: float


def _sat(x: float, half: float) -> float:
    return x / (x + half)


def gemm_time(hw: HardwareProfile, precision: str, m: float, n: float, k: float,
              count: float = 1.0) -> float:
    """`count` independent [m,k]x[k,n] GEMMs (a batched GEMM when count > 1)."""
    eff = hw.efficiency
    shape_eff = _sat(m, eff.gemm_half_dim) * _sat(n, eff.gemm_half_dim) * _sat(k, eff.gemm_half_dim)
    flops = 2.0 * m * n * k * count
    compute = flops / (hw.peak_flops(precision) * eff.gemm_max * shape_eff)
    traffic = (m * k + k * n + m * n) * count * BYTES[precision]
    memory = traffic / (hw.memory_bandwidth_GBps * 1e9 * eff.memory)
    return max(compute, memory) + eff.kernel_launch_us * 1e-6


def elementwise_time(hw: HardwareProfile, nbytes: float, kernels: int) -> float:
    eff = hw.efficiency
    return nbytes / (hw.memory_bandwidth_GBps * 1e9 * eff.memory) + kernels * eff.kernel_launch_us * 1e-6


def _attention_times(hw, precision, shape: ModelShape, b: int, t: int, attention: str):
    """Forward and backward seconds of softmax(QK^T)V for the rank's heads: scores of
    qk_head_dim values per query and key head, probabilities times V of v_head_dim (both
    head_dim but with latent attention)."""
    s, dh, dv = shape.seq, shape.qk_head_dim, shape.v_head_dim
    heads = b * shape.heads / t
    e = BYTES[precision]
    if attention == "flash":
        # One fused kernel; backward recomputes scores and does 5 matmuls against 2 -> 2.5x.
        # A causal kernel skips the tiles above the diagonal: half the work (measured on one
        # H200: GPT-1.3B's attention took 0.41x what the full square predicts, docs/performance.md).
        eff = hw.efficiency
        shape_eff = _sat(s, eff.gemm_half_dim) * _sat(dh, eff.gemm_half_dim)
        flops = 2.0 * s * s * (dh + dv) * heads * (0.5 if shape.family.causal else 1.0)
        fwd = flops / (hw.peak_flops(precision) * eff.gemm_max * eff.attention * shape_eff)
        fwd += eff.kernel_launch_us * 1e-6
        return fwd, 2.5 * fwd
    scores = gemm_time(hw, precision, s, s, dh, heads) + gemm_time(hw, precision, s, dv, s, heads)
    # fused scale+mask+softmax (+dropout): read and write the [b, a/t, s, s] scores.
    softmax = elementwise_time(hw, 2 * heads * s * s * e, 1 + shape.dropout)
    return scores + softmax, 2 * scores + 2 * softmax


def layer_kernel(hw, shape: ModelShape, attention: str) -> str:
    """The kernel `shape`'s layers really run for `attention` (attention_kernel's): on CPU
    torch's fused SDPA kernel takes equal query/key and value head sizes only, so latent
    attention with v_head_dim != qk_head_dim (DeepSeek's) runs the math path there, which
    keeps the s x s probabilities as a materialized kernel does. (CUDA's memory-efficient
    kernel takes unequal sizes: flash-like.)"""
    unequal = shape.qk_head_dim != shape.v_head_dim
    cpu = hw is not None and hw.device == "cpu"
    return "materialized" if attention == "flash" and cpu and unequal else attention


def _analytic_layer(hw, precision, shape: ModelShape, b: int, t: int, attention: str) -> LayerTimes:
    """The layer's GEMMs: QKV h -> h_q + 2h_kv (grouped-query attention narrows K and V), the
    projection h_q -> h, fc1 h -> f or, gated, h -> 2f (gate and up), and fc2 f -> h, each
    split by t; attention over the rank's query heads; the elementwise kernels. Latent
    attention's GEMMs and kernels (latent.attention_gemms, latent.attention_elementwise)
    replace QKV, the projection, the head copies and the rotary ones."""
    s, h, f, q = shape.seq, shape.hidden, shape.ffn, shape.q_hidden
    kv, g = shape.kv_hidden, shape.gated
    tokens = b * s
    e = BYTES[precision]
    gemms = [(tokens, (q + 2 * kv) / t, h), (tokens, h, q / t), (tokens, (1 + g) * f / t, h),
             (tokens, h, f / t)]
    if shape.latent:
        gemms = attention_gemms(shape, tokens, t) + gemms[2:]
    fwd_gemm = sum(gemm_time(hw, precision, m, n, k) for m, n, k in gemms)
    # Backward: data gradient [m,n]x[n,k] and weight gradient [k,m]x[m,n] per forward GEMM.
    bwd_gemm = sum(gemm_time(hw, precision, m, k, n) + gemm_time(hw, precision, k, n, m)
                   for m, n, k in gemms)
    attn_fwd, attn_bwd = _attention_times(hw, precision, shape, b, t,
                                          layer_kernel(hw, shape, attention))
    # Elementwise traffic (elements): 2 norms (LayerNorm or RMSNorm) 4sbh, 2 bias+dropout+
    # residual 6sbh, bias+GeLU 2sf/t (SwiGLU reads gate and up, writes their product: 3sf/t),
    # head split/merge copies 4s(h_q + h_kv)/t (8sh/t without grouped-query attention), and
    # rotary positions read and write Q and K, 2s(h_q + h_kv)/t, and so does QK-norm;
    # backward moves about twice.
    rope = 2 * (q + kv) / t if shape.rope else 0
    qk_norm = 2 * (q + kv) / t if shape.qk_norm else 0
    elems = tokens * (10 * h + (2 + g) * f / t + 4 * (q + kv) / t + rope + qk_norm)
    kernels = 10 + (2 if shape.rope else 0) + (2 if shape.qk_norm else 0)
    if shape.latent:
        latent_elems, latent_kernels = attention_elementwise(shape, t)
        elems, kernels = tokens * (10 * h + (2 + g) * f / t + latent_elems), 10 + latent_kernels
    fwd_elem = elementwise_time(hw, elems * e, kernels)
    bwd_elem = elementwise_time(hw, 2 * elems * e, 2 * kernels)
    backward = bwd_gemm + attn_bwd + bwd_elem
    return LayerTimes(forward=fwd_gemm + attn_fwd + fwd_elem, backward=backward,
                      attention_forward=attn_fwd, backward_split=backward)


def _analytic_head(hw, precision, shape: ModelShape, b: int, t: int, vocab_padded: int) -> HeadTimes:
    tokens, h = b * shape.seq, shape.hidden
    e = BYTES[precision]
    # gather + position add (rotary positions: the gather alone); backward scatter-adds
    traffic, kernels = (2, 1) if shape.rope else (3, 3)
    embed_fwd = elementwise_time(hw, traffic * tokens * h * e, kernels)
    embed_bwd = elementwise_time(hw, traffic * tokens * h * e, kernels)
    rows = shape.head_rows(tokens)   # BERT: the masked positions only
    logits = gemm_time(hw, precision, rows, vocab_padded / t, h)
    logits_bwd = (gemm_time(hw, precision, rows, h, vocab_padded / t)
                  + gemm_time(hw, precision, h, vocab_padded / t, rows))
    # Cross-entropy in fp32 over [rows, V/t]: max, exp-sum, loss forward; softmax-grad backward.
    ce_bytes = rows * vocab_padded / t * 4
    layer_norm = elementwise_time(hw, 2 * tokens * h * e, 1)   # the final norm: every token
    head_fwd = logits + layer_norm + elementwise_time(hw, 3 * ce_bytes, 4)
    head_bwd = logits_bwd + 2 * layer_norm + elementwise_time(hw, 2 * ce_bytes, 2)
    if shape.bert_heads:  # LM transform (dense h x h, GeLU, LayerNorm) before the logits
        dense = gemm_time(hw, precision, rows, h, h)
        head_fwd += dense + elementwise_time(hw, 4 * rows * h * e, 2)
        head_bwd += 2 * dense + elementwise_time(hw, 8 * rows * h * e, 4)
    return HeadTimes(embed_fwd, embed_bwd, head_fwd, head_bwd, embed_bwd, head_bwd)


# --------------------------------------------------------------------------------------------
# Measured profiles
# --------------------------------------------------------------------------------------------

def _interpolate(points: list[tuple[int, float]], b: int) -> float:
    """Piecewise-linear in b through the measured points, extended linearly past the ends
    (per-sample cost is close to constant for large b)."""
    points = sorted(points)
    if len(points) == 1:
        b0, y0 = points[0]
        return y0 * b / b0
    i = 0
    while i < len(points) - 2 and b > points[i + 1][0]:
        i += 1
    (b0, y0), (b1, y1) = points[i], points[i + 1]
    return max(y0 + (y1 - y0) * (b - b0) / (b1 - b0), 1e-9)


def _measured_rows(hw: HardwareProfile, table: str, match: dict) -> list[dict]:
    rows = (hw.measured or {}).get(table) or []
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def same_block(row: dict, shape: ModelShape) -> bool:
    """A measured layer row is of this shape's block: rows without the block's keys were
    measured on the dissertation's GPT block (ModelShape's defaults, K/V heads = heads).
    Head rows match by sizes only: the final norm and the position add are a small part of
    the logits' time."""
    gpt = ModelShape(shape.arch, shape.layers, shape.hidden, row.get("heads", shape.heads),
                     shape.ffn, shape.seq, shape.vocab, shape.dropout).block_key()
    return all(row.get(k, gpt[k]) == v for k, v in shape.block_key().items())


def _measured_layer_rows(hw, table: str, precision, shape: ModelShape, t: int, **match):
    rows = _measured_rows(hw, table, dict(hidden=shape.hidden, heads=shape.heads, ffn=shape.ffn,
                                          seq=shape.seq, tensor=t, precision=precision, **match))
    return [r for r in rows if same_block(r, shape)]


def _measured_layer(hw, precision, shape: ModelShape, b: int, t: int) -> LayerTimes | None:
    rows = _measured_layer_rows(hw, "layers", precision, shape, t)
    if not rows:
        return None
    fwd = _interpolate([(r["micro_batch"], r["forward_s"]) for r in rows], b)
    bwd = _interpolate([(r["micro_batch"], r["backward_s"]) for r in rows], b)
    share = [(r["micro_batch"], r.get("attention_forward_s", 0.0)) for r in rows]
    split = [(r["micro_batch"], r["backward_split_s"]) for r in rows if "backward_split_s" in r]
    return LayerTimes(fwd, bwd, _interpolate(share, b) if any(y for _, y in share) else 0.2 * fwd,
                      _interpolate(split, b) if len(split) == len(rows) else bwd)


def _measured_head(hw, precision, shape: ModelShape, b: int, t: int, vocab_padded: int):
    rows = _measured_rows(hw, "heads", dict(hidden=shape.hidden, seq=shape.seq, tensor=t,
                                            vocab=vocab_padded, precision=precision))
    if not rows:
        return None
    def pick(key, fallback=None):
        if fallback and not all(key in r for r in rows):
            return pick(fallback)
        return _interpolate([(r["micro_batch"], r[key]) for r in rows], b)
    # (rows measured over every token, `ptdp profile`'s logits and loss; BERT's head computes
    # the masked share of them, its final norm a small part of the time)
    share = shape.head_rows(1.0)
    return HeadTimes(pick("embed_forward_s"), pick("embed_backward_s"),
                     share * pick("head_forward_s"), share * pick("head_backward_s"),
                     pick("embed_backward_split_s", "embed_backward_s"),
                     share * pick("head_backward_split_s", "head_backward_s"))


def measured_tensor_comm(hw: HardwareProfile, precision: str, shape: ModelShape, b: int, t: int,
                         sequence_parallel: bool, busy: int) -> float | None:
    """Seconds the tensor group's communication adds to one layer's forward + backward, as
    measured with `busy` ranks at once (ptdp/profiler/tensor_layers.py; CPU profiles), or None."""
    rows = _measured_layer_rows(hw, "tensor_layers", precision, shape, t,
                                sequence_parallel=sequence_parallel)
    if not rows:
        return None
    world = min({r["world"] for r in rows}, key=lambda w: (abs(math.log2(w / max(busy, 1))), -w))
    return _line([(r["micro_batch"], r["comm_s"]) for r in rows if r["world"] == world], b)


def _line(points: list[tuple[int, float]], b: int) -> float:
    """The least-squares line through (b, seconds) at b, never negative: waits on a busy node
    are noisy point by point, the trend in b is not (latency plus bytes)."""
    if len({x for x, _ in points}) < 2:
        return _interpolate(points, b)
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
             / sum((x - mean_x) ** 2 for x, _ in points))
    return max(mean_y + slope * (b - mean_x), 0.0)


@lru_cache(maxsize=65536)
def layer_times(hw: HardwareProfile, precision: str, shape: ModelShape, b: int, t: int,
                attention: str) -> LayerTimes:
    return (_measured_layer(hw, precision, shape, b, t)
            or _analytic_layer(hw, precision, shape, b, t, attention))


@lru_cache(maxsize=65536)
def head_times(hw: HardwareProfile, precision: str, shape: ModelShape, b: int, t: int,
               vocab_padded: int) -> HeadTimes:
    return (_measured_head(hw, precision, shape, b, t, vocab_padded)
            or _analytic_head(hw, precision, shape, b, t, vocab_padded))


def attention_kernel(attention: str, context: int) -> str:
    """The kernel a layer's attention is modelled with: the profile's or --attention's, but
    with context parallelism the ring's blocks keep no scores, whatever the kernel
    (ptdp/parallel/ring_attention.py)."""
    return "flash" if context > 1 else attention


def planned_modules(recompute: str, modules, sequence_parallel: bool, attention: str) -> tuple:
    """The one rule of what a plan recomputes, read by its memory, compute and context-ring
    terms: recompute=selective's modules (`modules`, train.recompute_modules; None: the
    default), with core_attn added to the default where `attention` (attention_kernel's) keeps
    the scores. The trainer resolves the same way with flash attention (models/transformer.py),
    so where the two differ, a materialized plan's unpinned default, `ptdp plan
    --write-config` writes the modules out (report.trainer_config)."""
    if recompute != "selective":
        return ()
    return selective_modules(modules, sequence_parallel, keeps_scores=attention != "flash")


def recompute_seconds(hw: HardwareProfile, precision: str, shape: ModelShape, b: int, t: int,
                      attention: str, lt: LayerTimes, recompute: str,
                      modules: tuple | None = None, sequence_parallel: bool = False) -> float:
    """Seconds one layer's recomputation adds per micro-batch: a whole forward (`full`), or
    recompute=selective's modules (planned_modules; None: the default for this attention):
    core_attn the attention forward; layernorm the two norms (read x, write the
    output: 4sbh elements); activation its kernel ((2 + g)sbf/t elements); mlp fc1 and fc2's
    forward GEMMs and the activation. (fc2's all-reduce, which mlp repeats, is tensor
    communication: cost_model.py.)"""
    if recompute != "selective":
        return lt.forward if recompute == "full" else 0.0
    modules = planned_modules(recompute, modules, sequence_parallel, attention)
    e, tokens, h, f, g = BYTES[precision], b * shape.seq, shape.hidden, shape.ffn, shape.gated
    seconds = lt.attention_forward if "core_attn" in modules else 0.0
    if "layernorm" in modules:
        seconds += elementwise_time(hw, 4 * tokens * h * e, 2)
    if "mlp" in modules or "activation" in modules:
        seconds += elementwise_time(hw, (2 + g) * tokens * f / t * e, 1)
    if "mlp" in modules:
        seconds += (gemm_time(hw, precision, tokens, (1 + g) * f / t, h)
                    + gemm_time(hw, precision, tokens, h, f / t))
    return seconds


def recompute_collectives(recompute: str, modules: tuple | None = None) -> int:
    """Tensor-parallel collectives a layer's recomputation repeats per micro-batch: a full
    recompute the forward's 2, selective's mlp module fc2's 1."""
    if recompute == "full":
        return 2
    return int(recompute == "selective" and "mlp" in (modules or ()))
