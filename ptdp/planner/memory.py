"""Memory per GPU: weights, gradients, optimizer state, activation stashes, buffers.

Weights, gradients and optimizer state follow the stage's parameters: its layers'
(formulas.layer_parameter_split: the tensor-split part / t plus the replicated biases and
norms), the word table and learned positions on the first stage, the final norm and the
output layer on the last (the tied word table's copy, or the untied output layer of its own,
which the first stage then does not share even with p = 1).

Activations per layer follow the breakdown of Korthikanti et al. (Megatron "Reducing
activation recomputation") for a pre-norm layer with t-way tensor parallelism, generalised to
any ffn size, precision, attention kernel and block (formulas.ModelShape). Elements of e
bytes each, with h_kv the width of K and of V (h without grouped-query attention) and f the
MLP width:

* replicated on every tensor rank: the two norms' inputs 2sbh (RMSNorm keeps its input as
  LayerNorm does; both keep s*b statistics, not counted), the QKV and fc1 inputs 2sbh, and
  1-byte dropout masks 2sbh when dropout > 0;
* split by t: Q, K, V s*b*(h_q + 2h_kv)/t, the projection input s*b*h_q/t (h_q = heads *
  head_dim, h unless model.head_dim sets d), and the MLP's
  activation input and output: GeLU's 2sbf/t, SwiGLU's gate and up 2sbf/t plus their product
  (fc2's input) sbf/t.
  Rotary positions add the rotated Q and K, s*b*(h_q + h_kv)/t, which attention keeps while V,
  a view, keeps the QKV output alive (models/rotary.py). A flash kernel also saves the
  attention output s*b*h_q/t. QK-norm adds the normalised Q and K its gains multiply,
  s*b*(h_q + h_kv)/t (its input is the QKV output, already counted);
* attention scores (materialized kernels only): softmax output and dropout output
  2*a*s^2*b/t elements plus the 1-byte mask, a the query heads.

Latent attention (ptdp/planner/latent.py: a heads of n + r query/key and v value values, latents
of L_q and L_kv) keeps, beside the norms', the down-projections' (QKV's) and fc1's inputs: the
latent norms' inputs s*b*(L_q + L_kv + r) (kv_down's whole output, of which the latent is a
view; on the rank's tokens, 1/t with sequence parallelism) and the up-projections' inputs
s*b*(L_q + L_kv) (whole); split by t, Q and K s*b*a(n+r) each (concatenations that hold the
rotated parts: nothing more for rotary positions), kv_up's output s*b*a(n+v) (V, a view, keeps
it) and the projection input s*b*a*v (the heads' outputs merged, a copy); a flash kernel's
output s*b*a*v/t; and, on the safe side, every norm's fp32 statistics and the rotary tables
(latent.latent_activation_bytes). On CPU, torch's fused attention takes equal query/key and
value head sizes only: with unequal ones (DeepSeek's) the math path keeps the s x s
probabilities, counted as a materialized kernel's (compute.layer_kernel). Measured on tiny
eager LayerNorm layers without dropout, the count is at or above what they keep, recompute
none or selective.

With f = 4h, h_kv = h, GeLU, learned positions, e = 2 and dropout this is the paper's
sbh(34 + 5as/h) at t = 1: (4 + 4 + 2 + 6 + 2 + 16) sbh + 5as^2b. A Llama-style layer (SwiGLU,
rotary, no dropout) keeps, split part per token, 2h + 2h_kv + 3f + h + h_kv elements instead
of 4h + 2f. SwiGLU and RMSNorm are counted as fused (compiled) kernels keep them, as the
trainer runs layers on GPUs; eager layers (CPU ranks) also keep SiLU(gate), sbf/t, and each
RMSNorm's normalised output, sbh (models/norms.py): measured on one h = 64 layer, about 20 %
more than this count, where the GPT block's measures 7 % less.
With sequence parallelism the norms' inputs and the dropout masks are split by t as well
(`sequence_parallel_replicated`); the QKV and fc1 inputs are kept all-gathered by the trainer
(Megatron-LM re-gathers them in backward instead), so they stay whole.
Recompute "full" keeps only each layer's input (sbh elements; checkpoints every layer, §4.3.5
"every 1 or 2 layers"). Recompute "selective" keeps what "none" keeps less what its modules
rebuild in backward (`selective_saving` below; the modules: ptdp/config/recompute.py): core_attn the scores (a
materialized kernel) or the fp32 log-sum-exp (flash: its output is the projection's input, a
view of the same storage, so it stays; the "none" count above holds that output twice, as
calibrated); layernorm the QKV and fc1 inputs 2sbh (nothing with sequence parallelism);
activation fc2's input sbf/t; mlp the MLP's split activations (2 + g)sbf/t, and with sequence
parallelism fc1's all-gathered input less the norm's output it keeps. The default modules are
layernorm and activation, plus core_attn for materialized attention (compute.planned_modules).
Measured on tiny eager layers (tests/test_recompute_modules.py) the savings equal these terms,
except that an eager SwiGLU's whole-MLP recomputation also drops SiLU(gate), sbf/t more.

Context parallelism (c > 1, ptdp/parallel/ring_attention.py) splits every sequence over c ranks:
each holds s/c tokens, so every activation term above, the stage-boundary buffers and the
logits shrink by c; attention keeps, as a flash kernel does, its output and fp32 log-sum-exp
of the local queries only (the ring recomputes the other ranks' blocks in backward). While a
layer's ring runs it holds two K/V blocks (the one in use and the one arriving), fp32
accumulators for the output (forward) or dQ, and three fp32 dK/dV blocks (backward: its own
share, the one arriving, the one leaving): a transient (`ring_working_bytes`). Weights,
gradients and optimizer state do not change, except that the distributed optimizer shards over
the d*c ranks that hold the same weights.

Mixtures of experts (ptdp/planner/moe.py) with e expert ranks: each rank holds E/e of an MoE
layer's experts (tensor-split like the dense MLP) and the router and shared expert whole;
the distributed optimizer shards the experts' state over the d*c/e ranks that hold the same
experts, the rest over d*c. An MoE layer keeps moe.moe_activation_bytes beyond a dense one
(k copies of each token dispatched, balanced routing). Stages are costed at the busiest
rank's count of MoE layers (DeepSeek-V3's dense first layers make the first stage lighter).
Multi-token prediction (ptdp/planner/mtp.py) adds its depths' parameters to the last stage (and
with p > 1 the word table's copy), and per micro-batch in flight there a decoder layer's stash
of the last layer's kind and what the depth's head keeps (mtp.depth_extra_bytes).

ZB-H1's split backward (ptdp/parallel/weight_grad.py) changes what a micro-batch holds after
its B pass: the graph is freed, but each deferred weight gradient keeps its operation's input
and output gradient until the W pass (`pending_weight_grad_bytes`), and the W pass computes
all of a stage's weight gradients of that micro-batch before accumulating them (one more
copy of the stage's gradients in the parameters' dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config.catalogue import schedule_spec
from ptdp.planner.compute import (BYTES, ModelShape, attention_kernel, layer_kernel,
                                  planned_modules, same_block)
from ptdp.planner.formulas import context_shape, layer_parameter_split, ring_block_bytes
from ptdp.planner.latent import (latent_activation_bytes, pending_elements,
                                 split_activation_elements)
from ptdp.planner.moe import (moe_activation_bytes, rank_expert_parameters, rank_moe_layers,
                              rank_moe_parameter_change)
from ptdp.planner.mtp import (depth_extra_bytes, depth_is_moe, depth_micro_batches,
                              mtp_expert_parameters, mtp_stage_parameters)

GB = 2**30   # GiB, as torch.cuda memory stats and the trainer's mem_gb report


@dataclass(frozen=True)
class MemoryBreakdown:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float       # transient working set, pipeline buffers, framework reserve

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers

    def as_gb(self) -> dict:
        return {k: round(getattr(self, k) / GB, 3)
                for k in ("weights", "gradients", "optimizer", "activations", "buffers", "total")}


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------

def layer_parameters(shape: ModelShape, t: int) -> float:
    """Parameters of one layer held by one tensor rank: formulas.layer_parameter_split's."""
    split, replicated = layer_parameter_split(shape)
    return split / t + replicated


