"""Run a function on N local ranks (one process each, gloo), for tests, tools and benchmarks.

Processes are forked from a server process that has imported torch, torch.distributed and the
trainer (`ptdp.training`, `PRELOAD`) and run nothing (multiprocessing's `forkserver`): forking
the caller after torch has run a threaded op can deadlock in OpenMP, and `spawn` makes every
rank import torch and the trainer again (seconds of CPU per rank on a small machine). The server starts once per calling process. Each rank
gets the caller's environment as it is at the call, as with `spawn`. A forked rank shares the
server's pages, which its resident set does not count until it touches them: measurements of a
rank's own memory (the profiler, tools/validate_planner.py) ask for `fresh_interpreters`, ranks
started as new interpreters like torchrun's. Every run has a hard timeout: a rank that hangs or
dies ends the whole run with an error naming it, never a hung caller.
"""

from __future__ import annotations

import gc
import io
import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the fork server imports before it forks any rank (never runs a torch op).
PRELOAD = ["torch", "torch.distributed", "ptdp.training"]


def _context(fresh_interpreters: bool):
    if fresh_interpreters:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)   # no effect once the server runs
    return ctx


def _rank_main(rank, world_size, port, fn, args, results, timeout_s, threads, environ):
    import torch
    import torch.distributed as dist
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        # Serialised to plain bytes: tensors passed through a torch queue live in shared
        # memory that vanishes when this process exits before the parent reads them.
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report, never hang the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # A fresh interpreter (spawn) ends through the interpreter's shutdown, whose cyclic
        # collection over torch's ~300,000 objects the caller would wait for (0.3-1 s);
        # frozen, they are left to the OS (ptdp/__main__.py does the same). Forked ranks
        # leave with os._exit anyway.
        gc.freeze()


def run_on_ranks(world_size: int, fn, *args, timeout_s: float = 120.0, threads: int = 1,
                 fresh_interpreters: bool = False) -> list:
    """fn(*args) on every rank of a fresh gloo world; returns the per-rank results in order.

    `fn` must be importable (a module-level function). Raises RankFailure naming the rank
    that failed, or the ranks that had not finished within `timeout_s`. `fresh_interpreters`:
    start each rank as a new interpreter (module docstring: for memory measurements).
    """
    ctx = _context(fresh_interpreters)
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world_size, port, fn, args, results, timeout_s, threads,
                               environ))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    finished = False
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise RankFailure(f"ranks {missing} did not finish within {timeout_s:.0f}s")
            try:
                # (a rank that dies without a word is noticed within 0.2 s + the 0.5 s below)
                rank, status, value = results.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]
                if dead:
                    time.sleep(0.5)  # let a final message arrive before declaring death
                    if results.empty():
                        raise RankFailure(f"rank {dead[0]} exited with code "
                                          f"{procs[dead[0]].exitcode} without a result")
                continue
            if status == "error":
                raise RankFailure(f"rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        finished = True
    finally:
        # Ranks that returned are leaving; after a failure the others are usually blocked on
        # the failed rank (a collective, a receive) and would only run out the grace.
        for p in procs:
            p.join(timeout=5 if finished else 0)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]
