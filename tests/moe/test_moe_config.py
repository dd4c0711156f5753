"""Bad MoE input: one line each, before launch (ptdp/config/experts.py); the expert layout's
groups (ptdp/parallel/grid.py)."""

from __future__ import annotations

import pytest

from ptdp.config import ConfigError, load_config
from ptdp.parallel.grid import axis_rows, expert_layout

BASE = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=4", "model.seq_length=16",
        "train.micro_batch_size=1", "train.global_batch_size=8"]
MOE = ["model.num_experts=4"]


def _errors(overrides: list[str], world: int = 8) -> list[str]:
    try:
        load_config(None, BASE + overrides, world_size=world)
    except ConfigError as err:
        return err.errors
    return []


@pytest.mark.parametrize("overrides, line", [
    (["parallel.data=2", "parallel.expert=3", "parallel.tensor=4", *MOE],
     "parallel.expert (3) must divide parallel.data * parallel.context = 2 * 1 = 2"),
    (["parallel.expert=8", "model.num_experts=12"],
     "model.num_experts (12) must be divisible by parallel.expert (8)"),
    (["model.moe_top_k=5", *MOE], "model.moe_top_k must be between 1 and model.num_experts (4), got 5"),
    (["model.moe_top_k=0", *MOE], "model.moe_top_k must be between 1 and model.num_experts (4), got 0"),
    (["model.moe_aux_loss_coeff=0.01"],
     "model.moe_aux_loss_coeff set while model.num_experts = 0 (a dense model)"),
    (["parallel.expert=2"], "parallel.expert=2 needs a mixture of experts"),
    (["model.moe_z_loss_coeff=-1", *MOE], "model.moe_z_loss_coeff must be >= 0, got -1.0"),
    (["model.moe_expert_bias_rate=-0.1", *MOE], "model.moe_expert_bias_rate must be >= 0"),
    (["model.moe_score_function=relu", *MOE],
     "model.moe_score_function: 'relu' is not one of softmax, sigmoid"),
    (["model.moe_shared_expert_gate=true", *MOE], "model.moe_shared_expert_gate=true needs shared"),
    (["schedule.name=2bw", "parallel.pipeline=2", "parallel.chunks=1", *MOE],
     "model.num_experts > 0 needs a flushing schedule"),
    (["model.moe_ffn_hidden_size=30", "parallel.tensor=4", *MOE],
     "model.moe_ffn_hidden_size (30) must be divisible by parallel.tensor (4)"),
    (["model.moe_router_groups=3", *MOE],
     "model.num_experts (4) must be divisible by model.moe_router_groups (3)"),
    (["model.moe_router_group_top_k=2", *MOE], "model.moe_router_group_top_k=2 needs "
     "model.moe_router_groups > 1: one group limits nothing"),
    (["model.moe_router_groups=4", "model.moe_router_group_top_k=3", *MOE],
     "model.moe_router_group_top_k must be between 1 and min(model.moe_router_groups, "
     "model.moe_top_k) = 2"),
    (["model.moe_router_groups=4", "model.moe_router_group_top_k=1", *MOE],
     "model.moe_router_group_top_k (1) groups of E/G = 1 experts hold fewer than "
     "model.moe_top_k (2)"),
    (["model.moe_router_groups=2"], "model.moe_router_groups set while model.num_experts = 0"),
])
def test_each_problem_is_one_line(overrides, line):
    errors = _errors(overrides)
    assert any(e.startswith(line) for e in errors), errors


def test_a_good_moe_layout_passes():
    assert _errors(["parallel.data=4", "parallel.expert=4", "parallel.tensor=2", *MOE]) == []


def test_expert_groups_are_consecutive_data_context_ranks_of_one_tensor_coordinate():
    layout = expert_layout(p=1, d=2, t=2, c=2, e=2)     # ranks ((d c) t): 8
    assert axis_rows(layout, ["expert"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_rows(layout, ["expert_data"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
