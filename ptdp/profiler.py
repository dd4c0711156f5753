"""`ptdp profile`: measure this machine and write a hardware profile the planner can use.

What is measured (PipeDream's profiler, plus what the closed-form model needs):
* per transformer-layer shard (the real `models.transformer` code, for each t and b):
  forward and backward seconds, the attention core's forward, bytes saved for backward
  (saved-tensor hooks, de-duplicated by storage) and weight bytes;
* embedding and head (final LayerNorm, logits, vocab-parallel cross-entropy) times;
* the device: large-GEMM rate (the peak), a GEMM shape model, memory bandwidth and the
  per-kernel launch cost, so the analytic model also works for shapes not profiled;
* all-reduce and point-to-point bandwidth/latency between `--ranks` local processes (gloo
  on CPU, NCCL with 2+ GPUs), fitted as time = latency + bytes / bandwidth;
* on CPU, nodes as busy as in training (`measured.busy`): for 2, 4, ... `--ranks` ranks
  all running at once, how much slower each one's compute gets (shared cores and memory
  bandwidth), all-reduce, reduce-scatter and all-gather in concurrent groups of every size,
  and send/recv between pairs, all at once: what tensor-, data- and pipeline-parallel
  communication sees; and what a tensor group's communication adds to a layer on such a
  node (`measured.tensor_layers`, ptdp/profile_tensor.py);
* the backward split as zb-h1 runs it (input gradients now, weight gradients later), for
  layers, embedding and head;
* on CPU, what the real trainer spends per layer and micro-batch beyond the kernels
  (`calibrate_layer_overhead`), and the memory reserve with the heap glibc keeps in
  proportion to a micro-batch's activations (`calibrate_reserve`).

A tensor-parallel shard of size t is measured in one process by giving the layer a
1-process group that claims size t: the layer has exactly a t-rank's shapes and its
all-reduces become local copies, so the time is compute only (the cost model adds the
communication separately from the measured bandwidths).

The profile records the machine's fingerprint (ptdp.hardware.machine_fingerprint), so
`ptdp plan` and tools/validate_planner.py can tell when a profile comes from elsewhere. On a
GPU the datasheet peak of the --base profile stays the profile's peak (the one the trainer's
`mfu` also divides by); the measured GEMM rate becomes `efficiency.gemm_max`, its share.

This module depends on the planner (for the model YAML loader) and the trainer's model code;
nothing in ptdp.planner imports it. torch is imported inside functions only, so `ptdp
profile --help` stays fast.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import resource
import time
from pathlib import Path

from ptdp.hardware import (Efficiency, HardwareProfile, load_hardware, machine_fingerprint,
                           save_hardware)
from ptdp.planner.errors import PlanError
from ptdp.profile_tensor import measure_tensor_layers

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


# --------------------------------------------------------------------------------------------
# Timing helpers
# --------------------------------------------------------------------------------------------

def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device):
    """CPU time for single-threaded CPU work (immune to other processes sharing the cores),
    wall time otherwise (GPUs, several threads, anything that waits)."""
    import torch
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _best_time(fn, device, iters: int, warmup: int = 1, clock=None) -> float:
    """Best of `iters` timed runs: other processes only ever add time, so the minimum is the
    least noisy estimate of the work itself (as timeit recommends)."""
    clock = clock or _clock(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        start = clock()
        fn()
        _sync(device)
        times.append(clock() - start)
    return min(times)


def saved_bytes(fn, exclude: set) -> tuple[object, int]:
    """Run fn() and count the bytes autograd saves for backward (unique storages, minus
    `exclude`, e.g. parameters)."""
    import torch
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in exclude:
            seen[ptr] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


# --------------------------------------------------------------------------------------------
# Model pieces
# --------------------------------------------------------------------------------------------

def _ensure_process_group() -> None:
    """A 1-process gloo world so layers that believe t > 1 can call their collectives."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    from ptdp.local_ranks import free_port
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)


def _context(model_cfg, t: int, device, recompute: str = "none"):
    from models.transformer import ModelContext
    from ptdp.config import padded_vocab_size
    from ptdp.parallel.tensor import TensorParallel, TensorParallelRNG
    tp = TensorParallel(group=None, rank=0, size=t)
    return ModelContext(model_cfg, tp, 1234, TensorParallelRNG(1234, 0, device),
                        padded_vocab_size(model_cfg.vocab_size, t), recompute, 1)


def _param_storages(module) -> set:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


