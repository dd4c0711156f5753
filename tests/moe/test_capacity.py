"""Token dropping (models/capacity.py): megatron-core's choice of what each expert keeps, and the
same drops in every layout as in one process (losses, gradients, weights, expert loads)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from ptdp.config import ConfigError, load_config
from ptdp.models.transformer import ModelContext
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from tests.deadline import within
from tests.equivalence import MOE, RTOL, TINY, assert_equivalent, run_layouts

S, B, E, K = 8, 3, 4, 2


def _router(*overrides: str):
    from ptdp.models.moe import Router
    cfg = load_config(None, TINY + MOE + [f"model.num_experts={E}", f"model.moe_top_k={K}",
                                          *overrides], world_size=1)
    ctx = ModelContext(cfg.model, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")),
                       cfg.padded_vocab_size)
    return Router(ctx, "layers.1.mlp.router"), cfg.model


def _routed(factor: float, policy: str = "probs"):
    torch.manual_seed(3)
    router, model = _router(f"model.moe_capacity_factor={factor}",
                            f"model.moe_drop_policy={policy}")
    dropless, _ = _router()
    dropless.load_state_dict(router.state_dict())
    x = torch.randn(S, B, model.hidden_size)
    return router(x)[:2], dropless(x)[:2]


def test_each_expert_keeps_megatron_cores_choices_by_gate():
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    (chosen, gates), (all_chosen, all_gates) = _routed(0.5)
    probs = torch.zeros(S * B, E).scatter(1, all_chosen.reshape(-1, K), all_gates.reshape(-1, K))
    kept_probs, kept_map = moe_utils.apply_router_token_dropping(probs, probs > 0, K, 0.5, "probs")
    ours = torch.zeros(S * B, E + 1).scatter(1, chosen.reshape(-1, K), gates.reshape(-1, K))
    assert torch.equal(ours[:, :E] > 0, kept_map) and torch.equal(ours[:, :E], kept_probs)
    assert kept_map.sum() == E * 6 < S * B * K   # ceil(24 * 2 / 4 * 0.5) = 6 each: drops


def test_the_position_policy_keeps_the_first_tokens():
    (chosen, gates), (all_chosen, _) = _routed(0.5, "position")
    flat, every = chosen.reshape(-1, K), all_chosen.reshape(-1, K)   # tokens position-major
    for expert in range(E):
        tokens = (every == expert).any(1).nonzero().squeeze(1)
        kept = (flat == expert).any(1).nonzero().squeeze(1)
        assert torch.equal(kept, tokens[:6]), expert
    assert torch.equal(gates.reshape(-1, K) == 0, flat == E)   # dropped: no expert, gate 0


def test_a_large_factor_drops_nothing():
    (chosen, gates), (all_chosen, all_gates) = _routed(4.0)
    assert torch.equal(chosen, all_chosen) and torch.equal(gates, all_gates)


def test_a_block_whose_micro_batch_drops_nothing_equals_the_dropless_block():
    """A capacity no expert reaches (factor 4) leaves the MoE block's output and gradients the
    dropless block's: its count of dropped choices is 0, not missing (it raised IndexError
    once, in every micro-batch without a drop)."""
    from ptdp.models.moe import MoEMLP
    from ptdp.models.transformer import ParallelMLP
    cfg = load_config(None, TINY + MOE + [f"model.num_experts={E}", f"model.moe_top_k={K}",
                                          "model.moe_capacity_factor=4"], world_size=1)
    outs = []
    for factor in (4.0, None):
        model = dataclasses.replace(cfg.model, moe_capacity_factor=factor)
        ctx = ModelContext(model, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")),
                           cfg.padded_vocab_size)
        torch.manual_seed(3)
        block = MoEMLP(ctx, 1, ParallelMLP)
        x = torch.randn(S, B, model.hidden_size, requires_grad=True)
        out, _ = block(x)
        out.square().sum().backward()
        outs.append((out.detach(), x.grad, [p.grad for p in block.parameters()]))
    (out, dx, grads), (ref, ref_dx, ref_grads) = outs
    assert torch.equal(out, ref) and torch.equal(dx, ref_dx)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


# drops in every MoE layer of the tiny model: 32 tokens x 2 choices, 4 experts, capacity 8
DROPPING = [*MOE, "model.moe_capacity_factor=0.5"]
LAYOUTS = {
    "t2-sp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
    "c2": (2, ["parallel.context=2"]),
    "e2-d2": (2, ["parallel.data=2", "parallel.expert=2"]),
    "p2-position": (2, ["parallel.pipeline=2", "model.moe_drop_policy=position"]),
    "t2-sp-c2": (4, ["parallel.tensor=2", "parallel.sequence_parallel=true",
                     "parallel.context=2"]),
}


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    if world == 1:
        single, position, dropless = run_layouts(
            1, [DROPPING, DROPPING + ["model.moe_drop_policy=position"], MOE],
            timeout_s=within(300))
        return {"single": single, "single-position": position, "dropless": dropless}
    names = [n for n, (w, _) in LAYOUTS.items() if w == world]
    runs = run_layouts(world, [DROPPING + LAYOUTS[n][1] for n in names], timeout_s=within(500),
                       nccl_rules=True)
    return dict(zip(names, runs))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dropping_layout_equals_one_process(layout):
    single = _results(1)
    ref = single["single-position" if layout.endswith("position") else "single"][0]
    dropless = single["dropless"][0]
    assert ref["expert_loads"].sum() < dropless["expert_loads"].sum()   # it drops
    for rank, got in enumerate(_results(LAYOUTS[layout][0])[layout]):
        what = f"dropping {layout} rank {rank}"
        assert_equivalent(got, ref, what)
        assert got["expert_loads"].equal(ref["expert_loads"]), what
        for name, value in ref["aux_losses"].items():
            assert abs(got["aux_losses"][name] - value) <= RTOL * abs(value), (what, name)


@pytest.mark.parametrize("overrides, line", [
    (["model.moe_capacity_factor=0"], "model.moe_capacity_factor must be positive, got 0.0"),
    (["model.moe_drop_policy=random"], "model.moe_drop_policy: 'random' is not one of probs, "
                                       "position"),
    (["model.moe_drop_policy=position"], "model.moe_drop_policy applies only with "
                                         "model.moe_capacity_factor"),
])
def test_each_problem_is_one_line(overrides, line):
    with pytest.raises(ConfigError) as err:
        load_config(None, TINY + MOE + overrides, world_size=1)
    assert sum(line in e for e in err.value.errors) == 1, err.value.errors


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_megatron_checkpoint_args_carry_dropping_both_ways(policy):
    from types import SimpleNamespace
    from ptdp.megatron.load_command import load_flags
    from ptdp.megatron.moe_args import moe_args, moe_config
    from ptdp.megatron.errors import argument
    model = _router("model.moe_capacity_factor=1.25", f"model.moe_drop_policy={policy}")[1]
    args = moe_args(model)
    assert (args["moe_expert_capacity_factor"], args["moe_token_drop_policy"]) == (1.25, policy)
    back = moe_config(SimpleNamespace(num_layers=model.num_layers, add_bias_linear=False, **args),
                      argument)
    assert (back["moe_capacity_factor"], back["moe_drop_policy"]) == (1.25, policy)
    dropless = moe_config(SimpleNamespace(num_layers=model.num_layers, add_bias_linear=False,
                                          **moe_args(_router()[1])), argument)
    assert "moe_capacity_factor" not in dropless


def test_exporting_a_dropping_model_to_hugging_face_says_it_routes_dropless(tmp_path, capsys):
    pytest.importorskip("transformers")
    from ptdp.checkpoint.save import save_full_state
    from ptdp.hf.convert import to_hf
    from ptdp.inference.local_model import initial_state
    cfg = load_config(None, ["model.preset=llama", "model.num_layers=2", "model.hidden_size=32",
                             "model.num_heads=4", "model.seq_length=16", "model.vocab_size=128",
                             "model.num_experts=4", "model.moe_capacity_factor=1.5",
                             "data.source=synthetic"], world_size=1)
    save_full_state(initial_state(cfg.model, 0), cfg, tmp_path / "ptdp")
    assert to_hf(tmp_path / "ptdp", tmp_path / "hf")["class"] == "MixtralForCausalLM"
    assert capsys.readouterr().err.strip().splitlines() == [
        "model.moe_capacity_factor=1.5: MixtralForCausalLM routes dropless, so where an expert's "
        "capacity would have bound, its outputs differ from the trained model's forward"]
