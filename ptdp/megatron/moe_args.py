"""A mixture of experts in Megatron-LM's arguments <-> ptdp's `model.num_experts`, `moe_*`
keys (docs/moe.md), both ways, refusing in one line what ptdp's router or experts compute
otherwise.

Megatron-core's router (megatron/core/transformer/moe/moe_utils.py
`topk_routing_with_score_function`): softmax scores take the top k of the logits and then a
softmax over those k (renormalised), or with --moe-router-pre-softmax the softmax over all E
and then the top k (not renormalised); sigmoid scores are renormalised when k > 1; the gates
are then times --moe-router-topk-scaling-factor. The expert bias (--moe-router-enable-expert-
bias) enters the choice only and moves by --moe-router-bias-update-rate. --moe-layer-freq N
makes layer i MoE when i % N == 0; a list gives each layer's 0/1.
"""

from __future__ import annotations

from ptdp.megatron.errors import require

# Megatron-LM 0.16.1's defaults (megatron/core/transformer/transformer_config.py): what a
# dense checkpoint carries, and the base of a MoE one.
DENSE = dict(num_experts=None, moe_ffn_hidden_size=None, moe_router_topk=2, moe_layer_freq=1,
             moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
             moe_router_score_function="softmax", moe_router_pre_softmax=False,
             moe_router_enable_expert_bias=False, moe_router_bias_update_rate=1e-3,
             moe_router_topk_scaling_factor=None, moe_router_load_balancing_type="aux_loss",
             moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None, moe_grouped_gemm=False,
             moe_token_dispatcher_type="allgather", moe_router_num_groups=None,
             moe_router_group_topk=None, moe_expert_capacity_factor=None)


def moe_args(cfg) -> dict:
    """Megatron-LM's MoE arguments of ptdp's model (DENSE for a dense one)."""
    if not cfg.num_experts:
        return dict(DENSE)
    pattern = (cfg.moe_layer_freq if not cfg.moe_first_dense_layers else
               [int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)])
    factor = cfg.moe_routed_scaling_factor
    return dict(
        DENSE, num_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_router_topk=cfg.moe_top_k, moe_layer_freq=pattern,
        moe_shared_expert_intermediate_size=cfg.moe_shared_ffn_hidden_size or None,
        moe_shared_expert_gate=cfg.moe_shared_expert_gate,
        moe_router_score_function=cfg.moe_score_function,
        moe_router_pre_softmax=cfg.moe_score_function == "softmax" and not cfg.moe_renormalize,
        moe_router_enable_expert_bias=cfg.moe_expert_bias_rate > 0,
        moe_router_bias_update_rate=cfg.moe_expert_bias_rate or DENSE[
            "moe_router_bias_update_rate"],
        moe_router_topk_scaling_factor=None if factor == 1.0 else factor,
        moe_router_load_balancing_type=_balancing_type(cfg),
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff, moe_z_loss_coeff=cfg.moe_z_loss_coeff or None,
        moe_expert_capacity_factor=cfg.moe_capacity_factor,
        moe_token_drop_policy=cfg.moe_drop_policy,
        **_router_groups(cfg))


def _balancing_type(cfg) -> str:
    """Megatron's --moe-router-load-balancing-type of ptdp's loss (models/balance.py)."""
    if not cfg.moe_aux_loss_coeff:
        return "none"
    return "seq_aux_loss" if cfg.moe_aux_loss_scope == "sequence" else "aux_loss"


def _router_groups(cfg) -> dict:
    """Megatron's group-limited routing arguments of ptdp's node-limited routing."""
    if cfg.moe_router_groups == 1:
        return {}
    return dict(moe_router_num_groups=cfg.moe_router_groups,
                moe_router_group_topk=cfg.moe_router_group_top_k)


def refuse_moe_for_megatron(cfg) -> None:
    """What of ptdp's MoE Megatron's router or experts would compute otherwise."""
    if not cfg.num_experts:
        return
    require(not cfg.bias, "model.bias=true with experts: Megatron's experts then carry biases "
                          "(--add-bias-linear), ptdp's have none")
    require(cfg.moe_expert_bias_rate == 0 or cfg.moe_score_function == "sigmoid",
            "model.moe_expert_bias_rate > 0 with softmax scores: Megatron-LM 0.16 uses the "
            "selection bias with sigmoid scores only, so its routing would differ")
    require(cfg.moe_router_groups == 1 or cfg.moe_score_function == "sigmoid"
            or not cfg.moe_renormalize,
            "model.moe_router_groups > 1 with renormalised softmax scores: Megatron then ranks "
            "the groups by their logits, ptdp by their scores (set model.moe_renormalize=false, "
            "Megatron's --moe-router-pre-softmax, or sigmoid scores)")
    if cfg.moe_score_function == "sigmoid":
        require(cfg.moe_renormalize == (cfg.moe_top_k > 1),
                f"model.moe_renormalize={str(cfg.moe_renormalize).lower()} with sigmoid scores "
                f"and k={cfg.moe_top_k}: Megatron renormalises sigmoid gates exactly when k > 1")


def _one(value, name: str):
    """Megatron's nargs='+' MoE arguments hold a list of one value per layer group."""
    if isinstance(value, (list, tuple)):
        require(len(set(value)) == 1, f"--{name.replace('_', '-')}={list(value)}: ptdp has one "
                                      f"value for every MoE layer")
        return value[0]
    return value


