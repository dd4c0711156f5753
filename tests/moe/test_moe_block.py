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
