"""Closed-form prediction of one training iteration: step time, TFLOP/s, memory, bubble.

Assumptions (each one a place where reality can differ; `ptdp profile` + validation measure
how much):

Compute (compute.py)
  * Every rank of a pipeline stage does the same work; a stage holds l/p layers (l/(p*v) per
    chunk). The first stage also embeds, the last also runs the final LayerNorm, the
    logits GEMM and a vocab-parallel cross-entropy. No load balancing of those extras.
  * Kernel times come from the profile's measurements when it has this exact shape, else
    from a roofline per kernel: GEMMs at peak * gemm_max * sat(M) sat(N) sat(K) with
    sat(x) = x / (x + gemm_half_dim) (small GEMMs, e.g. from large t or small b, run less
    efficiently), attention kernels at a further `attention` factor, elementwise kernels at
    `memory` x HBM bandwidth, plus a launch cost per kernel.
  * zb-h1 splits the backward (B now, W later): the profile's split timing with W held
    back, or the trainer's own split cost measured on one rank, whichever is larger.
  * Backward = data-gradient + weight-gradient GEMMs (2x forward FLOPs). Recomputation
    re-runs the forward of every layer ("full", the paper's 4/3 c_extra) or selective's
    modules (compute.recompute_seconds; mlp also repeats fc2's collective).

Communication (comm.py)
  * Ranks are laid out (p, d, t) with t fastest: a group is on NVLink when its span of
    consecutive ranks fits in a node, else on the network at the node's per-GPU share of
    its NICs. Collectives are rings: all-reduce moves 2(n-1)/n of the buffer, i.e. the
    8bsh(t-1)/t per layer of the PTD-P paper for tensor parallelism (2 all-reduces forward, 2
    backward, 2 more in a full recompute). Tensor-parallel communication never overlaps. A
    measured CPU profile replaces that by what the communication added to a layer on as many
    busy ranks (`measured.tensor_layers`, ptdp/profiler/tensor_layers.py), for groups inside a node;
    and it prices reduce-scatter and all-gather (sequence parallelism, the distributed
    optimizer) at their own measured rates, which on gloo are not halves of an all-reduce.
  * Pipeline: per micro-batch and per chunk each rank sends b*s*h activations forward and
    receives as many gradients; with scatter/gather it sends b*s*h/t over the link and
    all-gathers over NVLink. Both are on the critical path (x v for interleaving), as in the
    source's blocking exchange, unless the profile says `overlap_pipeline` (measured profiles):
    ptdp's transfers are asynchronous (ptdp/pipeline/p2p.py) and overlap compute, and 1F1B
    then waits for 2(p-1)/p of them per micro-batch, GPipe only in fill and drain
    (see _exposed_p2p).
  * Data parallelism: one ring all-reduce of the rank's fp32 gradients per iteration. It
    overlaps with the last micro-batch's backward pass (buckets are reduced as they fill),
    for 2BW too: its trainer waits for the sums right after a batch's last backward, since
    the global norm needs them (ptdp/training/no_flush.py). Tied word embeddings add an all-reduce
    between the first and last stage (an untied output layer, as Llama's, none). On CPUs
    nothing overlaps (`overlap_communication: false`): gloo's copies and reductions run on the
    same cores.

Context parallelism (c > 1, ptdp/parallel/ring_attention.py)
  * Each rank holds s/c tokens: its GEMMs, elementwise kernels, tensor-parallel collectives,
    pipeline sends and logits are those of an s/c sequence; its attention, balanced by the
    chunk placement, is 1/c of the whole sequence's (c times an s/c sequence's).
  * The ring: per layer and micro-batch c-1 K/V blocks forward, c-1 K/V and c dK/dV blocks
    backward (formulas.ring_blocks_per_layer; recomputation repeats the forward ring), each
    block sent while the block before it is attended to: only what a step's transfer takes
    beyond a step's attention (1/c of the rank's) is exposed, and the last dK/dV hop home
    always, when the profile says point-to-point transfers overlap (`overlap_pipeline`); all of
    it otherwise. Neighbours are t ranks apart (comm.context_link).
  * Gradients are reduced over the d*c replicas; the distributed optimizer shards over them.

Mixtures of experts (e expert ranks folded out of d*c): ptdp/planner/expert_cost.py.

Multi-token prediction (D depths on the last stage): ptdp/planner/mtp_cost.py. With p > 1 the
last stage then holds a copy of the word table, summed with the first stage's as a tied one.

Pipeline (formulas.bubble_fraction)
  * Flushing schedules (gpipe, 1f1b, interleaved): m * T_slowest + (p-1)/v * T_mean, which
    is (p-1)/(v*m) bubble for balanced stages. 2BW never flushes: m *
    T_slowest per iteration in steady state (the fill and drain are paid once per job, not
    counted). GPipe costs the same time as 1F1B but keeps m micro-batches in flight.

Memory (memory.py): weights, fp32 gradients and Adam state (18 B/param mixed precision,
  16 B fp32), 2BW's second weight version and, on all but the first pipeline rank, the
  gradients of the batch waiting for its update while the next one accumulates, activation
  stashes x the schedule's peak in-flight count on the first and last pipeline ranks,
  transient buffers and the profile's reserve.
  A layout fits when that is at most (1 - memory_headroom) of the device memory: the
  headroom (5% on GPUs) absorbs allocator fragmentation.

Trainer overhead (measured profiles): what the real trainer spends per layer and micro-batch
  beyond the layer's kernels (hooks, autograd bookkeeping), calibrated by `ptdp profile` on one
  rank; half charged to forward, half to backward.

Optimizer and host: clipping + Adam are memory-bound (~38 bytes of traffic per parameter, or
  the profile's measured seconds per parameter); `host_overhead_s` (measured by the profiler
  as a negligible model's step time) is added per iteration.

CPU profiles: ranks that share a node's cores and memory bandwidth slow each other down;
  compute, recomputation and the optimizer are scaled by the slowdown the profile measured
  with that many ranks busy at once (`measured.busy`; without it, ranks x threads / cores
  when that exceeds 1), and collectives and sends take the rates measured on such a busy
  node, in concurrent groups of the same size. Ranks idle in a pipeline's fill and drain
  leave their cores to the stages at work, which are time-sliced only as much as their own
  ranks outnumber the cores: once one stage's ranks fill the cores the bubble costs no
  compute time (_flush_compute_factor). So on 8 ranks of 2 cores deep pipelines with one
  micro-batch win, and were measured to.

Reporting: model TFLOP/s per GPU is Eq. 4.2's F / (step * n), generalised to the block
  (formulas.iteration_flops: grouped-query attention, SwiGLU; BERT: formulas.bert_flops_
  per_iteration, with its LM transform, pooler and binary head), counted as the trainer does:
  with the padded vocabulary, and with the extra forward pass (4 passes per layer, as in the
  paper's runs) only when recompute=full, 3 passes otherwise. MFU = that / the precision's
  peak, the paper's "% of peak". Memory is in GiB (2^30 bytes), as the trainer's mem_gb.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ptdp.config import padded_vocab_size
from ptdp.config.catalogue import DEFAULT, Planner, names_where, schedule_spec
from ptdp.hardware import HardwareProfile
from ptdp.planner import comm
from ptdp.planner.compute import (BYTES, ModelShape, _attention_times, attention_kernel,
                                  head_times, layer_times, planned_modules, recompute_seconds)
from ptdp.planner.formulas import (bubble_fraction, context_shape, iteration_flops,
                                   ring_block_bytes, ring_blocks_per_layer)
from ptdp.planner.expert_cost import all_to_all_seconds, expert_gradient_comm, moe_layer_time_change
from ptdp.planner.memory import GB, MemoryBreakdown, gpu_memory, stage_parameters
from ptdp.planner.moe import rank_expert_parameters, rank_moe_layers
from ptdp.planner.mtp import mtp_expert_parameters
from ptdp.planner.mtp_cost import depth_times

# What the cost model has formulas for (ptdp/config/catalogue.py: all but PipeDream async).
SCHEDULES = names_where(lambda spec: spec.planner is not Planner.NOT_MODELLED)
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    pipeline: int = 1
    tensor: int = 1
    data: int = 1
    chunks: int = 1
    micro_batch: int = 1
    schedule: str = DEFAULT.name
    recompute: str = "none"
    scatter_gather: bool = False
    distributed_optimizer: bool = False
    sequence_parallel: bool = False
    context: int = 1
    expert: int = 1      # e, folded out of d * c: each rank holds E/e experts
    recompute_modules: tuple | None = None   # recompute=selective's (None: its default)

    @property
    def gpus(self) -> int:
        return self.pipeline * self.tensor * self.context * self.data

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights: gradients are reduced over them (d * c)."""
        return self.data * self.context

    def recomputed(self, attention: str) -> tuple:
        """recompute=selective's modules as the plan models them with `attention` (the
        profile's or --attention's kernel; compute.planned_modules; () for none and full)."""
        return planned_modules(self.recompute, self.recompute_modules, self.sequence_parallel,
                               attention_kernel(attention, self.context))

    @property
    def _modules(self) -> str:
        return f"({'+'.join(self.recompute_modules)})" if self.recompute_modules else ""

    def micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.micro_batch * self.data)

    def describe(self) -> str:
        sg = (" sg" if self.scatter_gather else "") + (" sp" if self.sequence_parallel else "")
        v = f" v={self.chunks}" if self.chunks > 1 else ""
        zero = " distopt" if self.distributed_optimizer else ""
        c = f" c={self.context}" if self.context > 1 else ""
        e = f" e={self.expert}" if self.expert > 1 else ""
        return (f"p={self.pipeline} t={self.tensor}{c} d={self.data}{e}{v} b={self.micro_batch} "
                f"{self.schedule} rc={self.recompute}{self._modules}{sg}{zero}")


