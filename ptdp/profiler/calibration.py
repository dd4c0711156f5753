"""Calibrations against the real trainer on CPU ranks: the per-layer overhead beyond the
kernels, and the memory reserve with the heap the allocator keeps."""

from __future__ import annotations

import os

from ptdp.config.catalogue import INTERLEAVED, ONE_F_ONE_B, TWO_BW, ZERO_BUBBLE_H1
from ptdp.config.models import GPT
from ptdp.hardware import HardwareProfile
from ptdp.profiler.kernels import measure_layer
from ptdp.profiler.timing import ensure_process_group
from ptdp.runtime.process_memory import peak_rss_gb


def train_quietly(model: dict, train: dict, world: int, **sections) -> list:
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


def framework_baseline(world: int) -> tuple[float, float]:
    """(peak GiB, seconds per iteration) of a rank that trains a negligible model with the real
    trainer: interpreter, torch, process groups, data and allocator memory (on CPU the
    counterpart of a GPU's CUDA context reserve) and the per-iteration host overhead, which
    the planner adds to every layout."""
    tiny = {"arch": GPT.name, "num_layers": 1, "hidden_size": 8, "num_heads": 2, "seq_length": 8,
            "vocab_size": 64}
    history = train_quietly(tiny, {"micro_batch_size": 1, "global_batch_size": world,
                                    "iters": 4}, world, parallel={"data": world})
    return peak_rss_gb(), min(r["step_time_s"] for r in history[1:])


# The reserve is calibrated on short runs of the profiled model, as
# name -> (layout, schedule, micro-batch, global batch).
# The allocator keeps more freed memory under the pipelined schedules, interleaved and zb-h1
# most, than under plain data parallelism (measured: 22-45 MiB per rank at h = 512), more with
# more layers, and more with larger micro-batches: the 2BW pair at b = 1 and b = 4 measures
# that growth (`measured.heap_retention`, per byte of activations a micro-batch allocates),
# the rest the fixed part.
RESERVE_RUNS = {"d2": ({"data": 2}, ONE_F_ONE_B.name, 1, 4),
                "p2-zb": ({"pipeline": 2}, ZERO_BUBBLE_H1.name, 1, 8),
                "p2v2": ({"pipeline": 2, "chunks": 2}, INTERLEAVED.name, 1, 8),
                "p2-2bw": ({"pipeline": 2}, TWO_BW.name, 1, 8),
                "p2-2bw-b4": ({"pipeline": 2}, TWO_BW.name, 4, 8)}


RETENTION_PAIR = ("p2-2bw", "p2-2bw-b4")


# Each run is repeated and its largest peak kept: the same run's peak varies by up to ~17 MiB
# (3 %) from one time to the next (gloo's threads and the schedule's timing decide which
# tensors are alive together), and the prediction should err on the safe side.
RESERVE_REPEATS = 2

# Calibration runs at once (each of RESERVE_RUNS' worlds is 2 ranks): 4 processes.
CONCURRENT_RUNS = 2


def _calibration_peak(model: dict, precision: str, parallel: dict, schedule: str,
                      micro_batch: int, batch: int) -> float:
    """Peak GiB of a rank training the profiled model with the real trainer: runs on every
    rank of a run_on_ranks world."""
    import torch.distributed as dist
    train_quietly(model, {"micro_batch_size": micro_batch, "global_batch_size": batch,
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
        history = train_quietly(model, {"micro_batch_size": 1, "iters": 8,
                                         "global_batch_size": micro_batches,
                                         "precision": precision, "lr_warmup_iters": 0},
                                 1, schedule={"name": schedule})
        step = min(r["step_time_s"] for r in history[1:])   # best, as the kernels are timed
        # The machine's speed drifts (a shared VM: by up to ~20 % within minutes): time one
        # layer again now, so the step is compared with kernels timed at the same speed.
        ensure_process_group()
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

    from ptdp.runtime.local_ranks import run_on_ranks
    from ptdp.planner.compute import ModelShape
    from ptdp.planner.cost_model import Layout, Workload, predict
    model = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(model_cfg)}
    m = OVERHEAD_MICRO_BATCHES
    measured = dict(profile.measured or {}, layer_overhead_s=0.0)
    reference = min((r for r in measured["layers"] if r["tensor"] == 1),
                    key=lambda r: r["micro_batch"])
    layer_then = reference["forward_s"] + reference["backward_s"]
    schedules = [ONE_F_ONE_B.name, ZERO_BUBBLE_H1.name] * OVERHEAD_REPEATS
    runs = run_on_ranks(1, _trainer_steps, model, precision, m, schedules,
                        reference["micro_batch"], timeout_s=900.0, threads=threads)[0]
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
                      threads: int, repeats: int = RESERVE_REPEATS) -> dict:
    """The CPU reserve: what a real training rank holds beyond everything the memory model
    counts (interpreter, torch, process groups, the kernels' workspaces for this shape, the
    allocator's retained heap). Each of RESERVE_RUNS gives its peak (the largest of
    `repeats` runs) minus the planner's prediction with no reserve; the RETENTION_PAIR's
    growth per byte of activations a micro-batch allocates is `heap_retention`, and the
    reserve the largest of what is left."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from ptdp.runtime.local_ranks import run_on_ranks
    model = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(model_cfg)}

    def peak_of(name: str) -> float:
        parallel, schedule, micro_batch, batch = RESERVE_RUNS[name]
        world = parallel.get("pipeline", 1) * parallel.get("data", 1)
        return max(max(run_on_ranks(world, _calibration_peak, model, precision, parallel,
                                    schedule, micro_batch, batch, timeout_s=600.0,
                                    threads=threads, fresh_interpreters=True))
                   for _ in range(repeats))

    names = [name for name, (parallel, _, _, _) in RESERVE_RUNS.items()   # those the model
             if model_cfg.num_layers % (parallel.get("pipeline", 1)       # can be split into
                                        * parallel.get("chunks", 1)) == 0]
    # Each run's ranks are processes of their own and only their own peaks are read, so
    # CONCURRENT_RUNS of them run at once: one run's start-up (its interpreters importing
    # torch) overlaps another's training and exit.
    with ThreadPoolExecutor(CONCURRENT_RUNS) as pool:
        peaks = dict(zip(names, pool.map(peak_of, names)))
    runs = {name: reserve_from_peak(profile, model_cfg, precision, peaks[name], name)
            for name in names}
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
