"""Collectives and point-to-point between local ranks, alone and on nodes as busy as in
training, fitted as time = latency + bytes / bandwidth."""

from __future__ import annotations

import os
import time

from ptdp.profiler.calibration import framework_baseline
from ptdp.profiler.timing import best_time


SIZES = (2**10, 2**14, 2**18, 2**21)   # float32 elements


def _bench_collectives(sizes, iters: int) -> dict:
    """Runs on every rank of a run_on_ranks world; rank 0's result is used."""
    import torch
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    baseline_gb, overhead_s = framework_baseline(world)
    device = torch.device("cpu")
    out = {"world": world, "baseline_gb": baseline_gb, "overhead_s": overhead_s,
           "all_reduce": [], "p2p": []}
    for n in sizes:
        buf = torch.ones(n)
        dist.barrier()
        out["all_reduce"].append((n * 4, best_time(lambda: dist.all_reduce(buf), device, iters,
                                                    warmup=2, clock=time.perf_counter)))
        dist.barrier()

        def ping_pong():
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        out["p2p"].append((n * 4, best_time(ping_pong, device, iters, warmup=2,
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

    from ptdp.parallel.mappings import all_gather_single, reduce_scatter_single
    shard = buf[: buf.numel() // n].clone()
    if kind == "all_reduce":
        return lambda: dist.all_reduce(buf, group=group)
    if kind == "reduce_scatter":
        return lambda: reduce_scatter_single(shard, buf, group=group)
    return lambda: all_gather_single(buf, shard, group=group)


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

    from ptdp.parallel.grid import axis_rows, grid_layout, new_groups
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
        groups = new_groups(axis_rows(grid_layout(1, world // n, n), ["tensor"]))
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
    from ptdp.runtime.local_ranks import run_on_ranks
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
    from ptdp.runtime.local_ranks import run_on_ranks
    result = run_on_ranks(ranks, _bench_collectives, SIZES, iters, timeout_s=300.0,
                          threads=threads, fresh_interpreters=True)[0]
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