@dataclass(frozen=True)
class Workload:
    shape: ModelShape
    global_batch: int
    precision: str
    gpus_per_node: int


@dataclass
class Prediction:
    layout: Layout
    step_time_s: float
    tflops_per_gpu: float
    mfu: float
    memory_gb_per_gpu: float
    bubble_fraction: float
    fits: bool
    time: dict = field(default_factory=dict)      # seconds per iteration by cause
    memory: dict = field(default_factory=dict)    # GB per GPU by kind (worst rank)

    def summary(self) -> dict:
        return {"step_time_s": self.step_time_s, "tflops_per_gpu": self.tflops_per_gpu,
                "mfu": self.mfu, "memory_gb_per_gpu": self.memory_gb_per_gpu,
                "bubble_fraction": self.bubble_fraction}


@dataclass(frozen=True)
class _RankTimes:
    """One micro-batch through one pipeline rank (all its chunks), seconds."""

    compute: float
    recompute: float
    tensor_comm: float
    p2p: float             # transfer time on the critical path in the steady state
    backward: float        # the part of `compute` that is backward (DP overlap window)
    p2p_fill: float = 0.0  # per micro-batch step of the fill and drain: every transfer waited
    ring: float = 0.0      # the context ring's exposed transfers
    all_to_all: float = 0.0   # the MoE layers' token dispatch and combine
    cooldown_saving: float = 0.0   # per drain step, the input gradient sent first: its W pass

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tensor_comm + self.p2p + self.ring
                + self.all_to_all)


