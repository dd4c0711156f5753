"""The load-balancing loss (models/balance.py) is megatron-core's, per micro-batch (aux_loss) and
per sequence (seq_aux_loss), with sigmoid scores, selection biases and node-limited groups that
change the choice but not the loss; and every layout computes the single process's."""

from __future__ import annotations

import functools

import pytest
import torch

from ptdp.config import ConfigError, load_config
from ptdp.models.transformer import ModelContext
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from tests.deadline import within
from tests.equivalence import MOE, RTOL, TINY, assert_equivalent, run_layouts

S, B, E, K = 8, 3, 8, 2
# DeepSeek-V3's router at toy size: sigmoid scores, selection biases, 4 groups of 2, best 2
DEEPSEEK = ["model.moe_score_function=sigmoid", "model.moe_expert_bias_rate=0.01",
            "model.moe_router_groups=4", "model.moe_router_group_top_k=2"]


def _router(scope: str, *overrides: str):
    from ptdp.models.moe import Router
    cfg = load_config(None, TINY + MOE + [f"model.num_experts={E}", f"model.moe_top_k={K}",
                                          f"model.moe_aux_loss_scope={scope}", *overrides],
                      world_size=1)
    ctx = ModelContext(cfg.model, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")),
                       cfg.padded_vocab_size)
    return Router(ctx, "layers.1.mlp.router"), cfg.model


def _megatrons(logits: torch.Tensor, scope: str, score_function: str, coeff: float):
    """megatron-core's router losses (router.py `_apply_aux_loss`, `_apply_seq_aux_loss`) on one
    rank, from logits [s, b, E]."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    flat = logits.reshape(-1, E)
    routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(flat, K, score_function)
    if scope == "sequence":
        scores, routing_map = scores.reshape(S, -1), routing_map.reshape(S, -1)
    loss = moe_utils.switch_load_balancing_loss_func(scores, routing_map.sum(0),
                                                     routing_map.shape[0], K, E, coeff)
    return loss / (B if scope == "sequence" else 1)


@pytest.mark.parametrize("scope", ["micro_batch", "sequence"])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_the_loss_is_megatron_cores_whatever_biases_and_groups_choose(scope, score_function):
    router, model = _router(scope, *DEEPSEEK, f"model.moe_score_function={score_function}")
    torch.manual_seed(1)
    router.expert_bias = torch.randn(E)   # the choices move away from the k best scores
    x = torch.randn(S, B, model.hidden_size)
    chosen, _, losses = router(x)
    logits = torch.nn.functional.linear(x, router.weight)
    best = logits.topk(K, dim=-1).indices
    assert not torch.equal(chosen.sort(-1).values, best.sort(-1).values)   # it matters here
    expected = _megatrons(logits.detach(), scope, score_function, model.moe_aux_loss_coeff)
    assert torch.allclose(losses["moe_aux_loss"], expected, rtol=1e-5), (losses, expected)


def test_the_scopes_differ():
    x = torch.randn(S, B, 32, generator=torch.Generator().manual_seed(2))
    values = [_router(scope)[0](x)[2]["moe_aux_loss"] for scope in ("micro_batch", "sequence")]
    assert not torch.allclose(*values)


# DeepSeek-V3's balancing in the layouts that split a sequence's tokens, against one process
BALANCED = [*MOE, *DEEPSEEK, "model.moe_aux_loss_scope=sequence"]
LAYOUTS = {
    "t2-sp": ["parallel.tensor=2", "parallel.sequence_parallel=true"],
    "c2": ["parallel.context=2"],
    "p2": ["parallel.pipeline=2"],
}


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    if world == 1:
        return {"single": run_layouts(1, [BALANCED], timeout_s=within(300))[0]}
    runs = run_layouts(world, [BALANCED + LAYOUTS[n] for n in LAYOUTS], timeout_s=within(400),
                       nccl_rules=True)
    return dict(zip(LAYOUTS, runs))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sequence_balancing_layout_equals_one_process(layout):
    ref = _results(1)["single"][0]
    assert ref["aux_losses"]["moe_aux_loss"] > 0
    for rank, got in enumerate(_results(2)[layout]):
        what = f"sequence balancing {layout} rank {rank}"
        assert_equivalent(got, ref, what)
        value = ref["aux_losses"]["moe_aux_loss"]
        assert abs(got["aux_losses"]["moe_aux_loss"] - value) <= RTOL * value, what


def test_an_unknown_scope_is_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(None, TINY + MOE + ["model.moe_aux_loss_scope=batch"], world_size=1)
    assert [line for line in err.value.errors if "moe_aux_loss_scope" in line] == [
        "model.moe_aux_loss_scope: 'batch' is not one of micro_batch, sequence (did you mean "
        "'micro_batch'?)"]


@pytest.mark.parametrize("scope, megatrons", [("micro_batch", "aux_loss"),
                                               ("sequence", "seq_aux_loss")])
def test_megatron_checkpoint_args_carry_the_scope_both_ways(scope, megatrons):
    from types import SimpleNamespace
    from ptdp.megatron.moe_args import moe_args, moe_config
    from ptdp.megatron.errors import argument
    model = _router(scope, *DEEPSEEK)[1]
    args = moe_args(model)
    assert args["moe_router_load_balancing_type"] == megatrons
    back = moe_config(SimpleNamespace(num_layers=model.num_layers, add_bias_linear=False, **args),
                      argument)
    assert back["moe_aux_loss_scope"] == scope
    assert back["moe_aux_loss_coeff"] == model.moe_aux_loss_coeff


def test_a_scope_without_the_loss_is_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(None, TINY + MOE + ["model.moe_aux_loss_coeff=0",
                                        "model.moe_aux_loss_scope=sequence"], world_size=1)
    assert [line for line in err.value.errors if "moe_aux_loss_scope" in line] == [
        "model.moe_aux_loss_scope applies only with model.moe_aux_loss_coeff > 0 (the "
        "load-balancing loss)"]
