"""Multi-head latent attention (DeepSeek-V2/V3; models/latent_attention.py) in the planner: one
layer's attention parameters, forward FLOPs, GEMMs and the activations it keeps. Torch-free, and
free of the other planner modules (formulas.py builds on it), so it takes any object with
ModelShape's fields (ptdp/planner/formulas.py); `shape.latent` is true (mla_kv_lora > 0).

Sizes: h hidden, a heads (every head its own keys and values: kv_heads = a), n = head_dim each
query and key head's non-rotary part, r = mla_rope_dim its rotary part, v = mla_v_dim each
value head, L_q = mla_q_lora the query latent (0: queries from h directly), L_kv = mla_kv_lora
the key/value latent. The layer's attention is

* queries: q_down [L_q, h] (replicated on the tensor ranks), q_norm over L_q, q_up [a(n+r),
  L_q] (column-parallel: split by t); without a query latent one q [a(n+r), h] (split by t);
* keys and values: kv_down [L_kv + r, h] (replicated: the latent's rows and the one rotary key
  every head shares), kv_norm over L_kv (replicated), kv_up [a(n+v), L_kv] (split by t);
* the projection [h, a v] (row-parallel, split by t) and its bias h when the model has biases
  (replicated); no Q/K/V biases, no QK-norm;
* scores over query/key heads of n + r values, and probabilities times values of v.

The tensor group's communication is the usual block's (the down-projections run where the
hidden state is; the two h-wide all-reduces per layer, forward and backward)."""

from __future__ import annotations


def latent_fields(m) -> dict:
    """ModelShape's latent-attention fields of a ModelConfig (none without it, whatever its
    mla_* keys say: the fields' defaults mean "off")."""
    if not m.latent_attention:
        return {}
    return dict(mla_kv_lora=m.mla_kv_lora_rank, mla_q_lora=m.mla_q_lora_rank,
                mla_rope_dim=m.mla_rope_head_dim, mla_v_dim=m.mla_v_head_dim)


def _query_rows(shape) -> int:
    """a(n + r): the queries' (and the keys') width."""
    return shape.heads * (shape.head_dim + shape.mla_rope_dim)


def attention_parameter_split(shape) -> tuple[int, int]:
    """(split by t, replicated) parameters of one layer's latent attention:

    split: q_up a(n+r) L_q (or q a(n+r) h), kv_up a(n+v) L_kv, the projection a v h;
    replicated: q_down L_q h and q_norm's n_p L_q (with a query latent), kv_down (L_kv + r) h,
    kv_norm's n_p L_kv, the projection's bias h (with model biases); n_p = 2 for LayerNorm's
    weight and bias, 1 for RMSNorm's gain."""
    h, a, n, v = shape.hidden, shape.heads, shape.head_dim, shape.mla_v_dim
    lq, lkv, norm = shape.mla_q_lora, shape.mla_kv_lora, shape.norm_parameters
    q_rows = _query_rows(shape)
    split = (q_rows * lq if lq else q_rows * h) + a * (n + v) * lkv + a * v * h
    replicated = ((lq * h + norm * lq if lq else 0) + (lkv + shape.mla_rope_dim) * h
                  + norm * lkv + (h if shape.bias else 0))
    return split, replicated


def attention_gemms(shape, tokens: float, t: int) -> list[tuple[float, float, float]]:
    """The attention's forward GEMMs on one tensor rank as (m, n, k), [m, k] x [k, n]: the
    replicated down-projections over every token the rank runs (all of them without sequence
    parallelism: the planner's layer times assume so, an overestimate with it), the
    up-projections and the projection split by t."""
    h, a, n, v = shape.hidden, shape.heads, shape.head_dim, shape.mla_v_dim
    lq, lkv, r = shape.mla_q_lora, shape.mla_kv_lora, shape.mla_rope_dim
    q_rows = _query_rows(shape)
    queries = ([(tokens, lq, h), (tokens, q_rows / t, lq)] if lq
               else [(tokens, q_rows / t, h)])
    return queries + [(tokens, lkv + r, h), (tokens, a * (n + v) / t, lkv),
                      (tokens, h, a * v / t)]


def attention_forward_flops(shape, batch: float) -> float:
    """Forward FLOPs of one layer's latent attention, 2 per multiply-add, T = B s tokens:

    * GEMMs, 2 T in out each: q_down 2T h L_q and q_up 2T L_q a(n+r) (or q 2T h a(n+r)),
      kv_down 2T h (L_kv + r), kv_up 2T L_kv a(n+v), the projection 2T a v h;
    * scores over s keys per query, width a(n+r): 2 B s^2 a(n+r); probabilities times V:
      2 B s^2 a v (Eq. 4.2's convention of s keys per query, causal or not)."""
    s = float(shape.seq)
    tokens = float(batch) * s
    gemms = sum(2.0 * tokens * n * k for _, n, k in attention_gemms(shape, tokens, 1))
    scores = 2.0 * batch * s * s * (_query_rows(shape) + shape.heads * shape.mla_v_dim)
    return gemms + scores