def embedding_parameters(shape: ModelShape, t: int, vocab_padded: int) -> float:
    """Word table shard plus replicated learned positions (none with rotary ones) on the first
    stage; BERT adds token types."""
    extra = shape.tokentypes * shape.hidden if shape.family.token_types else 0
    positions = 0 if shape.rope else shape.seq * shape.hidden
    return vocab_padded * shape.hidden / t + positions + extra


def bert_head_parameters(shape: ModelShape, t: int, vocab_padded: int) -> float:
    """models/bert.py's heads on the last stage: the LM transform (dense h x h + LayerNorm,
    replicated), the vocabulary bias (split by t), the pooler and the binary head."""
    h = shape.hidden
    return (h * h + h) + 2 * h + vocab_padded / t + (h * h + h) + (2 * h + 2)


def stage_parameters(shape: ModelShape, t: int, p: int, vocab_padded: int, first: bool,
                     last: bool, e: int = 1, v: int = 1) -> float:
    """A pipeline rank's parameters on one tensor rank (and expert rank of e, holding E/e of
    each MoE layer's experts: the busiest rank's MoE layers of v chunks)."""
    params = shape.layers // p * layer_parameters(shape, t)
    params += rank_moe_parameter_change(shape, t, p, v, e)
    if first:
        params += embedding_parameters(shape, t, vocab_padded)
    if last:
        params += shape.norm_parameters * shape.hidden   # final norm
        if not first or not shape.tie_embeddings:        # the last stage's copy of the table,
            params += vocab_padded * shape.hidden / t    # or the untied output layer
        if shape.bert_heads:
            params += bert_head_parameters(shape, t, vocab_padded)
        params += mtp_stage_parameters(shape, t, e, layer_parameters(shape, t), vocab_padded,
                                       first)   # the MTP depths, with p > 1 the table's copy
    return params


