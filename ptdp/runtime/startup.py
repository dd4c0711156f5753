"""Process-group start-up: one rank per process, as launched by torchrun.

Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the environment (torchrun
sets them); gloo on CPU, NCCL on GPU. Every collective gets the backend timeout (the larger of
`train.timeout_s` and `train.startup_timeout_s`), so a dead peer ends the job with an error
instead of a hang; the hang detector (ptdp/runtime/watchdog.py) speaks before it, at 80 % of
the phase's own budget. On CUDA, `train.tf32` sets TF32 for fp32 matmuls and convolutions,
tensor or context parallelism sets CUDA_DEVICE_MAX_CONNECTIONS=1 unless the launch set it, and
the allocator gets expandable segments unless the user configured it (launch_env.py
`cuda_environment`). A rank uses GPU LOCAL_RANK, or LOCAL_RANK % visible GPUs when srun
shows each task only its own (launch_env.py `gpu_of_rank`).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ptdp.config import Config
from ptdp.config.catalogue import embedding_pipeline_ranks, schedule_spec
from ptdp.parallel.grid import RankGrid
from ptdp.runtime.launch_env import cuda_environment, gpu_of_rank, started_by_srun


class NoDevice(RuntimeError):
    """The device asked for is not there (the message names the option that asked)."""


def pick_device(choice: str, option: str = "train.device") -> torch.device:
    """cpu, cuda (this rank's GPU, LOCAL_RANK) or auto (cuda when visible). `option`: how the
    user spelled the choice, for the error (`train.device`, `ptdp generate --device`)."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise NoDevice(f"{option} cuda, but no CUDA device is visible (use cpu)")
        index = local_gpu()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def local_gpu() -> int:
    """This rank's visible GPU (ptdp/runtime/launch_env.py `gpu_of_rank`): LOCAL_RANK, or
    LOCAL_RANK % visible GPUs when srun shows each task only its own. `ptdp train` checks the
    numbers before starting (ptdp/checks.py); LaunchError names them."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or local_rank + 1)
    return gpu_of_rank(local_rank, torch.cuda.device_count(), ranks_per_node, started_by_srun())


def backend_timeout_s(cfg: Config) -> float:
    """What every collective waits before the backend gives up (torch's NCCL watchdog too):
    the longest budget the hang detector may use, so that it always speaks first."""
    return max(cfg.train.timeout_s, cfg.train.startup_timeout_s)


def set_tf32(enabled: bool) -> None:
    """TF32 tensor cores for fp32 matmuls and convolutions (CUDA only; `train.tf32`)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def init_distributed(cfg: Config) -> tuple[RankGrid, torch.device]:
    """Initialise torch.distributed (if not yet) and build the rank grid for cfg.parallel."""
    global _store
    for name, value in cuda_environment(cfg.parallel.tensor, cfg.parallel.context).items():
        os.environ[name] = value   # before the first CUDA call creates the context
    device = pick_device(cfg.train.device)
    if device.type == "cuda":
        set_tf32(cfg.train.tf32)
    timeout_s = backend_timeout_s(cfg)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        backend = "nccl" if device.type == "cuda" else "gloo"
        store, _store = job_store(timeout_s), None   # (the process group owns it from here)
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store),
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
    par = cfg.parallel
    # The tied embedding's group: the pipeline ranks holding the first and the last stage,
    # as the schedule places them.
    first_and_last = embedding_pipeline_ranks(schedule_spec(cfg.schedule.name), par.pipeline,
                                              par.chunks)
    grid = RankGrid(par.pipeline, par.tensor, par.data, timeout_s=timeout_s,
                    context=par.context, embedding_pipeline_ranks=first_and_last,
                    expert=par.expert)
    return grid, device


_store = None   # this process's rendezvous store (`job_store`)


def job_store(timeout_s: float):
    """The job's rendezvous store, made once per process as torch's env:// rendezvous makes it:
    a client of torchrun's agent store, else (srun, one process) rank 0 hosts it at
    MASTER_ADDR:MASTER_PORT. `ptdp train` makes the ranks' start-up verdicts one through it before
    any process group exists (ptdp/runtime/agreement.py); `init_distributed` then starts
    the process group on it (rank 0 could not host a second store on that port)."""
    global _store
    if _store is None:
        _store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    return _store


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