def _rank_times(hw: HardwareProfile, work: Workload, lay: Layout, attention: str,
                first: bool, last: bool) -> _RankTimes:
    whole, prec = work.shape, work.precision
    p, t, d, v, b = lay.pipeline, lay.tensor, lay.data, lay.chunks, lay.micro_batch
    c = lay.context
    shape = context_shape(whole, c)   # this rank's s/c tokens
    spec = schedule_spec(lay.schedule)
    split = spec.split_backward   # backward as B now and W later
    layers = shape.layers // p
    attention = attention_kernel(attention, c)
    lt = layer_times(hw, prec, shape, b, t, attention)
    ring = 0.0
    if c > 1:   # its queries attend to the whole sequence: c times an s/c sequence's attention
        attn_fwd, attn_bwd = _attention_times(hw, prec, shape, b, t, "flash")
        lt = type(lt)(forward=lt.forward + (c - 1) * attn_fwd,
                      backward=lt.backward + (c - 1) * attn_bwd,
                      attention_forward=c * attn_fwd,
                      backward_split=lt.backward_split + (c - 1) * attn_bwd)
        # one ring step attends to one block: the s/c sequence's attention time
        ring = layers * _ring_time(hw, work, lay, attention, min(lay.gpus, work.gpus_per_node),
                                   attn_fwd, attn_bwd)
    act_bytes = shape.seq * b * shape.hidden * BYTES[prec]
    busy = min(lay.gpus, work.gpus_per_node)
    tp_link = comm.tensor_link(hw, t, work.gpus_per_node, busy)
    ar = comm.all_reduce_time(t, act_bytes, tp_link)
    measured = hw.measured or {}
    backward = lt.backward
    # the split layer's own cost, or the trainer's, measured on one rank: the larger
    split_cost = max(lt.backward_split - lt.backward, measured.get("split_backward_overhead_s", 0))
    backward += split_cost if split else 0.0
    fwd, bwd = layers * lt.forward, layers * backward
    # The trainer's own cost per layer and micro-batch beyond the kernels (measured profiles).
    overhead = layers * measured.get("layer_overhead_s", 0.0)
    fwd, bwd = fwd + overhead / 2, bwd + overhead / 2
    recompute = layers * recompute_seconds(hw, prec, shape, b, t, attention, lt, lay.recompute,
                                           lay.recompute_modules, lay.sequence_parallel)
    all_to_all, moe = 0.0, max(rank_moe_layers(shape, p, v))   # the busiest rank's MoE layers
    if shape.experts:
        moe_fwd, moe_bwd = moe_layer_time_change(hw, prec, shape, b, t, lay.expert)
        fwd, bwd = fwd + moe * moe_fwd, bwd + moe * moe_bwd
        recompute += moe * moe_fwd if lay.recompute == "full" else 0.0
        all_to_all = moe * all_to_all_seconds(hw, prec, shape, b, t, lay.expert, lay.recompute,
                                              lay.sequence_parallel, work.gpus_per_node, busy)
    tensor_comm = layers * comm.layer_tensor_comm(hw, work, lay, act_bytes, ar, busy)
    if first or last:
        ht = head_times(hw, prec, shape, b, t, padded_vocab_size(shape.vocab, t))
        if first:   # embedding lookup + its all-reduce over the vocab shards
            fwd, tensor_comm = fwd + ht.embed_forward, tensor_comm + ar
            bwd += ht.embed_backward_split if split else ht.embed_backward
        if last:    # logits input's backward all-reduce + 3 small cross-entropy reductions
            fwd = fwd + ht.head_forward
            bwd += ht.head_backward_split if split else ht.head_backward
            head_comm = ar + 3 * comm.all_reduce_time(t, shape.seq * b * 4, tp_link)
            tensor_comm += head_comm
        if last and shape.mtp_layers:   # the MTP depths (ptdp/planner/mtp_cost.py)
            mtp = depth_times(hw, work, lay, shape, attention, lt, backward, ht, ar, head_comm,
                              busy)
            fwd, bwd, recompute = fwd + mtp.forward, bwd + mtp.backward, recompute + mtp.recompute
            tensor_comm, all_to_all = tensor_comm + mtp.tensor_comm, all_to_all + mtp.all_to_all
    p2p = p2p_fill = 0.0
    if p > 1:
        link = comm.pipeline_link(hw, t, d * lay.context, p, work.gpus_per_node, busy)
        if lay.sequence_parallel:   # each tensor rank sends its own 1/t of the sequence
            one_way = comm.p2p_time(act_bytes / t, link)
        elif lay.scatter_gather and t > 1:
            one_way = (comm.p2p_time(act_bytes / t, link)
                       + comm.all_gather_time(t, act_bytes, comm.intra_link(hw)))
        else:
            one_way = comm.p2p_time(act_bytes, link)
        p2p, p2p_fill = (_exposed_p2p(lay.schedule, p, v, one_way) if hw.overlap_pipeline
                         else (2 * v * one_way, 2 * v * one_way))
    slow = _oversubscription(hw, lay.gpus, work.gpus_per_node)
    # Half the backward, as _zero_bubble_flush assumes, at most the forward the sender runs.
    saving = max(0.0, min(bwd / 2, fwd) - layers * split_cost) if spec.split_cooldown else 0.0
    return _RankTimes((fwd + bwd) * slow, recompute * slow, tensor_comm, p2p, bwd * slow,
                      p2p_fill, ring, all_to_all, saving * slow)


