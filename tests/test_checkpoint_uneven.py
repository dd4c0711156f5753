"""Checkpoints reshard between uneven and even pipeline stages (parallel.stage_layers).

A checkpoint saved at [1, 3, 3, 1] (p = 4) resumes at even p = 2 and at p = 1, and checkpoints
saved at p = 1 and at even p = 2 resume at [1, 3, 3, 1], each continuing the uninterrupted run's
losses (to float32 round-off, tests/equivalence.py): parameter names are global layer indices
whatever the split (ptdp/config/stages.py, layer_ranges).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import RTOL, TINY

UNEVEN = ["parallel.pipeline=4", "parallel.stage_layers=[1,3,3,1]"]
EVEN_P2 = ["parallel.pipeline=2"]


def _losses(overrides: list[str], directory: Path | None = None, load: Path | None = None):
    from ptdp.config import load_config
    from ptdp.training import Trainer
    extra = ["train.iters=4"]
    extra += [f"checkpoint.dir={directory}", "checkpoint.save_interval=2"] if directory else []
    extra += [f"checkpoint.load={load}"] if load else []
    cfg = load_config(None, TINY + overrides + extra, world_size=dist.get_world_size())
    return [record["loss"] for record in Trainer(cfg).train()]


def _saved_at_two(root: Path, name: str) -> Path:
    return root / name / "iter_0000002"


def single_saves(root: str) -> dict:
    return {"p1": _losses([], Path(root) / "p1")}


def world4_job(root: str) -> dict:
    root = Path(root)
    return {"uneven": _losses(UNEVEN, root / "uneven"),
            "p1 -> uneven": _losses(UNEVEN, load=_saved_at_two(root, "p1")),
            "p2": _losses(EVEN_P2, root / "p2"),
            "p2 -> uneven": _losses(UNEVEN, load=_saved_at_two(root, "p2")),
            "uneven -> p2": _losses(EVEN_P2, load=_saved_at_two(root, "uneven"))}


def single_loads(root: str) -> dict:
    return {"uneven -> p1": _losses([], load=_saved_at_two(Path(root), "uneven"))}


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("uneven_checkpoints"))
    out = run_on_ranks(1, single_saves, root, timeout_s=within(200))[0]
    out.update(run_on_ranks(4, world4_job, root, timeout_s=within(400))[0])
    out.update(run_on_ranks(1, single_loads, root, timeout_s=within(200))[0])
    return out


@pytest.mark.parametrize("run,saved_by", [("uneven -> p2", "uneven"), ("uneven -> p1", "uneven"),
                                          ("p2 -> uneven", "p2"), ("p1 -> uneven", "p1")])
def test_resharded_resume_continues_the_uninterrupted_losses(losses, run, saved_by):
    got, want = losses[run], losses[saved_by][2:]
    assert len(got) == len(want) == 2, (got, want)
    for x, y in zip(got, want):
        assert abs(x - y) <= RTOL * abs(y), f"{run}: {got} vs {want}"


def test_uneven_run_is_the_single_process_run(losses):
    for x, y in zip(losses["uneven"], losses["p1"], strict=True):
        assert abs(x - y) <= RTOL * abs(y), (losses["uneven"], losses["p1"])