def state_bytes_per_parameter(precision: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter with Adam. Mixed precision keeps
    16-bit weights, fp32 gradient accumulation buffers (as Megatron's main_grad) and fp32
    master weights + two moments: 2 + 4 + 12 = 18 bytes. fp32 training: 4 + 4 + 8 = 16."""
    e = BYTES[precision]
    if e >= 4:
        return 4.0, 4.0, 8.0
    return float(e), 4.0, 12.0


def optimizer_state_bytes(params: float, precision: str, d: int = 1,
                          distributed_optimizer: bool = False) -> float:
    """Adam's fp32 state on one GPU: the two moments, plus master weights kept apart from
    16-bit ones. The distributed optimizer (ZeRO stage 1, ptdp/optim/distributed.py) shards
    it over the d data-parallel ranks (bucket padding, under ALIGN * d elements per bucket,
    is ignored)."""
    per_parameter = state_bytes_per_parameter(precision)[2]
    return params * per_parameter / (d if distributed_optimizer else 1)


def gloo_sharding_staging_bytes(params: float, precision: str, d: int,
                                all_reduced: float = 0.0) -> float:
    """What gloo keeps resident for the distributed optimizer's collectives on CPU ranks.

    Gloo has no in-place reduce-scatter or all-gather into one tensor: it stages each bucket's
    reduce-scatter through a copy of the whole fp32 bucket plus the 1/d output chunk, and
    each all-gather through a copy of the whole bucket in the model's dtype. The copies are
    made on gloo's worker threads, whose glibc arenas keep them (measured: every bucket's
    staging stays resident from the first iterations on). `all_reduced` parameters (the tied
    word table's own bucket with p > 1) are all-reduced in place instead of reduce-scattered.
    NCCL works in place: no such term on GPUs."""
    if d <= 1:
        return 0.0
    return (params - all_reduced) * 4 * (1 + 1 / d) + params * BYTES[precision]


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------

def measured_activation_bytes(hw, shape: ModelShape, b: int, t: int, precision: str,
                              recompute: str) -> float | None:
    """The profile's measured saved-tensor bytes for this layer shard, if it has them
    (linear in b through the measured points)."""
    rows = [r for r in ((hw.measured or {}).get("layers") or [])
            if (r.get("hidden"), r.get("heads"), r.get("ffn"), r.get("seq"), r.get("tensor"),
                r.get("precision")) == (shape.hidden, shape.heads, shape.ffn, shape.seq, t, precision)
            and f"activation_bytes_{recompute}" in r and same_block(r, shape)]
    if not rows:
        return None
    per_sample = sum(r[f"activation_bytes_{recompute}"] / r["micro_batch"] for r in rows) / len(rows)
    return per_sample * b


def sequence_parallel_replicated(sbh: float, e: int, dropout: bool, t: int,
                                 sequence_parallel: bool) -> float:
    """The activations outside the tensor-parallel regions: the norms' inputs 2sbh and the two
    1-byte dropout masks, split by t with sequence parallelism; the QKV and fc1 inputs 2sbh."""
    regions = 2 * sbh * e + (2 * sbh if dropout else 0)
    return regions / (t if sequence_parallel else 1) + 2 * sbh * e


def layer_activation_bytes(shape: ModelShape, b: int, t: int, precision: str, recompute: str,
                           attention: str, hw=None, sequence_parallel: bool = False,
                           modules: tuple | None = None) -> float:
    """Bytes one layer keeps for backward per micro-batch on one tensor rank; `modules`:
    recompute=selective's (train.recompute_modules; None: the default for this attention)."""
    if recompute == "selective":   # what "none" keeps (measured or counted) less the modules'
        modules = planned_modules(recompute, modules, sequence_parallel, attention)
        return (layer_activation_bytes(shape, b, t, precision, "none", attention, hw,
                                       sequence_parallel)
                - selective_saving(shape, b, t, precision, layer_kernel(hw, shape, attention),
                                   modules, sequence_parallel))
    if hw is not None and not sequence_parallel:   # the profile measures layers without it
        measured = measured_activation_bytes(hw, shape, b, t, precision, recompute)
        if measured is not None:
            return measured
    s, h, a, q = shape.seq, shape.hidden, shape.heads, shape.q_hidden
    e = BYTES[precision]
    sbh = s * b * h
    if recompute == "full":
        return sbh * e / (t if sequence_parallel else 1)
    replicated = sequence_parallel_replicated(sbh, e, shape.dropout, t, sequence_parallel)
    rotated = s * b * (q + shape.kv_hidden) if shape.rope else 0    # rotated Q and K
    normed = s * b * (q + shape.kv_hidden) if shape.qk_norm else 0  # normalised Q and K
    if shape.latent:   # its latents; Q and K, rotated parts in, are in _split_linear_elements
        replicated += latent_activation_bytes(shape, b, t, e, sequence_parallel)
        rotated = 0
    split = (_split_linear_elements(shape, b) + rotated + normed) / t * e
    if layer_kernel(hw, shape, attention) == "flash":   # saved output (heads * v_head_dim
        core = s * b * a * shape.v_head_dim / t * e + a * s * b / t * 4   # wide), fp32 lse
    else:
        core = a * s * s * b / t * (2 * e + (1 if shape.dropout else 0))
    return replicated + split + core


def selective_saving(shape: ModelShape, b: int, t: int, precision: str, attention: str,
                     modules: tuple, sequence_parallel: bool = False) -> float:
    """Bytes per layer and micro-batch that recompute=selective's `modules` do not keep (see
    the module's docstring; models/recompute.py)."""
    s, h, a, f = shape.seq, shape.hidden, shape.heads, shape.ffn
    e = BYTES[precision]
    sbh, sbf = s * b * h * e, s * b * f / t * e
    saved = 0.0
    if "core_attn" in modules:
        saved += (a * s * b / t * 4 if attention == "flash"
                  else a * s * s * b / t * (2 * e + (1 if shape.dropout else 0)))
    if "layernorm" in modules and not sequence_parallel:
        saved += 2 * sbh
    if "mlp" in modules:
        saved += (2 + shape.gated) * sbf
        if sequence_parallel:   # fc1's gathered input, less the norm output the MLP keeps
            saved += sbh * (1 - 1 / t)
    elif "activation" in modules:
        saved += sbf
    return saved


def pending_weight_grad_bytes(shape: ModelShape, b: int, t: int, precision: str,
                              sequence_parallel: bool = False) -> float:
    """Bytes one layer keeps between its B and W passes (ZB-H1) on one tensor rank: every
    deferred weight gradient's closure holds its input and its output gradient
    (ptdp/parallel/weight_grad.py), whatever the recompute setting (a recomputed layer's
    inputs are rebuilt for B and then held the same way).

    Linear layers: the QKV and fc1 inputs (whole, sbh each, all-gathered with sequence
    parallelism), the projection and fc2 inputs (sbh/t, sbf/t); the output gradients of QKV
    and fc1 (3sbh/t, sbf/t) and of the row-parallel projection and fc2 (whole, sbh each).
    Norms: input and output gradient, 2 x 2sbh (split by t with sequence parallelism).
    With grouped-query attention and SwiGLU the QKV and fc1 output gradients are
    s*b*(h + 2h_kv)/t and 2sbf/t. QK-norm's gains hold the normalised Q and K and their output
    gradients, 2s*b*(h_q + h_kv)/t. Latent attention: latent.pending_elements."""
    e = BYTES[precision]
    sbh = shape.seq * b * shape.hidden
    whole = 4 * sbh                                  # QKV, fc1 inputs; proj, fc2 out-grads
    split = _split_linear_elements(shape, b) / t     # proj, fc2 inputs; QKV, fc1 out-grads
    if shape.latent:   # its linears' and latent norms' (latent.pending_elements), the MLP's
        split = (_mlp_split_elements(shape, b) / t
                 + pending_elements(shape, shape.seq * b, sequence_parallel, t))
    if shape.qk_norm:
        split += 2 * shape.seq * b * (shape.q_hidden + shape.kv_hidden) / t
    layer_norms = 4 * sbh / (t if sequence_parallel else 1)
    return (whole + split + layer_norms) * e


def _split_linear_elements(shape: ModelShape, b: int) -> int:
    """Elements of a layer's tensor-split activations around its linears, before the division
    by t: the QKV output s*b*(h_q + 2h_kv) and the projection input s*b*h_q; fc1's output
    (1+g)sbf and fc2's input sbf, with g = 1 for a gated activation (whose fused kernel keeps
    gate and up). 4sbh + 2sbf for the dissertation's block. Latent attention: Q, K, kv_up's
    output and the projection input (latent.split_activation_elements) instead."""
    s, q = shape.seq, shape.q_hidden
    if shape.latent:
        return split_activation_elements(shape, s * b) + _mlp_split_elements(shape, b)
    return s * b * (2 * q + 2 * shape.kv_hidden) + _mlp_split_elements(shape, b)


def _mlp_split_elements(shape: ModelShape, b: int) -> int:
    """fc1's output (1+g)sbf and fc2's input sbf."""
    return (2 + shape.gated) * shape.seq * b * shape.ffn


def ring_working_bytes(shape: ModelShape, b: int, t: int, c: int, precision: str) -> float:
    """The working set of one layer's ring attention on a context rank (c > 1), backward's
    (the larger): two K/V blocks in the model's dtype, three fp32 dK/dV blocks and the fp32 dQ
    of the rank's s/c queries. This is the working set of fused block kernels (CPU). On CUDA
    the blocks are a plain matmul/softmax today (ptdp/parallel/ring_attention.py), which also
    holds each block's fp32 scores and probabilities: not counted here (docs/parallelism.md)."""
    if c == 1:
        return 0.0
    e = BYTES[precision]
    dq = shape.seq / c * b * shape.hidden / t * 4
    return 2 * ring_block_bytes(shape, b, t, c, e) + 3 * ring_block_bytes(shape, b, t, c, 4) + dq


def weight_versions(schedule: str, p: int, rank: int, vertical_sync: bool = False) -> int:
    """Copies of the rank's weights (ScheduleSpec.weight_copies). In fp32 the newest version
    is the master copy."""
    return schedule_spec(schedule).weight_copies(p, rank, vertical_sync)


def in_flight_layer_stashes(schedule: str, p: int, v: int, m: int, layers_per_rank: int,
                            rank: int) -> float:
    """How many (micro-batch, layer) activation stashes `rank` holds at its peak
    (ScheduleSpec.in_flight, which ptdp.pipeline.schedules.max_in_flight counts from the
    action lists)."""
    return schedule_spec(schedule).in_flight(p, v, m, rank) * layers_per_rank


# --------------------------------------------------------------------------------------------
# Per GPU
# --------------------------------------------------------------------------------------------

def gpu_memory(shape: ModelShape, *, p: int, t: int, v: int, m: int, b: int, schedule: str,
               recompute: str, precision: str, attention: str, vocab_padded: int,
               reserved_gb: float, rank: int, d: int = 1, hw=None,
               vertical_sync: bool = False, distributed_optimizer: bool = False,
               bucket_mb: float = 25.0, sequence_parallel: bool = False,
               c: int = 1, expert: int = 1,
               recompute_modules: tuple | None = None) -> MemoryBreakdown:
    """Peak memory of pipeline rank `rank` (0 = first stage, p-1 = last), with `c` context
    ranks splitting every sequence.

    Weights, gradients and optimizer state live throughout. On top of them: activation
    stashes (with ZB-H1, the pending weight gradients' inputs and output gradients), the
    working set of one layer, the loss or a W pass, p2p buffers and, when gradients are not
    in one flat buffer (2BW, PipeDream) with d > 1, one bucket's concatenated copy (a flat
    buffer is reduced in place, ptdp/optim/grads.py); on CPU ranks gloo's staging for the
    distributed optimizer and the heap glibc keeps in proportion to a micro-batch's
    activations (heap_retention_bytes). Everything else a process holds (framework, process
    groups, on CPU the rest of the heap glibc keeps) is the profile's `reserved_gb`.
    """
    first, last = rank == 0, rank == p - 1
    e = BYTES[precision]
    w, g, o = state_bytes_per_parameter(precision)
    params = stage_parameters(shape, t, p, vocab_padded, first, last, expert, v)
    experts = rank_expert_parameters(shape, t, p, v, expert) + (   # sharded over d*c/e ranks
        mtp_expert_parameters(shape, t, expert) if last else 0.0)
    whole, shape = shape, context_shape(shape, c)   # activations: this rank's s/c tokens
    attention = attention_kernel(attention, c)
    spec = schedule_spec(schedule)
    weights = params * w * spec.weight_copies(p, rank, vertical_sync)
    # 2BW: batch t's gradients wait for every rank to finish it while batch t+1 accumulates;
    # the first rank finishes last and updates at once (ptdp/training/no_flush.py)
    gradients = params * g * spec.gradient_copies(rank)
    activations = _activation_stashes(shape, p=p, v=v, m=m, b=b, t=t, schedule=schedule,
                                      recompute=recompute, precision=precision,
                                      attention=attention, rank=rank, hw=hw,
                                      sequence_parallel=sequence_parallel,
                                      modules=recompute_modules)
    sbh = shape.seq * b * shape.hidden
    local_sbh = sbh / (t if sequence_parallel else 1)          # boundary and embedding tensors
    if first and shape.dropout:
        activations += local_sbh * min(m, m if spec.all_forwards_first else p - rank)  # embedding mask
    fp32_copy = 0 if hw is not None and hw.device != "cpu" else 4   # the loss's, on CPU
    if last and shape.mtp_layers:   # the MTP depths' layers and heads (ptdp/planner/mtp.py)
        moe = _moe_extra(shape, b, t, precision) if depth_is_moe(shape) else 0.0
        depth = layer_activation_bytes(shape, b, t, precision, recompute, attention, hw,
                                       sequence_parallel, recompute_modules) + depth_extra_bytes(
            shape, b, t, e, sequence_parallel, vocab_padded, fp32_copy or e)
        depth += moe if recompute != "full" else 0.0
        activations += shape.mtp_layers * depth_micro_batches(spec, p, m) * depth
    working = 2 * local_sbh * e                                # send/recv buffers
    transient = 0.0           # the forward/backward's own working set
    if recompute != "none":   # a recomputed layer's activations live while its backward runs
        transient += layer_activation_bytes(shape, b, t, precision, "none", attention, hw,
                                            sequence_parallel) + _moe_extra(shape, b, t, precision)
    transient += ring_working_bytes(whole, b, t, c, precision)
    if last:   # the logits, their one fp32 copy (exp, then softmax) and the gradient; on GPUs,
        # where train.compile fuses the loss's passes, the logits kept and the gradient only
        # (ptdp/parallel/cross_entropy.py)
        rows = shape.head_rows(shape.seq * b)   # BERT: its masked positions only
        transient += rows * vocab_padded / t * (2 * e + fp32_copy)
        if spec.all_forwards_first:   # GPipe: m - 1 more kept (CPU: fp32 copies, GPU: logits)
            activations += (m - 1) * rows * vocab_padded / t * (fp32_copy or e)
        if shape.bert_heads:  # the LM transform's dense output, GeLU and LayerNorm inputs
            transient += 3 * rows * shape.hidden * e
    # A W pass (zb-h1's everywhere, the cooldown split's on any stage but the first) holds the
    # gradients of one weight at a time, the largest a layer's fc1 or the embedding table (a
    # table used twice: both contributions, ptdp/parallel/weight_grad.py's _accumulate). (The
    # output gradients a split micro-batch of the cooldown keeps for its W take the place of
    # the stash its B frees; its inputs are the stash's own: modelled as no more than that.)
    if spec.split_backward or (spec.split_cooldown and p > 1 and (rank > 0 or v > 1)):
        table = vocab_padded * shape.hidden / t * (2 if first and last else 1)
        fc1 = shape.hidden * max(shape.ffn, shape.moe_ffn) * (1 + shape.gated) / t
        transient = max(transient, max(fc1, table if first or last else 0.0) * e)
    working += transient
    if d > 1 and spec.weight_versions:   # gradients of their own: torch.cat copy
        working += min(params * g, bucket_mb * 2**20)
    # The optimizer step runs after the activations are freed and needs less than they held:
    # the fused CUDA AdamW no temporaries; on CPU the foreach AdamW's rose 12 MiB above the
    # steady state for 13 M parameters, where the forward/backward rose 40 MiB (resident
    # set with glibc's mmap threshold fixed, so that it follows the live tensors).
    # what a micro-batch allocates on this rank, whatever is kept: every layer's activations
    # without recomputation, SP's gathered inputs whole
    buffers = working + heap_retention_bytes(hw, shape.layers // p * layer_activation_bytes(
        shape, b, t, precision, "none", attention, hw))
    if distributed_optimizer and hw is not None and hw.device == "cpu":
        tied = (vocab_padded * shape.hidden / t
                if p > 1 and (first or last) and shape.word_table_on_last_stage else 0.0)
        buffers += gloo_sharding_staging_bytes(params, precision, d * c, all_reduced=tied)
    optimizer = (optimizer_state_bytes(params - experts, precision, d * c, distributed_optimizer)
                 + optimizer_state_bytes(experts, precision, d * c // expert,
                                         distributed_optimizer))
    return MemoryBreakdown(weights=weights, gradients=gradients, optimizer=optimizer,
                           activations=activations, buffers=buffers + reserved_gb * GB)


def heap_retention_bytes(hw, micro_batch_activations: float) -> float:
    """CPU ranks: the freed heap glibc keeps beyond the profile's fixed reserve, which grows
    with the size of the tensors a rank frees and allocates again every micro-batch (after a
    large free glibc raises its mmap threshold, so later activations come from a heap that
    fragments and is rarely returned; under a pipeline they are also freed out of order).
    Modelled as the profile's `measured.heap_retention` (ptdp/profiler/calibration.py, calibrate_reserve:
    2BW runs of the profiled model at b = 1 and b = 4) times the activations one micro-batch
    allocates on the rank. It errs on the safe side: without a pipeline, measured peaks at
    b = 2 grew less (6-11 % over with the term), at b = 4-8 and m = 1 as much (5-9 % under
    without it; tools/validate_planner.py). No term on GPUs, whose caching allocator the
    datasheet profiles' reserve covers."""
    if hw is None or hw.device != "cpu":
        return 0.0
    return float((hw.measured or {}).get("heap_retention", 0.0)) * micro_batch_activations


def _moe_extra(shape: ModelShape, b: int, t: int, precision: str) -> float:
    """What an MoE layer keeps beyond a dense one (moe.moe_activation_bytes), 0 when dense."""
    if not shape.experts:
        return 0.0
    return moe_activation_bytes(shape, shape.seq * b, t, BYTES[precision])


def _activation_stashes(shape: ModelShape, *, p: int, v: int, m: int, b: int, t: int,
                        schedule: str, recompute: str, precision: str, attention: str,
                        rank: int, hw, sequence_parallel: bool,
                        modules: tuple | None = None) -> float:
    """Bytes of the (micro-batch, layer) stashes `rank` holds at its peak. With ZB-H1,
    1F1B's min(p - rank, m) micro-batches hold forward stashes and up to `rank` more wait
    for their W pass, holding `pending_weight_grad_bytes` per layer instead."""
    layers_per_rank = shape.layers // p
    stash = layer_activation_bytes(shape, b, t, precision, recompute, attention, hw,
                                   sequence_parallel, modules)
    if shape.experts and recompute != "full":   # the mean layer: its MoE layers keep more
        moe = max(rank_moe_layers(shape, p, v))
        stash += moe / layers_per_rank * _moe_extra(shape, b, t, precision)
    if not schedule_spec(schedule).split_backward:
        return in_flight_layer_stashes(schedule, p, v, m, layers_per_rank, rank) * stash
    forward = min(p - rank, m)
    pending = min(p, m) - forward
    return layers_per_rank * (forward * stash + pending * pending_weight_grad_bytes(
        shape, b, t, precision, sequence_parallel))
