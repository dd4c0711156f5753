"""DeepSeek-V3's pieces at once, at toy size: latent attention; a mixture of experts with sigmoid
scores, selection biases, node-limited groups and the sequence-wise balance loss; a
multi-token-prediction depth (an MoE layer with latent attention). Each layout combines the
parallelisms that touch them and trains as one process (tests/equivalence.py) under NCCL's rules
(tests/pipeline/nccl_rules.py): the pieces' exchanges must not step on one another."""

from __future__ import annotations

import functools

import pytest

from tests.deadline import within
from tests.equivalence import MOE, RTOL, assert_equivalent, run_layouts
from tests.test_latent_attention import MLA

EXPERTS = [o for o in MOE if o.startswith(("model.num_experts", "model.moe_"))]
DEEPSEEK = [*MLA, *EXPERTS, "model.moe_score_function=sigmoid", "model.moe_router_groups=2",
            "model.moe_router_group_top_k=1", "model.moe_aux_loss_scope=sequence",
            "model.mtp_layers=1", "model.num_layers=4"]
LAYOUTS = {
    # pipeline, tensor with sequence parallelism, experts folded out of data
    "p2-t2-sp-e2-d2": (8, ["parallel.pipeline=2", "parallel.tensor=2",
                           "parallel.sequence_parallel=true", "parallel.data=2",
                           "parallel.expert=2"]),
    # the context ring (values padded to the query/key heads) with tensor-parallel heads
    "c2-t2-sp-zb-h1": (4, ["parallel.context=2", "parallel.tensor=2",
                           "parallel.sequence_parallel=true", "schedule.name=zb-h1"]),
}


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    if world == 1:
        return {"single": run_layouts(1, [DEEPSEEK], timeout_s=within(300))[0]}
    names = [n for n, (w, _) in LAYOUTS.items() if w == world]
    runs = run_layouts(world, [DEEPSEEK + LAYOUTS[n][1] for n in names], timeout_s=within(600),
                       nccl_rules=True)
    return dict(zip(names, runs))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_deepseek_v3_pieces_train_as_one_process(layout):
    ref = _results(1)["single"][0]
    assert {"mtp_1", "moe_aux_loss", "moe_z_loss"} <= set(ref["aux_losses"])
    assert "mtp.0.layer.attention.kv_up.weight" in ref["grads"]
    assert "mtp.0.layer.mlp.router.weight" in ref["grads"]
    for rank, got in enumerate(_results(LAYOUTS[layout][0])[layout]):
        what = f"deepseek {layout} rank {rank}"
        assert_equivalent(got, ref, what)
        assert got["expert_loads"].equal(ref["expert_loads"]), what
        for name, value in ref["aux_losses"].items():
            assert abs(got["aux_losses"][name] - value) <= RTOL * abs(value), (what, name)
