"""Suite-wide setup: the tests run on CPU ranks with gloo, also on machines with GPUs.

Hiding the GPUs here (before anything initialises CUDA) reaches every process the tests start:
spawned ranks, torchrun jobs and tool subprocesses inherit the environment. Without it, a
machine with one visible GPU would put every multi-rank test's rank 1 on a GPU it lacks.

The GPU tier (tests marked `gpu`, tests/gpu/) is the exception: `PTDP_GPU_TESTS=1 pytest -m gpu`
(tools/gpu_check.sh) leaves the GPUs visible. Without CUDA every `gpu` test is skipped, so the
plain suite (CI: `pytest -q`) never needs a GPU and never sees one.

Each test's waits end inside pytest's per-test limit (tests/deadline.py): its budget starts here,
before its fixtures, as pytest-timeout's clock does.

The cyclic garbage collector would walk torch's and the test modules' ~300,000 objects again at
every full collection (a tenth of the suite's time): they are frozen once collected, and what
each module leaves alive when the next one starts.
"""

import gc
import os

import pytest

from tests import deadline

GPU_TIER = os.environ.get("PTDP_GPU_TESTS") == "1"
if not GPU_TIER:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    if not any("gpu" in item.keywords for item in items):
        return
    import torch
    if GPU_TIER and torch.cuda.is_available():
        return
    why = ("needs CUDA: run PTDP_GPU_TESTS=1 pytest -m gpu (tools/gpu_check.sh) on a GPU machine"
           if not GPU_TIER else "PTDP_GPU_TESTS=1 but no CUDA device is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=why))


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


_module = [None]


def pytest_runtest_setup(item):
    if item.module is not _module[0]:
        _module[0] = item.module
        gc.collect()
        gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    deadline.start(deadline.limit_of(item))
