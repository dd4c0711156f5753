"""The GPU tier's shared fixture (tests/gpu/: skipped without CUDA, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from tools import harness


@pytest.fixture(scope="module")
def world():
    """A process group of one rank on GPU 0 (gloo for CPU tensors, NCCL for CUDA ones)."""
    torch.cuda.set_device(0)
    with harness.world_of_one("cuda:0", backend="cpu:gloo,cuda:nccl"):
        yield
