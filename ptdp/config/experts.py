"""Checks of the mixture-of-experts keys (model.num_experts, model.moe_*) and of expert
parallelism (parallel.expert), one line each (docs/moe.md). Torch-free, like the rest of
ptdp/config/; ptdp/config/validation.py calls them."""

from __future__ import annotations

import dataclasses

from ptdp.config.catalogue import SCHEDULES, names_where
from ptdp.config.problems import Problems
from ptdp.config.schema import Config, ModelConfig

SCORE_FUNCTIONS = ("softmax", "sigmoid")
# the tokens the load-balancing loss balances over (models/balance.py): each micro-batch's
# (Megatron's aux_loss), or each sequence's, averaged (DeepSeek-V3's, Megatron's seq_aux_loss)
AUX_LOSS_SCOPES = ("micro_batch", "sequence")
DROP_POLICIES = ("probs", "position")   # token dropping's (models/capacity.py)
COEFFICIENTS = ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_bias_rate")


def _moe_keys_set(m: ModelConfig) -> list[str]:
    """The model.moe_* keys that differ from their defaults. (Not moe_ffn_hidden_size: its
    default follows model.ffn_hidden_size, which presets and overrides may set after it.)"""
    return [f"model.{f.name}" for f in dataclasses.fields(m)
            if f.name.startswith("moe_") and f.name != "moe_ffn_hidden_size"
            and getattr(m, f.name) != f.default]


def check_moe_model(m: ModelConfig, out: Problems) -> None:
    """The MoE keys on their own and against the model's sizes."""
    if not out.require(m.num_experts >= 0, f"model.num_experts must be >= 0 (0 = a dense MLP), "
                                           f"got {m.num_experts}"):
        return
    if m.num_experts == 0:
        unused = _moe_keys_set(m)
        out.require(not unused, f"{', '.join(unused)} set while model.num_experts = 0 (a dense "
                                f"model): set model.num_experts or remove them")
        return
    E, k = m.num_experts, m.moe_top_k
    out.require(1 <= k <= E, f"model.moe_top_k must be between 1 and model.num_experts ({E}), "
                             f"got {k}")
    out.positive(m.moe_ffn_hidden_size, "model.moe_ffn_hidden_size")
    out.positive(m.moe_shared_ffn_hidden_size, "model.moe_shared_ffn_hidden_size", strict=False,
                 hint=" (0: no shared experts)")
    out.require(not m.moe_shared_expert_gate or m.moe_shared_ffn_hidden_size > 0,
                "model.moe_shared_expert_gate=true needs shared experts "
                "(model.moe_shared_ffn_hidden_size > 0)")
    out.require(m.moe_layer_freq >= 1, f"model.moe_layer_freq must be >= 1, got "
                                       f"{m.moe_layer_freq}")
    out.require(0 <= m.moe_first_dense_layers < m.num_layers,
                f"model.moe_first_dense_layers must be in [0, model.num_layers) = [0, "
                f"{m.num_layers}) so that some layer is MoE, got {m.moe_first_dense_layers}")
    out.choice(m.moe_score_function, SCORE_FUNCTIONS, "model.moe_score_function")
    if out.choice(m.moe_aux_loss_scope, AUX_LOSS_SCOPES, "model.moe_aux_loss_scope"):
        out.require(m.moe_aux_loss_scope == "micro_batch" or m.moe_aux_loss_coeff > 0,
                    "model.moe_aux_loss_scope applies only with model.moe_aux_loss_coeff > 0 "
                    "(the load-balancing loss)")
    if m.moe_capacity_factor is not None:
        out.positive(m.moe_capacity_factor, "model.moe_capacity_factor",
                     hint=" (null: dropless routing)")
    out.choice(m.moe_drop_policy, DROP_POLICIES, "model.moe_drop_policy")
    out.require(m.moe_drop_policy == "probs" or m.moe_capacity_factor is not None,
                "model.moe_drop_policy applies only with model.moe_capacity_factor (token "
                "dropping)")
    for key in COEFFICIENTS:
        out.positive(getattr(m, key), f"model.{key}", strict=False, hint=" (0 disables it)")
    out.positive(m.moe_routed_scaling_factor, "model.moe_routed_scaling_factor")
    _check_router_groups(m, out)


def _check_router_groups(m: ModelConfig, out: Problems) -> None:
    """Node-limited routing: G groups of E/G experts, each token's k from its best G'."""
    E, k, G, best = m.num_experts, m.moe_top_k, m.moe_router_groups, m.moe_router_group_top_k
    if not out.require(G >= 1, f"model.moe_router_groups must be >= 1 (1: every expert open to "
                               f"every token), got {G}"):
        return
    if G == 1:
        out.require(best == 1, f"model.moe_router_group_top_k={best} needs "
                               f"model.moe_router_groups > 1: one group limits nothing")
        return
    if not out.require(E % G == 0, f"model.num_experts ({E}) must be divisible by "
                                   f"model.moe_router_groups ({G})"):
        return
    if not out.require(1 <= best <= min(G, k),
                       f"model.moe_router_group_top_k must be between 1 and min("
                       f"model.moe_router_groups, model.moe_top_k) = {min(G, k)} (each chosen "
                       f"group is scored by its best k // group_top_k experts), got {best}"):
        return
    out.require(best * (E // G) >= k, f"model.moe_router_group_top_k ({best}) groups of E/G = "
                                      f"{E // G} experts hold fewer than model.moe_top_k ({k})")


def check_moe_layout(cfg: Config, out: Problems) -> None:
    """The MoE model against (p, t, c, d, e) and the schedule; parallel.expert anywhere."""
    m, par = cfg.model, cfg.parallel
    e, t, dc = par.expert, par.tensor, par.data * par.context
    if m.num_experts == 0:
        out.require(e == 1, f"parallel.expert={e} needs a mixture of experts "
                            f"(model.num_experts > 0); set parallel.expert=1")
        return
    for key in ("moe_ffn_hidden_size", "moe_shared_ffn_hidden_size"):
        out.require(getattr(m, key) % t == 0, f"model.{key} ({getattr(m, key)}) must be "
                                              f"divisible by parallel.tensor ({t})")
    out.require(dc % e == 0, f"parallel.expert ({e}) must divide parallel.data * parallel.context "
                             f"= {par.data} * {par.context} = {dc} (expert ranks are folded out "
                             f"of them)")
    out.require(m.num_experts % e == 0, f"model.num_experts ({m.num_experts}) must be divisible "
                                        f"by parallel.expert ({e}): each expert rank holds E/e")
    spec = SCHEDULES.get(cfg.schedule.name)
    out.require(spec is None or spec.flushing,
                f"model.num_experts > 0 needs a flushing schedule "
                f"({', '.join(names_where(lambda s: s.flushing))}), not schedule.name="
                f"{cfg.schedule.name}: the router's aux losses are side outputs and the expert "
                f"loads and biases are settled at a flush")

