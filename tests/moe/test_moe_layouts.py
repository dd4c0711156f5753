"""Dropless routing is exact: a tiny mixture of experts (tests/equivalence.py's MOE) trains in
every layout as in one process: losses, aux losses, gradients and weights to fp32 round-off,
with the pipeline's and the context ring's exchanges under NCCL's rules
(tests/pipeline/nccl_rules.py). Layouts of one world size share one spawned job."""

from __future__ import annotations

import functools

import pytest

from tests.deadline import within
from tests.equivalence import MOE, RTOL, assert_equivalent, run_layouts

LAYOUTS = {
    "d2": (2, ["parallel.data=2"]),
    "t2": (2, ["parallel.tensor=2"]),
    "t2-sp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
    "c2": (2, ["parallel.context=2"]),
    "p2-v2-interleaved": (2, ["parallel.pipeline=2", "parallel.chunks=2",
                              "schedule.name=interleaved"]),
    "p2-recompute-full": (2, ["parallel.pipeline=2", "train.recompute=full"]),
    "p2-zb-h1": (2, ["parallel.pipeline=2", "schedule.name=zb-h1"]),
    "d2-distopt": (2, ["parallel.data=2", "train.distributed_optimizer=true"]),
    # expert parallelism (parallel.expert), folded out of data x context
    "e2-d2": (2, ["parallel.data=2", "parallel.expert=2"]),
    "e2-c2": (2, ["parallel.context=2", "parallel.expert=2"]),
    "e2-d2-t2-sp": (4, ["parallel.data=2", "parallel.expert=2", "parallel.tensor=2",
                        "parallel.sequence_parallel=true"]),
    "e2-d2-p2-interleaved": (4, ["parallel.data=2", "parallel.expert=2", "parallel.pipeline=2",
                                 "parallel.chunks=2", "schedule.name=interleaved"]),
    "e4-c2-d2": (4, ["parallel.context=2", "parallel.data=2", "parallel.expert=4"]),
    "e2-d2-distopt": (2, ["parallel.data=2", "parallel.expert=2",
                          "train.distributed_optimizer=true"]),
    "e4-d4-p2-distopt": (8, ["parallel.data=4", "parallel.expert=4", "parallel.pipeline=2",
                             "train.distributed_optimizer=true"]),
    "p2-t2-sp-c2-interleaved": (8, ["parallel.pipeline=2", "parallel.chunks=2",
                                    "schedule.name=interleaved", "parallel.tensor=2",
                                    "parallel.sequence_parallel=true", "parallel.context=2"]),
}


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    if world == 1:
        return {"single": run_layouts(1, [MOE], timeout_s=within(300))[0]}
    names = [n for n, (w, _) in LAYOUTS.items() if w == world]
    runs = run_layouts(world, [MOE + LAYOUTS[n][1] for n in names], timeout_s=within(600),
                       nccl_rules=True)
    return dict(zip(names, runs))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_equals_one_process(layout):
    ref = _results(1)["single"][0]
    assert set(ref["aux_losses"]) == {"moe_aux_loss", "moe_z_loss"}
    overrides = LAYOUTS[layout][1]
    e = next((int(o.split("=")[1]) for o in overrides if o.startswith("parallel.expert=")), 1)
    for rank, got in enumerate(_results(LAYOUTS[layout][0])[layout]):
        what = f"moe {layout} rank {rank}"
        held = {name.split(".experts.")[1].split(".")[0]
                for name in got["shards"] if name.startswith("layers.1.mlp.experts.")}
        assert len(held) in (0, 4 // e), (what, held)   # E/e experts (none off layer 1's stage)
        assert_equivalent(got, ref, what)
        assert got["expert_loads"].equal(ref["expert_loads"]), what   # whole numbers: exact
        for name, value in ref["aux_losses"].items():
            assert abs(got["aux_losses"][name] - value) <= RTOL * abs(value), (what, name)