def _ring_time(hw: HardwareProfile, work: Workload, lay: Layout, attention: str, busy: int,
               step_forward: float, step_backward: float) -> float:
    """Seconds of one layer's context ring per micro-batch on the critical path (module
    docstring): the transfers beyond each step's block computation when they overlap it,
    all of them when they do not."""
    c, t = lay.context, lay.tensor
    link = comm.context_link(hw, t, c, work.gpus_per_node, busy)
    repeats = lay.recompute == "full" or "core_attn" in lay.recomputed(attention)   # forward ring
    forward, backward_kv, backward_grad = ring_blocks_per_layer(c, "full" if repeats else "none")
    kv = comm.p2p_time(ring_block_bytes(work.shape, lay.micro_batch, t, c,
                                        BYTES[work.precision]), link)
    grad = comm.p2p_time(ring_block_bytes(work.shape, lay.micro_batch, t, c, 4), link)
    if not hw.overlap_pipeline:
        return (forward + backward_kv) * kv + backward_grad * grad
    # forward (and its repeat in a recomputed backward): c-1 steps; backward: c-1 steps moving
    # a K/V block and a dK/dV block each, then the last dK/dV hop home
    exposed = (forward + backward_kv - (c - 1)) * max(0.0, kv - step_forward)
    exposed += (c - 1) * max(0.0, kv + grad - step_backward) + grad
    return exposed


