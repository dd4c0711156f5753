"""The GPU tier's shared fixture (tests/gpu/: skipped without CUDA, tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def world():
    """A process group of one rank on GPU 0 (gloo for CPU tensors, NCCL for CUDA ones)."""
    from ptdp.runtime.local_ranks import free_port
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                            "LOCAL_RANK")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