def measure_layer(model_cfg, t: int, b: int, precision: str, device, iters: int) -> dict:
    """One row of `measured.layers`: a layer shard's times and bytes at micro-batch b."""
    import torch
    from models.transformer import TransformerStack
    dtype = getattr(torch, DTYPES[precision])
    causal = model_cfg.arch == "gpt"
    m = model_cfg
    row = dict(hidden=m.hidden_size, heads=m.num_heads, ffn=m.ffn_hidden_size, seq=m.seq_length,
               tensor=t, precision=precision, micro_batch=b)
    x = torch.randn(m.seq_length, b, m.hidden_size, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    for recompute in ("none", "selective", "full"):
        stack = TransformerStack(_context(m, t, device, recompute), 0, 1, causal).to(device, dtype)
        stack.train()
        out, nbytes = saved_bytes(lambda: stack(x), _param_storages(stack) | {x.untyped_storage().data_ptr()})
        out.backward(grad)
        # The layer input is kept by the previous layer's LayerNorm or the checkpoint: count it.
        row[f"activation_bytes_{recompute}"] = nbytes + x.numel() * x.element_size()
        if recompute == "none":
            layer = stack
            row["weight_bytes"] = sum(p.numel() * p.element_size() for p in stack.parameters())
    state = {}

    def forward():
        state["y"] = layer(x)

    def backward():
        state["y"].backward(grad)

    row["forward_s"] = _best_time(forward, device, iters)
    fwd_bwd = _best_time(lambda: (forward(), backward()), device, iters)
    row["backward_s"] = max(fwd_bwd - row["forward_s"], 1e-9)
    row["attention_forward_s"] = _attention_time(layer.layers[0].attention, x, device, iters)
    split = TransformerStack(dataclasses.replace(_context(m, t, device), split_backward=True),
                             0, 2, causal).to(device, dtype)   # per layer: 2 layers, halved
    row["backward_split_s"] = _split_backward_time(
        lambda: split(x), lambda out: out.backward(grad), device, iters) / 2
    return row


def _split_backward_time(forward, backward, device, iters: int, deferred: int = 4) -> float:
    """Seconds of one micro-batch's backward split in two, B now and W later (zb-h1):
    `forward()` returns what `backward(out)` back-propagates; the `deferred` micro-batches'
    B passes all run before their W passes, as when a rank holds W back for a bubble. The W
    pass then finds its inputs gone from the caches, which costs more than the split itself
    (on a CPU core: ~10-25 % over a plain backward)."""
    from ptdp.parallel.weight_grad import STORE
    forwards = _best_time(lambda: [forward() for _ in range(deferred)], device, iters)

    def split_passes():
        for key, out in enumerate([forward() for _ in range(deferred)]):
            with STORE.defer(("profile", key)):
                backward(out)
        for key in range(deferred):
            STORE.run(("profile", key))

    try:
        total = _best_time(split_passes, device, iters)
    finally:
        STORE.clear()
    return max(total - forwards, 1e-9) / deferred


def _attention_time(attention, x, device, iters: int) -> float:
    import torch
    s, b, _ = x.shape
    heads, dh = attention.local_heads, attention.ctx.model.head_dim
    q, k, v = (torch.randn(b, heads, s, dh, device=device, dtype=x.dtype, requires_grad=True)
               for _ in range(3))
    return _best_time(lambda: attention.core_attention(q, k, v, None), device, iters)


def measure_head(model_cfg, t: int, b: int, precision: str, device, iters: int) -> dict:
    """One row of `measured.heads`: embedding and final LN + logits + loss at micro-batch b."""
    import torch
    from models.embedding import Embedding, logits
    from models.transformer import layer_norm
    from ptdp.parallel.tensor import vocab_parallel_cross_entropy
    m = model_cfg
    dtype = getattr(torch, DTYPES[precision])
    ctx = _context(m, t, device)
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
        state["h"] = vocab_parallel_cross_entropy(out, tokens.t(), m.vocab_size, ctx.tp).mean()

    row = dict(hidden=m.hidden_size, seq=m.seq_length, tensor=t, vocab=ctx.padded_vocab_size,
               precision=precision, micro_batch=b)
    row["embed_forward_s"] = _best_time(embed, device, iters)
    grad = torch.randn(m.seq_length, b, m.hidden_size, device=device, dtype=dtype)
    both = _best_time(lambda: (embed(), state["e"].backward(grad)), device, iters)
    row["embed_backward_s"] = max(both - row["embed_forward_s"], 1e-9)
    row["head_forward_s"] = _best_time(head, device, iters)
    both = _best_time(lambda: (head(), state["h"].backward()), device, iters)
    row["head_backward_s"] = max(both - row["head_forward_s"], 1e-9)
    split_ctx = dataclasses.replace(ctx, split_backward=True)
    split_embedding = Embedding(split_ctx).to(device, dtype)
    row["embed_backward_split_s"] = _split_backward_time(
        lambda: split_embedding(tokens), lambda out: out.backward(grad), device, iters)
    row["head_backward_split_s"] = _split_backward_time(
        lambda: vocab_parallel_cross_entropy(
            logits(final_ln(hidden), split_embedding.word.weight, split_ctx), tokens.t(),
            m.vocab_size, ctx.tp).mean(),
        lambda loss: loss.backward(), device, iters)
    return row


# --------------------------------------------------------------------------------------------
# The device: GEMM rate and shape model, memory bandwidth, launch cost
# --------------------------------------------------------------------------------------------

def _gemm_seconds(m: int, n: int, k: int, dtype, device, iters: int) -> float:
    import torch
    a = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(k, n, device=device, dtype=dtype)
    return _best_time(lambda: torch.mm(a, w), device, iters)


def measure_device(precision: str, device, iters: int) -> dict:
    """Peak GEMM FLOP/s, the half-efficiency dimension, HBM/DRAM bandwidth, launch cost."""
    import torch
    dtype = getattr(torch, DTYPES[precision])
    big = 4096 if device.type == "cuda" else 768
    peak = 2 * big**3 / _gemm_seconds(big, big, big, dtype, device, iters)
    launch = _best_time(lambda: torch.add(torch.ones(1, device=device), 1), device, iters * 20)
    shapes = [(32, 32, 32), (64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 64, 512),
              (512, 512, 32), (1024, 128, 256)]
    samples = [(shape, _gemm_seconds(*shape, dtype, device, iters)) for shape in shapes]
    nbytes = (256 if device.type == "cuda" else 64) * 2**20
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * nbytes / _best_time(lambda: dst.copy_(src), device, iters)
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

    return _best_time(step, device, iters) / numel


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


# --------------------------------------------------------------------------------------------
# Collectives between local ranks
# --------------------------------------------------------------------------------------------

SIZES = (2**10, 2**14, 2**18, 2**21)   # float32 elements


def peak_rss_gb() -> float:
    """This process's resident-memory high-water mark (VmHWM). Unlike getrusage's ru_maxrss
    it is not inherited across fork+exec, so a large launcher does not inflate it."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20   # kB -> GiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _train_quietly(model: dict, train: dict, world: int, **sections) -> list:
    """The real trainer's history for `model` on synthetic data on CPU (`train` and the other
    config sections on top), its output silenced: the calibration runs below."""
    import contextlib

    from ptdp.config import config_from_dict, validate
    from ptdp.training import Trainer
    cfg = config_from_dict({"model": model, "data": {"source": "synthetic"},
                            "train": {"device": "cpu", **train},
                            "log": {"progress": False, "interval": 1000}, **sections})
    validate(cfg, world)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        return Trainer(cfg).train()


def _framework_baseline(world: int) -> tuple[float, float]:
    """(peak GiB, seconds per iteration) of a rank that trains a negligible model with the real
    trainer: interpreter, torch, process groups, data and allocator memory (on CPU the
    counterpart of a GPU's CUDA context reserve) and the per-iteration host overhead, which
    the planner adds to every layout."""
    tiny = {"arch": "gpt", "num_layers": 1, "hidden_size": 8, "num_heads": 2, "seq_length": 8,
            "vocab_size": 64}
    history = _train_quietly(tiny, {"micro_batch_size": 1, "global_batch_size": world,
                                    "iters": 4}, world, parallel={"data": world})
    return peak_rss_gb(), min(r["step_time_s"] for r in history[1:])


# The reserve is calibrated on short runs of the profiled model, as
# name -> (layout, schedule, micro-batch, global batch).
# The allocator keeps more freed memory under the pipelined schedules, interleaved and zb-h1
# most, than under plain data parallelism (measured: 22-45 MiB per rank at h = 512), more with
# more layers, and more with larger micro-batches: the 2BW pair at b = 1 and b = 4 measures
# that growth (`measured.heap_retention`, per byte of activations a micro-batch allocates),
# the rest the fixed part.
RESERVE_RUNS = {"d2": ({"data": 2}, "1f1b", 1, 4),
                "p2-zb": ({"pipeline": 2}, "zb-h1", 1, 8),
                "p2v2": ({"pipeline": 2, "chunks": 2}, "interleaved", 1, 8),
                "p2-2bw": ({"pipeline": 2}, "2bw", 1, 8),
                "p2-2bw-b4": ({"pipeline": 2}, "2bw", 4, 8)}
RETENTION_PAIR = ("p2-2bw", "p2-2bw-b4")
# Each run is repeated and its largest peak kept: the same run's peak varies by up to ~17 MiB
# (3 %) from one time to the next (gloo's threads and the schedule's timing decide which
# tensors are alive together), and the prediction should err on the safe side.
RESERVE_REPEATS = 2


def _calibration_peak(model: dict, precision: str, parallel: dict, schedule: str,
                      micro_batch: int, batch: int) -> float:
    """Peak GiB of a rank training the profiled model with the real trainer: runs on every
    rank of a run_on_ranks world."""
    import torch.distributed as dist
    _train_quietly(model, {"micro_batch_size": micro_batch, "global_batch_size": batch,
                           "iters": 3, "precision": precision},
                   dist.get_world_size(), parallel=parallel, schedule={"name": schedule})
    return peak_rss_gb()


OVERHEAD_MICRO_BATCHES = 4
# The 1F1B and zb-h1 runs are repeated in turns and the medians taken: one pair of runs on a
# shared VM gave zb-h1's split overhead anywhere from 1.8 to 8.3 ms per layer and micro-batch.
OVERHEAD_REPEATS = 3


def _trainer_steps(model: dict, precision: str, micro_batches: int, schedules: list,
                   reference_b: int) -> list:
    """For each schedule in turn, (best step seconds of the real trainer on one rank for the
    profiled model at b = 1, seconds of one layer's forward + backward at `reference_b`
    timed right after)."""
    import torch
    from ptdp.config import ModelConfig
    out = []
    for schedule in schedules:
        history = _train_quietly(model, {"micro_batch_size": 1, "iters": 8,
                                         "global_batch_size": micro_batches,
                                         "precision": precision, "lr_warmup_iters": 0},
                                 1, schedule={"name": schedule})
        step = min(r["step_time_s"] for r in history[1:])   # best, as the kernels are timed
        # The machine's speed drifts (a shared VM: by up to ~20 % within minutes): time one
        # layer again now, so the step is compared with kernels timed at the same speed.
        _ensure_process_group()
        row = measure_layer(ModelConfig(**model), 1, reference_b, precision,
                            torch.device("cpu"), 5)
        out.append((step, row["forward_s"] + row["backward_s"]))
    return out


def calibrate_layer_overhead(profile: HardwareProfile, model_cfg, precision: str,
                             threads: int) -> dict:
    """What the trainer spends per layer and micro-batch beyond the layer's own kernels
    (gradient-accumulation hooks into the flat fp32 buffers, autograd bookkeeping across
    layers, the data path): the real trainer's step on one rank for the profiled model at
    b = 1, minus the planner's prediction for that run without it, per layer and micro-batch.
    On CPU ranks it is measured at 0-3 ms per layer of a h = 512 GPT, up to a tenth of the
    layer at b = 1: layouts with small micro-batches pay it most.

    zb-h1's split backward as the trainer runs it (closures, a second autograd pass per
    micro-batch) is measured the same way against the 1F1B run: 2-8 ms per layer at h = 512,
    b = 1, more than the split layer alone costs (backward_split_s), so the cost model takes
    the larger. Both are medians over OVERHEAD_REPEATS pairs of runs taken in turns."""
    import dataclasses
    import statistics

    from ptdp.local_ranks import run_on_ranks
    from ptdp.planner.compute import ModelShape
    from ptdp.planner.cost_model import Layout, Workload, predict
    model = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(model_cfg)}
    m = OVERHEAD_MICRO_BATCHES
    measured = dict(profile.measured or {}, layer_overhead_s=0.0)
    reference = min((r for r in measured["layers"] if r["tensor"] == 1),
                    key=lambda r: r["micro_batch"])
    layer_then = reference["forward_s"] + reference["backward_s"]
    runs = run_on_ranks(1, _trainer_steps, model, precision, m,
                        ["1f1b", "zb-h1"] * OVERHEAD_REPEATS, reference["micro_batch"],
                        timeout_s=900.0, threads=threads)[0]
    shape = ModelShape.from_config(model_cfg)
    kernels = predict(dataclasses.replace(profile, measured=measured),
                      Workload(shape, m, precision, profile.gpus_per_node),
                      Layout(micro_batch=1)).step_time_s
    pairs = [(step, layer_now, split * layer_now / split_layer)   # zb-h1 at the 1F1B's speed
             for (step, layer_now), (split, split_layer) in zip(runs[::2], runs[1::2])]
    step = statistics.median(step for step, _, _ in pairs)
    predicted = statistics.median(kernels * layer_now / layer_then for _, layer_now, _ in pairs)
    split = statistics.median(split for _, _, split in pairs)
    per_layer = statistics.median(max(step - kernels * now / layer_then, 0.0)
                                  for step, now, _ in pairs) / (m * shape.layers)
    split_extra = statistics.median(max(split - step, 0.0)
                                     for step, _, split in pairs) / (m * shape.layers)
    return {"step_s": step, "model_s": predicted, "layer_overhead_s": per_layer,
            "split_step_s": split, "split_backward_overhead_s": split_extra}


def calibrate_reserve(profile: HardwareProfile, model_cfg, precision: str,
                      threads: int) -> dict:
    """The CPU reserve: what a real training rank holds beyond everything the memory model
    counts (interpreter, torch, process groups, the kernels' workspaces for this shape, the
    allocator's retained heap). Each of RESERVE_RUNS gives its peak (the largest of
    RESERVE_REPEATS) minus the planner's prediction with no reserve; the RETENTION_PAIR's
    growth per byte of activations a micro-batch allocates is `heap_retention`, and the
    reserve the largest of what is left."""
    import dataclasses

    from ptdp.local_ranks import run_on_ranks
    model = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(model_cfg)}
    runs = {}
    for name, (parallel, schedule, micro_batch, batch) in RESERVE_RUNS.items():
        stages = parallel.get("pipeline", 1) * parallel.get("chunks", 1)
        if model_cfg.num_layers % stages:
            continue   # the profiled model cannot be split that way
        world = parallel.get("pipeline", 1) * parallel.get("data", 1)
        peak = max(max(run_on_ranks(world, _calibration_peak, model, precision, parallel,
                                    schedule, micro_batch, batch, timeout_s=600.0,
                                    threads=threads))
                   for _ in range(RESERVE_REPEATS))
        runs[name] = reserve_from_peak(profile, model_cfg, precision, peak, name)
    return {**reserve_and_retention(runs), "runs": runs}


def reserve_and_retention(runs: dict) -> dict:
    """{reserve_gb, heap_retention} from calibrate_reserve's runs (each with its `excess_gb`
    over the model and `activations_gb`, what one micro-batch allocates on a rank):
    the retention is the excess's growth with the activations between the RETENTION_PAIR,
    never negative; the reserve the largest excess left once the retention is taken out."""
    low, high = (runs.get(name) for name in RETENTION_PAIR)
    retention = 0.0
    if low and high and high["activations_gb"] > low["activations_gb"]:
        retention = max((high["excess_gb"] - low["excess_gb"])
                        / (high["activations_gb"] - low["activations_gb"]), 0.0)
    reserve = max(max(r["excess_gb"] - retention * r["activations_gb"] for r in runs.values()),
                  0.0)
    return {"reserve_gb": reserve, "heap_retention": retention}


def reserve_from_peak(profile: HardwareProfile, model_cfg, precision: str, peak: float,
                      run: str) -> dict:
    """calibrate_reserve's arithmetic for one of RESERVE_RUNS, given its peak GiB: the
    excess over the planner's prediction without reserve and retention, and the activations
    one micro-batch allocates on a rank, which the heap retains in proportion to
    (ptdp/planner/memory.py, heap_retention_bytes)."""
    import dataclasses

    from ptdp.planner.compute import ModelShape
    from ptdp.planner.cost_model import Layout, Workload, predict
    from ptdp.planner.memory import layer_activation_bytes
    parallel, schedule, micro_batch, batch = RESERVE_RUNS[run]
    measured = {**(profile.measured or {}), "heap_retention": 0.0}
    bare = dataclasses.replace(profile, memory_reserved_gb=0.0, measured=measured)
    shape = ModelShape.from_config(model_cfg)
    p = parallel.get("pipeline", 1)
    layout = Layout(p, 1, parallel.get("data", 1), parallel.get("chunks", 1), micro_batch,
                    schedule)
    predicted = predict(bare, Workload(shape, batch, precision, profile.gpus_per_node),
                        layout).memory_gb_per_gpu
    activations = shape.layers // p * layer_activation_bytes(
        shape, micro_batch, 1, precision, "none", profile.attention, bare) / 2**30
    return {"peak_gb": peak, "model_gb": predicted, "excess_gb": peak - predicted,
            "activations_gb": activations, "run": run}


def _bench_collectives(sizes, iters: int) -> dict:
    """Runs on every rank of a run_on_ranks world; rank 0's result is used."""
    import torch
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    baseline_gb, overhead_s = _framework_baseline(world)
    device = torch.device("cpu")
    out = {"world": world, "baseline_gb": baseline_gb, "overhead_s": overhead_s,
           "all_reduce": [], "p2p": []}
    for n in sizes:
        buf = torch.ones(n)
        dist.barrier()
        out["all_reduce"].append((n * 4, _best_time(lambda: dist.all_reduce(buf), device, iters,
                                                    warmup=2, clock=time.perf_counter)))
        dist.barrier()

        def ping_pong():
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        out["p2p"].append((n * 4, _best_time(ping_pong, device, iters, warmup=2,
                                             clock=time.perf_counter) / 2))
    return out