def _exposed_p2p(schedule: str, p: int, v: int, one_way: float) -> tuple[float, float]:
    """(steady, fill) seconds of pipeline transfers on the critical path: per micro-batch once
    the pipeline is full, and per micro-batch step of the flush ((p-1)/v steps).

    Sends are asynchronous and a receive is waited for only when its tensor is needed
    (ptdp/pipeline/p2p.py), so transfers overlap other micro-batches' compute. In 1F1B the
    p micro-batches in flight share a round trip through the pipeline (F0 -> send -> F1 ...
    B1 -> send -> B0: 2(p-1) transfers), 2(p-1)/p each, and the fill and drain add 2(p-2)
    transfers in all; GPipe streams its forwards and backwards and waits only in the fill and
    drain, 2(p-1) transfers. Both equal the schedules played out with a transfer time, for
    transfers up to a micro-batch's forward (tests/planner/test_cost_model.py). Interleaving
    is charged as 1F1B: off by up to ~13 % of the pipeline time for transfers up to a chunk's
    compute, under-predicted beyond (each chunk then waits for its own transfer)."""
    if p == 1:
        return 0.0, 0.0
    if schedule_spec(schedule).all_forwards_first:
        return 0.0, 2 * v * one_way
    return 2 * (p - 1) / p * one_way, 2 * v * (p - 2) / (p - 1) * one_way


def _flush_rank_time(ranks: list, p: int, compute_factor: float) -> float:
    """A pipeline rank's mean time per micro-batch step of the fill and drain, beyond the
    steady state's m steps: the steady-state time, its compute scaled by `compute_factor`
    (1 on GPUs; _flush_compute_factor)."""
    def mean(attr):
        return _rank_mean(ranks, p, attr)
    return ((mean("compute") + mean("recompute")) * compute_factor
            + mean("tensor_comm") + mean("p2p_fill") + mean("ring") + mean("all_to_all"))


def _rank_mean(ranks: list, p: int, attr: str) -> float:
    """The mean of `attr` over the p ranks: the first, the last and p - 2 middle ones."""
    first, last = ranks[0], ranks[-1]
    middle = ranks[1] if len(ranks) > 2 else first
    return (getattr(first, attr) + getattr(last, attr) + (p - 2) * getattr(middle, attr)) / p


def _flush_compute_factor(hw: HardwareProfile, p: int, m: int, gpus: int,
                          gpus_per_node: int) -> float:
    """What a flush step's compute costs relative to a steady step's. On GPUs 1. On CPU ranks
    that outnumber the cores, a stage's ranks share the cores only with the other stages
    working: in a wave (the forwards, then the backwards) with a of p stages active the time
    slicing is max(1, TS·a/p) (TS at full occupancy; the contention stays). Summed over a
    wave's m + p - 1 steps, beyond m steps at TS: for m >= p, p - 1 steps at
    2·mean(a < p) - TS, which is nothing once one stage's ranks alone fill the cores (the
    work is the same; only who waits changes)."""
    slow = _oversubscription(hw, gpus, gpus_per_node)
    row = comm.busy_node(hw, min(gpus, gpus_per_node))
    slicing = slow / max(row.get("contention", 1.0), 1.0) if row else slow
    if slicing <= 1.0:   # GPUs: no sum over a wave of up to thousands of steps
        return 1.0
    wave = sum(max(1.0, slicing * min(k, p, m, m + p - k) / p) for k in range(1, m + p))
    return max(wave - m * slicing, 0.0) / max(p - 1, 1) / slicing


