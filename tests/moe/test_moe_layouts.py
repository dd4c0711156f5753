"""Dropless routing is exact: a tiny mixture of experts (tests/equivalence.py's MOE) trains in
every layout as in one process: losses, aux losses, gradients and weights to fp32 round-off,
with the pipeline's and the context ring's exchanges under NCCL's rules
(tests/pipeline/nccl_rules.py). Layouts of one world size share one spawned job."""

from __future__ import annotations

import functools

import pytest

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
    "p2-t2-sp-c2-interleaved": (8, ["parallel.pipeline=2", "parallel.chunks=2",
                                    "schedule.name=interleaved", "parallel.tensor=2",
                                    "parallel.sequence_parallel=true", "parallel.context=2"]),
}


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    if world == 1:
        return {"single": run_layouts(1, [MOE], timeout_s=300)[0]}
    names = [n for n, (w, _) in LAYOUTS.items() if w == world]
    runs = run_layouts(world, [MOE + LAYOUTS[n][1] for n in names], timeout_s=600,
                       nccl_rules=True)
    return dict(zip(names, runs))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_equals_one_process(layout):
    ref = _results(1)["single"][0]
    assert set(ref["aux_losses"]) == {"moe_aux_loss", "moe_z_loss"}
    for rank, got in enumerate(_results(LAYOUTS[layout][0])[layout]):
        what = f"moe {layout} rank {rank}"
        assert_equivalent(got, ref, what)
        assert got["expert_loads"].equal(ref["expert_loads"]), what   # whole numbers: exact
        for name, value in ref["aux_losses"].items():
            assert abs(got["aux_losses"][name] - value) <= RTOL * abs(value), (what, name)