def _typical_time(fn, iters: int, oversubscribed: bool, warmup: int = 2) -> float:
    """Wall seconds of fn() on a busy node. With more ranks than cores, waiting for a
    descheduled peer is part of every collective, so the median; otherwise the best run, as
    elsewhere here (other jobs on the machine only ever add time)."""
    import statistics
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) if oversubscribed else min(times)


def _contention_work():
    """A layer-like mix: a GEMM of the validation layer's size and a memory-bound copy."""
    import torch
    a, w = torch.randn(256, 512), torch.randn(512, 2048)
    src = torch.randn(2**21)
    dst = torch.empty_like(src)
    return lambda: (torch.mm(a, w), dst.copy_(src))


def _cpu_seconds(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    start = time.thread_time()
    for _ in range(iters):
        fn()
    return (time.thread_time() - start) / iters


# The collectives the trainer calls, each measured on its own: on gloo a reduce-scatter costs
# more than an all-reduce of the same buffer and an all-gather less than half of one, so the
# NCCL identity all-reduce = reduce-scatter + all-gather does not hold on CPU ranks.
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def _collective(kind: str, buf, group, n: int):
    """fn() running one `kind` collective of the n-rank `group` over the whole `buf` (an
    all-gather's result, a reduce-scatter's input), with the calls the trainer makes."""
    import torch.distributed as dist
    shard = buf[: buf.numel() // n].clone()
    if kind == "all_reduce":
        return lambda: dist.all_reduce(buf, group=group)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(shard, buf, group=group)
    return lambda: dist.all_gather_single(buf, shard, group=group)


def _bench_busy_node(sizes, iters: int, threads: int) -> dict:
    """Every rank of this world busy at once, as in training (rank 0's view):
    * `slowdown` of compute: ranks x threads / cores when they outnumber the cores (time
      slicing), times `contention`, the CPU time of the same work with every rank running it
      over its CPU time with each rank running it alone (shared memory bandwidth and caches).
      CPU time, not wall time, so other jobs on the machine do not inflate it;
    * all-reduce in concurrent groups of n consecutive ranks for n = 2, 4, ... world (the
      tensor- and data-parallel groups of a grid), and send/recv between rank pairs
      (2k, 2k+1), all pairs at once (pipeline neighbours): median wall times, since waiting
      for descheduled peers is part of what ranks on oversubscribed cores see."""
    import torch
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    work = _contention_work()
    alone = 0.0
    for turn in range(world):   # one rank at a time; the others sleep in the barrier
        if turn == rank:
            alone = _cpu_seconds(work, iters)
        dist.barrier()
    together = _cpu_seconds(work, iters)
    contention = max(together / alone, 1.0)
    time_slicing = max(world * threads / len(os.sched_getaffinity(0)), 1.0)
    out = {"world": world, "slowdown": time_slicing * contention, "contention": contention,
           "all_reduce": {}, "reduce_scatter": {}, "all_gather": {}, "p2p": []}
    over = time_slicing > 1.0
    n = 2
    while n <= world:
        groups = [dist.new_group(list(range(g, g + n))) for g in range(0, world, n)]
        mine = groups[rank // n]
        for kind in COLLECTIVES:
            samples = []
            for numel in sizes:
                run = _collective(kind, torch.ones(numel - numel % n), mine, n)
                dist.barrier()
                samples.append((numel * 4, _typical_time(run, iters, over)))
            out[kind][n] = samples
        n *= 2
    peer = rank ^ 1
    for numel in sizes:
        buf = torch.ones(numel)
        dist.barrier()

        def ping_pong():
            if peer >= world:
                return
            if rank % 2 == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)

        out["p2p"].append((numel * 4, _typical_time(ping_pong, iters, over) / 2))
    return out


def _ring_fit(kind: str, n: int, samples) -> dict:
    """Bus bandwidth and per-step latency of a ring collective from (buffer bytes, seconds):
    an all-reduce moves 2(n-1)/n of the buffer in 2(n-1) steps, the halves (n-1)/n in n-1."""
    steps = (2 if kind == "all_reduce" else 1) * (n - 1)
    slope, intercept = fit_latency_bandwidth([(steps / n * nbytes, sec) for nbytes, sec in samples])
    return {"group": n, "bandwidth_GBps": 1e-9 / slope, "latency_us": intercept / steps * 1e6}


def measure_busy_nodes(max_ranks: int, threads: int, iters: int, log=print) -> list[dict]:
    """`measured.busy` rows, one per world of 2, 4, ... max_ranks ranks (see _bench_busy_node):
    {ranks, slowdown, all_reduce: [{group, bandwidth_GBps, latency_us}], p2p: {...}}."""
    from ptdp.local_ranks import run_on_ranks
    rows = []
    world = 2
    while world <= max_ranks:
        result = run_on_ranks(world, _bench_busy_node, SIZES, iters, threads, timeout_s=600.0,
                              threads=threads)[0]
        row = {"ranks": world, "slowdown": result["slowdown"],
               "contention": result["contention"]}
        for kind in COLLECTIVES:
            row[kind] = [_ring_fit(kind, n, samples)
                         for n, samples in sorted(result[kind].items())]
        slope, intercept = fit_latency_bandwidth(result["p2p"])
        row["p2p"] = {"bandwidth_GBps": 1e-9 / slope, "latency_us": intercept * 1e6}
        rows.append(row)
        log(f"  {world} busy ranks: compute x{row['slowdown']:.2f} (contention "
            f"x{row['contention']:.2f}), all-reduce "
            + ", ".join(f"n={r['group']} {r['bandwidth_GBps']:.2f} GB/s {r['latency_us']:.0f} us"
                        for r in row["all_reduce"])
            + f"; p2p {row['p2p']['bandwidth_GBps']:.2f} GB/s")
        world *= 2
    return rows


def fit_latency_bandwidth(points) -> tuple[float, float]:
    """(seconds per byte, latency seconds) from (bytes, seconds) samples: the slope between
    the two largest messages (bandwidth-bound), the latency as the smallest residual of the
    others (latency-bound); more robust to one noisy sample than a least-squares line."""
    points = sorted(points)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    slope = max((y1 - y0) / (x1 - x0), y1 / x1 * 0.5, 1e-15)
    latency = max(min(y - slope * x for x, y in points[:-1]), 0.0)
    return slope, latency


def measure_collectives(ranks: int, threads: int, iters: int) -> dict:
    from ptdp.local_ranks import run_on_ranks
    result = run_on_ranks(ranks, _bench_collectives, SIZES, iters, timeout_s=300.0,
                          threads=threads)[0]
    n = result["world"]
    ring = [(2 * (n - 1) / n * nbytes, sec) for nbytes, sec in result["all_reduce"]]
    ar_slope, ar_intercept = fit_latency_bandwidth(ring)
    p2p_slope, p2p_intercept = fit_latency_bandwidth(result["p2p"])
    return {"ranks": n, "baseline_gb": result["baseline_gb"], "overhead_s": result["overhead_s"],
            "all_reduce": {"bandwidth_GBps": 1e-9 / ar_slope,
                           "latency_us": ar_intercept / (2 * (n - 1)) * 1e6,
                           "samples": [list(p) for p in result["all_reduce"]]},
            "p2p": {"bandwidth_GBps": 1e-9 / p2p_slope, "latency_us": p2p_intercept * 1e6,
                    "samples": [list(p) for p in result["p2p"]]}}


# --------------------------------------------------------------------------------------------
# Putting the profile together
# --------------------------------------------------------------------------------------------

def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise PlanError(f"{flag} '{text}': expected comma-separated integers") from err
    if not values or min(values) < 1:
        raise PlanError(f"{flag} '{text}': expected positive integers")
    return values


def _total_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def build_profile(model_cfg, *, name: str, micro_batches: list[int], tensors: list[int],
                  ranks: int, ranks_per_node: int, threads: int, precision: str, device_name: str,
                  iters: int, base: str | None = None, log=print) -> HardwareProfile:
    import torch
    torch.set_num_threads(threads)
    device = torch.device("cuda" if device_name == "cuda" or (
        device_name == "auto" and torch.cuda.is_available()) else "cpu")
    for t in tensors:
        if model_cfg.num_heads % t or model_cfg.ffn_hidden_size % t:
            raise PlanError(f"--tensor {t}: model.num_heads and ffn_hidden_size must divide by it")
    _ensure_process_group()
    log(f"profiling on {device} ({threads} thread(s)), {precision}")
    dev = measure_device(precision, device, iters)
    log(f"  GEMM peak {dev['peak_flops'] / 1e12:.3f} TFLOP/s, memory "
        f"{dev['memory_Bps'] / 1e9:.1f} GB/s, launch {dev['launch_s'] * 1e6:.1f} us, "
        f"half-dim {dev['half_dim']}")
    layers, heads = [], []
    for t in tensors:
        for b in micro_batches:
            layers.append(measure_layer(model_cfg, t, b, precision, device, iters))
            heads.append(measure_head(model_cfg, t, b, precision, device, iters))
            row = layers[-1]
            log(f"  layer t={t} b={b}: fwd {row['forward_s'] * 1e3:.2f} ms, bwd "
                f"{row['backward_s'] * 1e3:.2f} ms, saved {row['activation_bytes_none'] / 2**20:.1f} MiB")
    comms = None
    if device.type == "cpu" and ranks > 1:
        comms = measure_collectives(ranks, threads, max(iters, 3))
        log(f"  all-reduce {comms['all_reduce']['bandwidth_GBps']:.2f} GB/s bus, "
            f"p2p {comms['p2p']['bandwidth_GBps']:.2f} GB/s, {comms['p2p']['latency_us']:.0f} us")
    measured = {"threads": threads, "device": str(device), "torch": str(torch.__version__),
                "host": platform.node(), "optimizer_s_per_param": dev["optimizer_s_per_param"],
                "layers": layers, "heads": heads}
    if comms:
        measured.update(all_reduce=comms["all_reduce"], p2p={
            k: comms["p2p"][k] for k in ("bandwidth_GBps", "latency_us", "samples")})
        measured["busy"] = measure_busy_nodes(max(ranks, 2), threads, max(iters, 5), log)
        measured["tensor_layers"] = measure_tensor_layers(
            model_cfg, tensors, micro_batches, precision, [row["ranks"] for row in measured["busy"]],
            threads, max(iters, 9), log)
    profile = _assemble(name, device, precision, dev, comms, measured, ranks_per_node, base)
    if device.type == "cpu" and comms:
        overhead = calibrate_layer_overhead(profile, model_cfg, precision, threads)
        measured["layer_overhead_s"] = overhead["layer_overhead_s"]
        measured["split_backward_overhead_s"] = overhead["split_backward_overhead_s"]
        log(f"  trainer on one rank, b=1: {overhead['step_s'] * 1e3:.1f} ms per step against "
            f"{overhead['model_s'] * 1e3:.1f} ms from the kernels: "
            f"{overhead['layer_overhead_s'] * 1e3:.2f} ms per layer and micro-batch on top; "
            f"zb-h1's split backward {overhead['split_step_s'] * 1e3:.1f} ms: "
            f"{overhead['split_backward_overhead_s'] * 1e3:.2f} ms per layer and micro-batch more")
        calibration = calibrate_reserve(profile, model_cfg, precision, threads)
        measured["memory_calibration"] = calibration
        measured["heap_retention"] = round(calibration["heap_retention"], 4)
        profile.memory_reserved_gb = round(calibration["reserve_gb"], 4)
        log("  reserve: " + ", ".join(
            f"{name} run peak {run['peak_gb']:.3f} GiB, modelled {run['model_gb']:.3f} GiB"
            for name, run in calibration["runs"].items())
            + f": reserve {calibration['reserve_gb']:.3f} GiB, and "
            f"{calibration['heap_retention']:.2f} x a micro-batch's activations")
    return profile


def _assemble(name, device, precision, dev, comms, measured, ranks_per_node, base) -> HardwareProfile:
    """Measured numbers on top of a base profile (GPU) or on their own (CPU)."""
    efficiency = Efficiency(gemm_max=1.0, gemm_half_dim=float(dev["half_dim"]), attention=1.0,
                            kernel_launch_us=dev["launch_s"] * 1e6, memory=1.0, collective=1.0,
                            host_overhead_s=comms["overhead_s"] if comms else 0.0)
    if base:
        profile = load_hardware(base)
        profile.name, profile.source = name, f"measured over {base}"
        # One peak per device: the datasheet's stays (MFU divides by it, in the planner and
        # the trainer alike); the measured large-GEMM rate is its achievable share.
        datasheet = profile.peak_tflops.get(precision)
        if datasheet:
            efficiency.gemm_max = dev["peak_flops"] / (datasheet * 1e12)
        else:
            profile.peak_tflops = {**profile.peak_tflops, precision: dev["peak_flops"] / 1e12}
        profile.efficiency = efficiency
        profile.memory_bandwidth_GBps = dev["memory_Bps"] / 1e9
        profile.measured = measured
        profile.fingerprint = machine_fingerprint()
        return profile
    if device.type == "cuda":
        raise PlanError("profiling a GPU needs --base NAME for what one GPU cannot measure "
                        "(node size, NVLink and network bandwidth)")
    all_reduce = comms["all_reduce"] if comms else {"bandwidth_GBps": 10.0, "latency_us": 50.0}
    baseline = comms["baseline_gb"] if comms else 0.3
    return HardwareProfile(
        name=name, description=f"measured on {platform.node()} ({os.cpu_count()} CPU cores)",
        source="measured", device="cpu", compute_units=len(os.sched_getaffinity(0)),
        memory_gb=round(_total_memory_gb() / ranks_per_node, 3), memory_reserved_gb=round(baseline, 3),
        memory_headroom=0.0, memory_bandwidth_GBps=dev["memory_Bps"] / 1e9,
        # A CPU has no datasheet peak: its measured GEMM rate is the peak (for MFU too).
        peak_tflops={precision: dev["peak_flops"] / 1e12}, default_precision=precision,
        gpus_per_node=ranks_per_node,
        intra_node_bandwidth_GBps=all_reduce["bandwidth_GBps"],
        intra_node_latency_us=all_reduce["latency_us"],
        inter_node_bandwidth_GBps=all_reduce["bandwidth_GBps"],
        inter_node_latency_us=all_reduce["latency_us"], nics_per_node=ranks_per_node,
        attention="flash", overlap_communication=False, overlap_pipeline=True,
        efficiency=efficiency, measured=measured,
        fingerprint=machine_fingerprint())


def main(args) -> int:
    from ptdp.planner.cli import load_model_yaml
    _, cfg = load_model_yaml(args.model)
    out = Path(args.out)
    try:
        profile = _profile_from_args(cfg, args, out)
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    out.parent.mkdir(parents=True, exist_ok=True)
    save_hardware(profile, out, header=(
        f"Written by `ptdp profile` ({args.threads} thread(s) per rank) for {cfg.model.arch} "
        f"l={cfg.model.num_layers} h={cfg.model.hidden_size} a={cfg.model.num_heads} "
        f"f={cfg.model.ffn_hidden_size} s={cfg.model.seq_length} V={cfg.model.vocab_size}.\n"
        "measured.layers/heads hold per-shard times for that model's shape; the efficiency\n"
        "block (GEMM rate, launch cost, memory bandwidth) serves every other shape."))
    print(f"wrote {out}")
    return 0


def _profile_from_args(cfg, args, out: Path) -> HardwareProfile:
    for t in _ints(args.tensor, "--tensor"):   # before any slow import
        if cfg.model.num_heads % t or cfg.model.ffn_hidden_size % t:
            raise PlanError(f"--tensor {t}: model.num_heads ({cfg.model.num_heads}) and "
                            f"ffn_hidden_size ({cfg.model.ffn_hidden_size}) must divide by it")
    return build_profile(
        cfg.model, name=args.name or out.stem, micro_batches=_ints(args.micro_batches, "--micro-batches"),
        tensors=_ints(args.tensor, "--tensor"), ranks=args.ranks, ranks_per_node=args.ranks_per_node,
        threads=args.threads, precision=args.precision, device_name=args.device, iters=args.iters,
        base=args.base)