def _zero_bubble_flush(ranks: list[_RankTimes], p: int, m: int,
                       compute_factor: float) -> tuple[float, float]:
    """ZB-H1 (v = 1) idles (p-1)(t_F + t_B - t_W) instead of 1F1B's (p-1)(t_F + t_B + t_W):
    with the backward split evenly into input (t_B) and weight (t_W) gradients, what is left
    is a rank's time without its backward, its compute scaled by `compute_factor` as in
    _flush_rank_time. -> (seconds, bubble fraction)."""
    weights = [1, *([p - 2] if p > 2 else []), 1] if p > 1 else [1]

    def left(r):
        return ((r.compute + r.recompute - r.backward) * compute_factor
                + r.tensor_comm + r.p2p + r.ring + r.all_to_all)

    mean = sum(w * r.total for w, r in zip(weights, ranks)) / sum(weights)
    mean_left = sum(w * left(r) for w, r in zip(weights, ranks)) / sum(weights)
    return (p - 1) * mean_left, bubble_fraction(p, m, 1) * mean_left / mean


def _oversubscription(hw: HardwareProfile, gpus: int, gpus_per_node: int) -> float:
    """>1 when a node's ranks (x their threads) outnumber its cores (CPU profiles): the
    slowdown the profile measured with that many ranks computing at once (which also holds
    their competition for memory bandwidth), else ranks x threads / cores."""
    if not hw.compute_units:
        return 1.0
    busy = min(gpus, gpus_per_node)
    row = comm.busy_node(hw, busy)
    if row:
        return max(1.0, row["slowdown"])
    threads = int((hw.measured or {}).get("threads", 1))
    return max(1.0, min(gpus, gpus_per_node) * threads / hw.compute_units)


def _optimizer_time(hw: HardwareProfile, params: float, precision: str) -> float:
    """Clipping + Adam, memory-bound: read grads, read/write master weights and both moments,
    write the 16-bit copy, plus a grad-norm pass: ~38 bytes per parameter (or the profile's
    measured seconds per parameter)."""
    measured = (hw.measured or {}).get("optimizer_s_per_param")
    if measured:
        return params * measured
    traffic = 38.0 if BYTES[precision] < 4 else 36.0
    return params * traffic / (hw.memory_bandwidth_GBps * 1e9 * hw.efficiency.memory)


def _worst_memory(hw, work: Workload, lay: Layout, attention: str) -> MemoryBreakdown:
    m = lay.micro_batches(work.global_batch)
    kwargs = dict(p=lay.pipeline, t=lay.tensor, v=lay.chunks, m=m, b=lay.micro_batch, d=lay.data,
                  schedule=lay.schedule, recompute=lay.recompute, precision=work.precision,
                  attention=attention,
                  vocab_padded=padded_vocab_size(work.shape.vocab, lay.tensor),
                  reserved_gb=hw.memory_reserved_gb, hw=hw,
                  distributed_optimizer=lay.distributed_optimizer,
                  sequence_parallel=lay.sequence_parallel, c=lay.context, expert=lay.expert,
                  recompute_modules=lay.recompute_modules)
    ranks = {0, lay.pipeline - 1}
    return max((gpu_memory(work.shape, rank=r, **kwargs) for r in ranks), key=lambda mb: mb.total)