def attention_elementwise(shape, t: int) -> tuple[float, int]:
    """(elements per token, kernels) of the attention's memory-bound kernels on one tensor
    rank, forward: the two latent norms (read and write L_q + L_kv), the rotary parts (read
    and write a r / t of the queries and r of the shared key), the copies that assemble Q and K
    and split off V (read and write 2a(n+r)/t + a(n+v)/t) and merge the heads' outputs (a v/t)."""
    a, n, v = shape.heads, shape.head_dim, shape.mla_v_dim
    lq, lkv, r = shape.mla_q_lora, shape.mla_kv_lora, shape.mla_rope_dim
    norms = 2 * (lq + lkv)
    rope = 2 * (a * r / t + r)
    copies = 2 * (2 * _query_rows(shape) + a * (n + v) + a * v) / t
    kernels = (2 if lq else 1) + 2 + 3   # latent norms; rotations; Q, K concatenations, merge
    return norms + rope + copies, kernels


def latent_activation_bytes(shape, b: int, t: int, e: float, sequence_parallel: bool) -> float:
    """Bytes a layer keeps for backward outside the tensor-split region, beyond the block's
    norm, QKV and fc1 inputs (memory.sequence_parallel_replicated), with T = s b tokens and e
    bytes an element: the query latent's down-projection output (q_norm's input, T L_q) and
    normalised latent (q_up's input, T L_q); kv_down's output (kv_norm's input is a view of
    it, so all L_kv + r rows stay) and the normalised latent (kv_up's input, T L_kv). The
    norms' inputs are on the rank's tokens, T/t with sequence parallelism; the
    up-projections' inputs are kept all-gathered, whole.

    On the safe side it also counts what the block's count leaves out, which a latent layer's
    small tensors make matter: every norm's fp32 statistics (the two block norms and the one
    or two latent ones, 8 bytes a token each: LayerNorm's mean and rstd; RMSNorm keeps one)
    and the rotary tables, cos and sin of r values per position, 8 b s r bytes (per sample;
    fp32, or two casts for Q's and K's rotations in 16 bits)."""
    lq, lkv, r = shape.mla_q_lora, shape.mla_kv_lora, shape.mla_rope_dim
    tokens = shape.seq * b
    local = tokens / (t if sequence_parallel else 1)
    norms = 3 + (1 if lq else 0)
    return ((local * (lq + lkv + r) + tokens * (lq + lkv)) * e + local * norms * 8
            + 8 * tokens * r)


def split_activation_elements(shape, tokens: float) -> float:
    """Elements a layer keeps in the tensor-split region before the division by t (the MLP's
    aside): Q and K, a(n+r) each (new tensors: the non-rotary part concatenated with the
    rotated one, the key's shared rotary part expanded to every head), kv_up's output a(n+v)
    (V is a view of it, so it stays whole) and the projection's input a v (the heads' outputs
    merged: a copy). A flash kernel's output, a v, is the attention term's (memory.py)."""
    a, n, v = shape.heads, shape.head_dim, shape.mla_v_dim
    return tokens * (2 * _query_rows(shape) + a * (n + v) + a * v)


def pending_elements(shape, tokens: float, sequence_parallel: bool, t: int) -> float:
    """Elements one layer's deferred weight gradients hold between ZB-H1's B and W passes
    (memory.pending_weight_grad_bytes), beyond the block's h-wide inputs and output gradients
    and its two norms: the tensor-split output gradients of q_up (or q) a(n+r) and kv_up
    a(n+v) and the projection's input a v, over t; the latents': q_down's and kv_down's output
    gradients (L_q, L_kv + r), the latent norms' inputs (L_q, L_kv + r) and output gradients
    (L_q, L_kv), on the rank's tokens; q_up's and kv_up's inputs (L_q, L_kv), whole."""
    a, n, v = shape.heads, shape.head_dim, shape.mla_v_dim
    lq, lkv, r = shape.mla_q_lora, shape.mla_kv_lora, shape.mla_rope_dim
    local = tokens / (t if sequence_parallel else 1)
    split = tokens * (_query_rows(shape) + a * (n + v) + a * v) / t
    return split + local * (3 * lq + 3 * lkv + 2 * r) + tokens * (lq + lkv)