def pattern_layout(pattern: list[int]) -> tuple[int, int] | None:
    """(model.moe_layer_freq, model.moe_first_dense_layers) of a per-layer 0/1 MoE pattern
    (Megatron's --moe-layer-freq list): layer i is MoE iff i >= first and (i - first) % freq
    == 0. None when no such pair gives the pattern, or it has no MoE layer."""
    if 1 not in pattern:
        return None
    first, n = pattern.index(1), len(pattern)
    return next(((every, first) for every in range(1, n - first + 1)
                 if pattern == [int(i >= first and (i - first) % every == 0) for i in range(n)]),
                None)


def _layer_pattern(freq, num_layers: int) -> tuple[int, int]:
    """(model.moe_layer_freq, model.moe_first_dense_layers) of --moe-layer-freq."""
    if isinstance(freq, int):
        return freq, 0
    pattern = [int(x) for x in freq]
    require(len(pattern) == num_layers, f"--moe-layer-freq has {len(pattern)} entries for "
                                        f"{num_layers} layers")
    layout = pattern_layout(pattern)
    require(layout is not None, f"--moe-layer-freq={pattern}: ptdp's MoE layers are every "
                                f"n-th after the first dense ones, at least one")
    return layout


def moe_config(args, get) -> dict:
    """ModelConfig keys of a checkpoint's MoE arguments ({} for a dense model); `get(args,
    name, default)` reads an argument."""
    experts = get(args, "num_experts", None)
    if not experts:
        return {}
    require(get(args, "moe_latent_size", None) is None,
            f"--moe-latent-size={get(args, 'moe_latent_size', None)}: a latent expert "
            f"projection, which ptdp lacks")
    policy = get(args, "moe_token_drop_policy", "probs")
    require(policy in ("probs", "position"), f"--moe-token-drop-policy={policy}: ptdp's drop "
                                             f"policies are probs and position")
    require(not get(args, "add_bias_linear", True), "--add-bias-linear with experts: Megatron's "
                                                    "experts carry biases, ptdp's have none")
    balance = _one(get(args, "moe_router_load_balancing_type", "aux_loss"),
                   "moe_router_load_balancing_type")
    require(balance in ("aux_loss", "seq_aux_loss", "none"),
            f"--moe-router-load-balancing-type={balance}: ptdp has the Switch/GShard loss per "
            f"micro-batch (aux_loss) or per sequence (seq_aux_loss)")
    coeff = float(_one(get(args, "moe_aux_loss_coeff", 0.0), "moe_aux_loss_coeff"))
    scope = "sequence" if balance == "seq_aux_loss" and coeff > 0 else "micro_batch"
    score = get(args, "moe_router_score_function", "softmax")
    require(score in ("softmax", "sigmoid"), f"--moe-router-score-function={score}")
    top_k = get(args, "moe_router_topk", 2)
    freq, first = _layer_pattern(get(args, "moe_layer_freq", 1), args.num_layers)
    renormalize = (top_k > 1 if score == "sigmoid" else
                   not get(args, "moe_router_pre_softmax", False))
    # Megatron-LM 0.16 adds the selection bias under sigmoid scores only
    enabled = get(args, "moe_router_enable_expert_bias", False) and score == "sigmoid"
    groups = _groups_of(args, get, score, renormalize)
    return dict(
        num_experts=experts, moe_top_k=top_k,
        moe_ffn_hidden_size=get(args, "moe_ffn_hidden_size", get(args, "ffn_hidden_size", None)),
        moe_shared_ffn_hidden_size=get(args, "moe_shared_expert_intermediate_size", 0),
        moe_shared_expert_gate=bool(get(args, "moe_shared_expert_gate", False)),
        moe_layer_freq=freq, moe_first_dense_layers=first, moe_score_function=score,
        moe_renormalize=renormalize,
        moe_routed_scaling_factor=float(get(args, "moe_router_topk_scaling_factor", 1.0)),
        moe_aux_loss_coeff=coeff if balance != "none" else 0.0, moe_aux_loss_scope=scope,
        moe_z_loss_coeff=float(get(args, "moe_z_loss_coeff", 0.0)),
        moe_expert_bias_rate=float(get(args, "moe_router_bias_update_rate", 1e-3))
        if enabled else 0.0, **groups, **_dropping(args, get, policy))


def _dropping(args, get, policy: str) -> dict:
    """Token dropping's keys (models/capacity.py), {} when dropless."""
    factor = get(args, "moe_expert_capacity_factor", None)
    return {} if factor is None else dict(moe_capacity_factor=float(factor),
                                          moe_drop_policy=policy)


def _groups_of(args, get, score: str, renormalize: bool) -> dict:
    """ptdp's node-limited routing keys of Megatron's group-limited routing, which applies
    only with --moe-router-group-topk."""
    group_top_k = get(args, "moe_router_group_topk", None)
    if not group_top_k:
        return {}
    groups = get(args, "moe_router_num_groups", None)
    require(bool(groups), f"--moe-router-group-topk={group_top_k} without "
                          f"--moe-router-num-groups")
    require(score == "sigmoid" or not renormalize,
            "--moe-router-num-groups with softmax scores without --moe-router-pre-softmax: "
            "Megatron ranks the groups by their logits, ptdp by their scores")
    return dict(moe_router_groups=int(groups), moe_router_group_top_k=int(group_top_k))