def predict(hw: HardwareProfile, work: Workload, lay: Layout, *, dp_overlap: bool = True,
            attention: str | None = None) -> Prediction:
    """Predict one iteration of `lay` (assumed valid: see search.check_layout)."""
    attention = attention or hw.attention
    shape, p, t, d, v = work.shape, lay.pipeline, lay.tensor, lay.data, lay.chunks
    m = lay.micro_batches(work.global_batch)
    first = _rank_times(hw, work, lay, attention, True, p == 1)
    last = _rank_times(hw, work, lay, attention, p == 1, True) if p > 1 else first
    middle = _rank_times(hw, work, lay, attention, False, False) if p > 2 else first
    ranks = [first, middle, last] if p > 2 else [first, last]
    slowest = max(ranks, key=lambda r: r.total)
    pipelined = m * slowest.total
    flush_compute = _flush_compute_factor(hw, p, m, lay.gpus, work.gpus_per_node)
    spec = schedule_spec(lay.schedule)
    flush = (p - 1) / v * _flush_rank_time(ranks, p, flush_compute) if spec.flushing else 0.0
    bubble = bubble_fraction(p, m, v) if spec.flushing else 0.0
    if spec.split_cooldown and flush:   # each of the drain's p - 1 chunk steps sends its input
        # gradient before its weight gradients (ptdp/pipeline/flushing.py): _RankTimes's saving
        saved = (p - 1) / v * _rank_mean(ranks, p, "cooldown_saving") * flush_compute
        flush, bubble = flush - saved, bubble * (flush - saved) / flush
    if spec.split_backward:
        flush, bubble = _zero_bubble_flush(ranks, p, m, flush_compute)

    vocab_padded = padded_vocab_size(shape.vocab, t)
    params = max(stage_parameters(shape, t, p, vocab_padded, r == 0, r == p - 1, lay.expert, v)
                 for r in {0, p - 1})
    experts = (rank_expert_parameters(shape, t, p, v, lay.expert)   # reduced over d*c/e
               + mtp_expert_parameters(shape, t, lay.expert))      # (the last rank's depths)
    busy = min(lay.gpus, work.gpus_per_node)
    replicas = lay.replicas   # data x context: the ranks whose gradients are summed
    dp_total, param_gather = comm.all_reduce_time(replicas, (params - experts) * 4, comm.data_link(
        hw, t, replicas, work.gpus_per_node, busy)), 0.0
    if lay.distributed_optimizer:
        dp_total, param_gather = comm.distributed_optimizer_comm(hw, work, lay, params - experts,
                                                                 busy)
    expert_reduce, expert_gather = expert_gradient_comm(hw, work, lay, experts, busy)
    dp_total, param_gather = dp_total + expert_reduce, param_gather + expert_gather
    hidden = slowest.backward if dp_overlap and hw.overlap_communication else 0.0
    dp_exposed = max(0.0, dp_total - hidden) + param_gather
    dp_total += param_gather
    embedding_sync = 0.0
    if p > 1 and shape.word_table_on_last_stage:   # sum the first and last stage's table
        # gradients (the tied logits', or the MTP depths' embeddings')
        table = vocab_padded * shape.hidden / t * 4
        embedding_sync = comm.all_reduce_time(
            2, table, comm.pipeline_link(hw, t, d * lay.context, p, work.gpus_per_node, busy))
    updated = ((params - experts + experts * lay.expert) / replicas   # the shards it updates
               if lay.distributed_optimizer else params)
    optimizer = _optimizer_time(hw, updated, work.precision) * _oversubscription(
        hw, lay.gpus, work.gpus_per_node)
    step = (pipelined + flush + dp_exposed + embedding_sync + optimizer
            + hw.efficiency.host_overhead_s)

    flops = iteration_flops(shape, work.global_batch, vocab_padded,
                            recompute_forward=lay.recompute == "full")
    tflops = flops / (step * lay.gpus) / 1e12
    mem = _worst_memory(hw, work, lay, attention)
    time = {"compute": m * slowest.compute, "recompute": m * slowest.recompute,
            "tensor_comm": m * slowest.tensor_comm, "pipeline_p2p": m * slowest.p2p,
            "context_ring": m * slowest.ring, **({"expert_all_to_all": m * slowest.all_to_all}
                                                 if shape.experts else {}),   # MoE only
            "bubble": flush, "dp_allreduce": dp_total, "dp_exposed": dp_exposed,
            "embedding_sync": embedding_sync, "optimizer": optimizer}
    return Prediction(layout=lay, step_time_s=step, tflops_per_gpu=tflops,
                      mfu=tflops * 1e12 / hw.peak_flops(work.precision),
                      memory_gb_per_gpu=mem.total / GB, bubble_fraction=bubble,
                      fits=mem.total <= hw.usable_memory_bytes, time=time, memory=mem.as_gb())
