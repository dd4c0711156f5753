"""Timing and memory helpers of the profiler, and the one-process context its layers run in."""

from __future__ import annotations

import time

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock_for(device):
    """CPU time for single-threaded CPU work (immune to other processes sharing the cores),
    wall time otherwise (GPUs, several threads, anything that waits)."""
    import torch
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def best_time(fn, device, iters: int, warmup: int = 1, clock=None) -> float:
    """Best of `iters` timed runs: other processes only ever add time, so the minimum is the
    least noisy estimate of the work itself (as timeit recommends)."""
    clock = clock or clock_for(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        start = clock()
        fn()
        sync(device)
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


def ensure_process_group() -> None:
    """A 1-process gloo world so layers that believe t > 1 can call their collectives. Its
    store lives in this process: a TCP store on a port found free a moment earlier can lose
    that port to another process first (seen with four GPU tests at once)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def layer_context(model_cfg, t: int, device, recompute: str = "none", compile: bool = False):
    """The context of a layer timed alone; `compile` as training compiles it (train.compile)."""
    from ptdp.models.transformer import ModelContext
    from ptdp.config import padded_vocab_size
    from ptdp.parallel.mappings import TensorParallel
    from ptdp.parallel.rng import TensorParallelRNG
    tp = TensorParallel(group=None, rank=0, size=t)
    return ModelContext(model_cfg, tp, 1234, TensorParallelRNG(1234, 0, device),
                        padded_vocab_size(model_cfg.vocab_size, t), recompute, 1, compile=compile)


def param_storages(module) -> set:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}
