"""The MoE block in one process: routing, the grouped dispatch against a per-token loop, the
router's losses against their formulas, which layers are MoE (models/moe.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ptdp.config import load_config
from ptdp.models.moe import AUX_LOSS, Z_LOSS, MoEMLP
from ptdp.models.transformer import ModelContext, ParallelMLP
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from tests.equivalence import MOE, TINY


def _ctx(*overrides: str) -> ModelContext:
    cfg = load_config(None, TINY + MOE + list(overrides), world_size=1)
    return ModelContext(cfg.model, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")),
                        cfg.padded_vocab_size)


def _loop_reference(block: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """The block's routed output computed token by token."""
    chosen, gates, _ = block.router(x)
    flat, c, g = x.reshape(-1, x.shape[-1]), chosen.reshape(-1, block.k), gates.reshape(-1, block.k)
    rows = []
    for i in range(flat.shape[0]):
        rows.append(sum(g[i, j] * block.experts[str(int(c[i, j]))](flat[i:i + 1])[0]
                        for j in range(block.k)))
    return torch.stack(rows).view(x.shape)


@pytest.mark.parametrize("activation", ["swiglu", "gelu", "geglu", "gelu_tanh"])
def test_grouped_dispatch_equals_a_per_token_loop(activation):
    ctx = _ctx(f"model.activation={activation}", "model.moe_shared_ffn_hidden_size=0",
               "model.moe_shared_expert_gate=false")
    block = MoEMLP(ctx, 1, ParallelMLP)
    x = torch.randn(16, 2, ctx.model.hidden_size, generator=torch.Generator().manual_seed(0))
    out, bias = block(x)
    assert bias is None
    torch.testing.assert_close(out, _loop_reference(block, x), rtol=1e-5, atol=1e-6)


def test_every_expert_weight_gets_a_gradient_even_without_tokens():
    block = MoEMLP(_ctx("model.moe_top_k=1"), 1, ParallelMLP)
    x = torch.randn(1, 1, 32)   # one token, one expert chosen: three get no rows
    block(x)[0].sum().backward()
    grads = [p.grad for name, p in block.named_parameters() if ".experts." in f".{name}"]
    assert len(grads) == 8 and all(g is not None for g in grads)
    assert sum(bool(g.abs().sum()) for g in grads) == 2   # only the chosen expert's two weights


def test_ties_go_to_the_lower_expert_and_renormalised_gates_sum_to_one():
    block = MoEMLP(_ctx(), 1, ParallelMLP)
    with torch.no_grad():
        block.router.weight.zero_()           # every score equal
    chosen, gates, _ = block.router(torch.randn(5, 1, 32))
    assert chosen.reshape(-1, 2).tolist() == [[0, 1]] * 5
    torch.testing.assert_close(gates.sum(-1), torch.ones(5, 1))


def test_scaling_sigmoid_and_selection_bias():
    block = MoEMLP(_ctx("model.moe_score_function=sigmoid", "model.moe_renormalize=false",
                        "model.moe_routed_scaling_factor=2.5", "model.moe_expert_bias_rate=0.001"),
                   1, ParallelMLP)
    x = torch.randn(6, 1, 32)
    scores = torch.sigmoid(x.float() @ block.router.weight.t())
    block.router.expert_bias = torch.tensor([0.0, 0.0, 0.0, 10.0])   # picks, never weighs
    chosen, gates, _ = block.router(x)
    assert (chosen[..., 0] == 3).all()
    torch.testing.assert_close(gates, 2.5 * scores.gather(-1, chosen))


def test_node_limited_routing_takes_the_k_experts_from_the_best_groups():
    """E = 4 in 2 groups, k = 2 from 1 group: the better group by the sum of its best
    k / 1 = 2 scores wins, even over a group holding the single best expert."""
    block = MoEMLP(_ctx("model.moe_router_groups=2", "model.moe_router_group_top_k=1"), 1,
                   ParallelMLP)
    block.router.expert_bias = torch.zeros(4)
    scores = torch.tensor([[0.9, 0.1, 0.8, 0.7], [0.5, 0.45, 0.6, 0.2]])
    with torch.no_grad():   # x = one-hot rows make the logits the rows of the weight
        block.router.weight.copy_(torch.cat([scores.log().t(), torch.zeros(4, 30)], 1))
    x = torch.eye(32)[:2].reshape(2, 1, 32)
    chosen, gates, _ = block.router(x)
    assert chosen.reshape(2, 2).tolist() == [[2, 3], [0, 1]]   # plain top-2: [0, 2], [2, 0]
    torch.testing.assert_close(gates.sum(-1), torch.ones(2, 1))


@pytest.mark.parametrize("score, bias", [("sigmoid", True), ("softmax", False)])
def test_node_limited_routing_is_megatron_cores(score, bias):
    """The experts and gates of megatron-core's `topk_routing_with_score_function` (sigmoid
    with selection biases: DeepSeek-V3; softmax over all experts: its pre-softmax), E = 16 in 4
    groups, k = 4 from 2 groups."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    renormalize = score == "sigmoid"   # Megatron's: sigmoid when k > 1; pre-softmax never
    ctx = _ctx("model.num_experts=16", "model.moe_top_k=4", f"model.moe_score_function={score}",
               f"model.moe_renormalize={str(renormalize).lower()}", "model.moe_router_groups=4",
               "model.moe_router_group_top_k=2")
    router = MoEMLP(ctx, 1, ParallelMLP).router
    router.expert_bias = torch.randn(16, generator=torch.Generator().manual_seed(2)) * 0.1 * bias
    x = torch.randn(64, 1, 32, generator=torch.Generator().manual_seed(1))
    chosen, gates, _ = router(x)
    ours = torch.zeros(64, 16).scatter_(1, chosen.reshape(64, 4), gates.reshape(64, 4))
    logits = x.reshape(64, 32) @ router.weight.t()
    probs, chosen_map = moe_utils.topk_routing_with_score_function(
        logits, 4, use_pre_softmax=score == "softmax", num_groups=4, group_topk=2,
        score_function=score, expert_bias=router.expert_bias if bias else None)
    assert torch.equal(ours > 0, chosen_map)
    torch.testing.assert_close(ours, probs)
    plain = torch.zeros(64, 16, dtype=torch.bool).scatter_(   # the limit changed some choices
        1, (logits.sigmoid() + router.expert_bias if bias else logits).topk(4).indices, True)
    assert not torch.equal(plain, chosen_map)


def test_router_losses_follow_their_formulas():
    block = MoEMLP(_ctx(), 1, ParallelMLP)
    x = torch.randn(8, 2, 32)
    logits = x.reshape(-1, 32) @ block.router.weight.t()
    probs = logits.softmax(-1)
    chosen, _, losses = block.router(x)
    f = torch.bincount(chosen.reshape(-1), minlength=4) / (16 * 2)
    torch.testing.assert_close(losses[AUX_LOSS], 0.01 * 4 * (f * probs.mean(0)).sum())
    torch.testing.assert_close(losses[Z_LOSS], 0.001 * torch.logsumexp(logits, -1).square().mean())


def test_which_layers_are_moe():
    model = dataclasses.replace(_ctx().model, moe_first_dense_layers=3, moe_layer_freq=2)
    assert [layer for layer in range(8) if model.is_moe_layer(layer)] == [3, 5, 7]
    assert not any(dataclasses.replace(model, num_experts=0).is_moe_layer(i) for i in range(8))
