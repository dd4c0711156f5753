"""Shared jobs for the features past the source (sequence parallelism, zero-bubble schedule):
exact equivalence in the (p, t, d) layouts the issue names, and exact checkpoint/resume.

Each spawned job runs several Trainers one after another (process start-up dominates on two
cores); tests look at what the jobs returned.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

from tests.deadline import within
from tests.equivalence import ARCHS, MODELS, TINY, run_layouts

SP = ["parallel.sequence_parallel=true"]
ZB = ["schedule.name=zb-h1"]

# name -> (world size, overrides); (p, t, d) = (2, 2, 1), (1, 2, 2), (2, 2, 2).
LAYOUTS = {
    (2, 2, 1): ["parallel.pipeline=2", "parallel.tensor=2"],
    (1, 2, 2): ["parallel.tensor=2", "parallel.data=2"],
    (2, 2, 2): ["parallel.pipeline=2", "parallel.tensor=2", "parallel.data=2"],
}
WORLDS = sorted({p * t * d for p, t, d in LAYOUTS})


def _feature_results(feature: tuple[str, ...], world: int) -> dict:
    """{(layout, arch): per-rank results} for every layout of `world` ranks with `feature`,
    GPT, BERT and Llama-style, all under the in-order (NCCL-rules) transport: one spawned job."""
    names = [n for n in LAYOUTS if n[0] * n[1] * n[2] == world]
    runs = [[*MODELS[arch], *LAYOUTS[n], *feature] for n in names for arch in ARCHS]
    results = iter(run_layouts(world, runs, timeout_s=within(400), nccl_rules=True))
    return {(n, arch): next(results) for n in names for arch in ARCHS}


@functools.lru_cache(maxsize=None)
def _feature_jobs(feature: tuple[str, ...]) -> dict:
    """{world size: future of _feature_results(feature, world size)}: the jobs of every world
    size of LAYOUTS, started together (one job alone leaves cores idle: its ranks wait on
    exchanges and start-up); their threads end with them."""
    pool = ThreadPoolExecutor(len(WORLDS), thread_name_prefix="features")
    futures = {world: pool.submit(_feature_results, feature, world) for world in WORLDS}
    pool.shutdown(wait=False)
    return futures


def feature_results(feature: tuple[str, ...], world: int) -> dict:
    return _feature_jobs(feature)[world].result()


def feature_layout(feature: tuple[str, ...], layout: tuple, arch: str) -> list[dict]:
    return feature_results(feature, layout[0] * layout[1] * layout[2])[(layout, arch)]


def _trainer(overrides: list[str]):
    from ptdp.config import load_config
    from ptdp.training import Trainer
    return Trainer(load_config(None, TINY + overrides, world_size=dist.get_world_size()))


def resume_job(root: str, runs: dict[str, list[str]]) -> dict:
    """For each named layout: 4 iterations straight (saving at 2 and 4), then a new Trainer
    that resumes from iteration 2; plus, for each (name, other) in `runs["reshard"]`, a Trainer
    of layout `other` resuming from `name`'s checkpoint (`other` from the named layouts, or
    from `runs["targets"]`: layouts only loaded into, not trained on their own). Losses and
    final weights."""
    out = {}
    layouts = {**runs, **runs.get("targets", {})}
    for name, overrides in runs.items():
        if name in ("reshard", "targets"):
            continue
        directory = Path(root) / name
        save = [f"checkpoint.dir={directory}", "checkpoint.save_interval=2", "train.iters=4"]
        straight = _trainer(overrides + save)
        out[f"{name} straight"] = [r["loss"] for r in straight.train()]
        out[f"{name} straight weights"] = straight.full_state()
        resumed = _trainer(overrides + save + [f"checkpoint.load={directory}/iter_0000002"])
        out[f"{name} resumed"] = [r["loss"] for r in resumed.train()]
        out[f"{name} resumed weights"] = resumed.full_state()
    for source, target in runs.get("reshard", []):
        trainer = _trainer(layouts[target] + ["train.iters=4",
                                           f"checkpoint.load={root}/{source}/iter_0000002"])
        out[f"{source} -> {target}"] = [r["loss"] for r in trainer.train()]
        out[f"{source} -> {target} weights"] = trainer.full_state()
    return out
