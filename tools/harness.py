"""What the benchmarks in tools/ share: timing steps (alone, or sides alternating per round), a
world of one rank, the JSON they write and the tables they print. Local multi-rank jobs are ptdp's own (ptdp/runtime/local_ranks.py).

The tools import the installed `ptdp` and this module as a sibling: `python tools/bench_x.py`
puts tools/ first on sys.path, where `import harness` finds it; `python -m tools.bench_x` (from
the repository root) and the tests (`import tools.bench_x`) import the tool inside the `tools`
package, where it is `from . import harness`. Hence, at the top of each tool:

    if __package__:      # python -m tools.bench_x, or imported by a test
        from . import harness
    else:                # python tools/bench_x.py
        import harness

Ranks started by `run_on_ranks` import the tool the same way its parent did (multiprocessing
hands them the parent's sys.path and main module).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

@dataclass
class Timings:
    seconds: list[float]   # each timed call's seconds (the warm-up calls are not in it)
    results: list          # every call's return value, the warm-up calls' included

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def _is_cuda(device) -> bool:
    return device is not None and str(device).startswith("cuda")


def _timed_call(step, i: int, cuda: bool) -> tuple[object, float]:
    if not cuda:
        start = time.perf_counter()
        return step(i), time.perf_counter() - start
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    result = step(i)
    end.record()
    end.synchronize()
    return result, start.elapsed_time(end) / 1e3


def time_steps(step, steps: int, warmup: int = 0, device=None) -> Timings:
    """Call `step(i)` for i in range(warmup + steps) and time the last `steps` calls.

    On CUDA a call is timed by CUDA events recorded around it and waited for, so its time holds
    its kernels and not only their launch; elsewhere by the host's clock."""
    cuda = _is_cuda(device)
    seconds, results = [], []
    for i in range(warmup + steps):
        result, elapsed = _timed_call(step, i, cuda)
        results.append(result)
        if i >= warmup:
            seconds.append(elapsed)
    return Timings(seconds, results)


@dataclass
class Lap:
    """One side's timed call in a round of `alternating`."""
    wall: float      # seconds by the host's clock
    cpu: float       # seconds of this thread's CPU time (without what other processes took)
    result: object   # what the call returned


def alternating(sides: dict, rounds: int, warmup: int = 0, swap: bool = False,
                first: int = 0) -> list[dict]:
    """Time `step(i)` of each side once per round, the sides one after the other, so that a
    machine whose load drifts (a shared one) slows every side of a round alike: `warmup`
    untimed rounds, then `rounds` timed ones; i counts the rounds from `first`. `swap`: every
    other timed round runs the sides in reverse order, so that neither always goes first.

    `sides` is {name: step}; returns the timed rounds, each {name: Lap}."""
    names = list(sides)
    for i in range(warmup):
        for name in names:
            sides[name](first + i)
    timed = []
    for r in range(rounds):
        order = names[::-1] if swap and r % 2 else names
        laps = {}
        for name in order:
            wall, cpu = time.perf_counter(), time.thread_time()
            result = sides[name](first + warmup + r)
            laps[name] = Lap(time.perf_counter() - wall, time.thread_time() - cpu, result)
        timed.append({name: laps[name] for name in names})
    return timed


PASS_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}   # a pass tool's --dtype -> torch's name


def add_pass_arguments(parser, dtype_help: str) -> None:
    """The options of a tool that times forward + backward passes (`loss_passes`); --dtype's
    default is the tool's to set (None here)."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--dtype", choices=tuple(PASS_DTYPES), help=dtype_help)


def pass_dtype(name: str):
    """--dtype's torch dtype (torch imported here: the harness itself is torch-free)."""
    import torch
    return getattr(torch, PASS_DTYPES[name])


def check_pass_arguments(parser, args, sizes: tuple[str, ...]) -> None:
    """One line (parser.error) for a size, a round count or a warm-up out of range, or CUDA
    asked for and absent."""
    for name in (*sizes, "rounds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.device == "cuda" and not _cuda_available():
        parser.error("--device cuda but no CUDA device is visible")


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def loss_passes(paths: dict, zero_grads, device, rounds: int, warmup: int):
    """Forward + backward of each of `paths` ({name: () -> scalar loss}) in alternating rounds
    (`alternating`, every other round reversed): each path's median seconds, its last loss,
    and on CUDA the peak memory its pass adds (GiB; {} elsewhere). `zero_grads()` runs before
    every pass."""
    import torch
    cuda, peaks, losses = _is_cuda(device), {}, {}

    def side(name):
        def step(_):
            zero_grads()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            loss = paths[name]()
            loss.backward()
            if cuda:
                torch.cuda.synchronize()
                peaks[name] = (torch.cuda.max_memory_allocated() - before) / 2**30
            losses[name] = loss.item()
        return step

    timed = alternating({name: side(name) for name in paths}, rounds, warmup=warmup, swap=True)
    median = {name: statistics.median(r[name].wall for r in timed) for name in paths}
    return median, peaks, losses


# --------------------------------------------------------------------------------------------
# A world of one rank, for the Trainer at (p, t, d) = (1, 1, 1) in this process
# --------------------------------------------------------------------------------------------

WORLD_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@contextlib.contextmanager
def world_of_one(device="cpu", backend: str | None = None):
    """A 1-rank process group on a free port (the Trainer's default 29500 may be taken): NCCL on
    CUDA, gloo on CPU, or `backend` (e.g. "cpu:gloo,cuda:nccl"). A world already up (the
    caller's) is used and left up. The environment variables it sets are restored afterwards."""
    import torch
    import torch.distributed as dist

    from ptdp.runtime.local_ranks import free_port
    if dist.is_initialized():
        yield
        return
    saved = {name: os.environ.get(name) for name in WORLD_VARIABLES}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    device = torch.device(device)
    extra = {}
    if device.type == "cuda":
        extra["device_id"] = torch.device("cuda", device.index or 0)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, rank=0, world_size=1, **extra)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

def environment(tool: str, argv=None, device=None) -> dict:
    """What a result was measured with: torch's version, the device, the command line, the date."""
    import torch
    device = str(device or "cpu")
    if _is_cuda(device) and torch.cuda.is_available():
        device += f" ({torch.cuda.get_device_name(torch.device(device))})"
    args = sys.argv[1:] if argv is None else list(argv)
    return {"torch": torch.__version__, "device": device,
            "command": shlex.join(["python", f"tools/{Path(tool).name}", *map(str, args)]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpu_cores": os.cpu_count()}


def write_json(path, results: dict, *, tool: str, argv=None, device=None) -> Path:
    """`results` and, under "environment", what they were measured with; the folder is made."""
    if "environment" in results:
        raise ValueError("'environment' is the harness's key")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**results, "environment": environment(tool, argv, device)},
                               indent=1, default=str) + "\n")
    return path


def table(head, rows, sep: str = "  ", align: str = ">") -> str:
    """Columns as wide as their widest cell, right-aligned (`align` "<": left), a rule of dashes
    under the heading (crossed by "+" where `sep` is a "|")."""
    widths = [max(len(cell) for cell in column) for column in zip(head, *rows)]
    line = lambda cells: sep.join(format(c, f"{align}{w}") for c, w in zip(cells, widths))  # noqa: E731
    rule = sep.replace(" ", "-").replace("|", "+") if sep.strip() else sep
    return "\n".join([line(head), rule.join("-" * w for w in widths), *map(line, rows)])
