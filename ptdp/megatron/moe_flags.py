"""Megatron-LM's mixture-of-experts arguments -> ptdp's MoE keys (model.num_experts, model.moe_*;
docs/moe.md): their rows of the table in ptdp/megatron/arguments.py (MOE_ARGS), and converters.

What Megatron-LM 0.16.1 does, read from its source, and what ptdp does (models/moe.py):
- Routing (`topk_routing_with_score_function`, megatron/core/transformer/moe/moe_utils.py):
  softmax without --moe-router-pre-softmax takes the top k logits and softmaxes them, which is
  ptdp's softmax with the k scores renormalised (model.moe_renormalize, the default); with it,
  softmax over all experts, not renormalised. Sigmoid scores are renormalised when k > 1.
  The expert bias (--moe-router-enable-expert-bias) is used only by sigmoid routing.
- Experts carry biases unless --disable-bias-linear; ptdp's experts have none.
- Layer pattern (--moe-layer-freq): an integer n makes every n-th layer, from layer 0, MoE; a
  list such as "([0]*3+[1]*29)" is per layer, 1 for MoE.
Every converter but --num-experts' is ignored without --num-experts, as Megatron ignores it.
"""

from __future__ import annotations

import ast

from ptdp.megatron.converters import (EXACT, IGNORED, REFUSED, Differs, Unmapped, const,
                                      given_int, ignore, integer, number, refuse)
from ptdp.megatron.moe_args import pattern_layout
from ptdp.megatron.rows import Arg


def _moe(given: dict) -> bool:
    return given_int(given, "--num-experts", 0) > 0


def moe_only(convert):
    """A converter that applies only with experts (Megatron ignores the argument without)."""
    def wrapped(value, given):
        if not _moe(given):
            raise Unmapped(IGNORED, "Megatron uses it only with --num-experts")
        return convert(value, given)
    return wrapped


def num_experts(value, given):
    experts = int(value)
    if experts > 0 and "--disable-bias-linear" not in given:
        raise Unmapped(REFUSED, "Megatron's experts have biases without --disable-bias-linear; "
                                "ptdp's experts have none")
    return experts


def _balancing_type(given: dict) -> str:
    value = given.get("--moe-router-load-balancing-type", "aux_loss")
    return value[0] if isinstance(value, list) and len(value) == 1 else value


@moe_only
def load_balancing_type(value, given):
    kind = _balancing_type(given)
    if kind == "seq_aux_loss":   # DeepSeek-V3's: per sequence (models/balance.py)
        coeff = given.get("--moe-aux-loss-coeff", ["0"])
        coeff = coeff[0] if isinstance(coeff, list) else coeff
        return {"model.moe_aux_loss_scope": "sequence"} if float(coeff) > 0 else {}
    if kind in ("aux_loss", "none"):
        return {}   # aux_loss: ptdp's loss (--moe-aux-loss-coeff); none: no loss
    raise Unmapped(REFUSED, f"{kind!r}: ptdp's balancing is the Switch/GShard loss per "
                            f"micro-batch (aux_loss) or per sequence (seq_aux_loss), the z-loss "
                            f"and the expert bias")


@moe_only
def aux_loss_coeff(value, given):
    words = value if isinstance(value, list) else [value]
    if len(words) != 1:
        raise Unmapped(REFUSED, "one coefficient per load-balancing type: ptdp has one (aux_loss)")
    if _balancing_type(given) == "none":
        raise Unmapped(IGNORED, "Megatron adds no load-balancing loss with "
                                "--moe-router-load-balancing-type none")
    return float(words[0])


@moe_only
def capacity_factor(value, given):
    """Token dropping (models/capacity.py): the same drops as Megatron's where one rank routes a
    micro-batch's every token."""
    factor = float(value)
    split = "--sequence-parallel" in given or given_int(given, "--context-parallel-size", 1) > 1
    return Differs(factor, "Megatron drops among each rank's tokens (sequence or context "
                           "parallelism split them), ptdp among the micro-batch's") if split \
        else factor


def drop_policy(value, given):
    if "--moe-expert-capacity-factor" not in given:
        raise Unmapped(IGNORED, "only with --moe-expert-capacity-factor")
    if value not in ("probs", "position"):
        raise Unmapped(REFUSED, "ptdp's drop policies are probs and position")
    return value


def pad_to_capacity(value, given):
    raise Unmapped(IGNORED, "the padding rows are zeros with gate 0: the same results, and ptdp "
                            "does not pad" if "--moe-expert-capacity-factor" in given
                   else "only with --moe-expert-capacity-factor")


def _topk(given: dict) -> int:
    return given_int(given, "--moe-router-topk", 2)


@moe_only
def score_function(value, given):
    if value not in ("softmax", "sigmoid"):
        raise Unmapped(REFUSED, f"{value!r}: ptdp's router scores are softmax or sigmoid")
    out = {"model.moe_score_function": value}
    if value == "sigmoid":   # Megatron renormalises sigmoid scores only when k > 1
        out["model.moe_renormalize"] = _topk(given) > 1
    return out


@moe_only
def pre_softmax(value, given):
    if given.get("--moe-router-score-function", "softmax") != "softmax":
        raise Unmapped(IGNORED, "Megatron uses it only with softmax scores")
    return {"model.moe_renormalize": False}   # softmax over all experts, the k kept as they are


@moe_only
def expert_bias(value, given):
    if given.get("--moe-router-score-function", "softmax") != "sigmoid":
        raise Unmapped(IGNORED, "Megatron's softmax routing does not use the expert bias")
    return float(given.get("--moe-router-bias-update-rate", 1e-3))


@moe_only
def bias_update_rate(value, given):
    if "--moe-router-enable-expert-bias" not in given:
        raise Unmapped(IGNORED, "Megatron uses it only with --moe-router-enable-expert-bias")
    return {}   # written by --moe-router-enable-expert-bias


def _groups_rank_by_logits(given: dict) -> bool:
    """Megatron's softmax without --moe-router-pre-softmax picks experts (and groups) by their
    logits; ptdp picks groups by scores, which ranks groups (sums of scores) otherwise."""
    return (given.get("--moe-router-score-function", "softmax") == "softmax"
            and "--moe-router-pre-softmax" not in given)


@moe_only
def router_groups(value, given):
    if "--moe-router-group-topk" not in given:
        raise Unmapped(IGNORED, "Megatron limits the groups only with --moe-router-group-topk")
    if _groups_rank_by_logits(given):
        raise Unmapped(REFUSED, "softmax scores without --moe-router-pre-softmax: Megatron ranks "
                                "the groups by their logits, ptdp by their scores")
    return int(value)


@moe_only
def router_group_topk(value, given):
    if "--moe-router-num-groups" not in given:
        raise Unmapped(REFUSED, "needs --moe-router-num-groups (Megatron's groups)")
    return int(value)


@moe_only
def router_dtype(value, given):
    if value == "fp32":
        return {}
    return Differs({}, f"ptdp's router computes in fp32, not {value}")


@moe_only
def layer_freq(value, given):
    """An integer n, or a per-layer list of 0 (dense) and 1 (MoE) as a Python expression."""
    text = str(value).strip()
    if not text.startswith(("[", "(")):
        return {"model.moe_layer_freq": int(text)}
    pattern = _list_expression(text)
    layers = given_int(given, "--num-layers")
    if layers is not None and len(pattern) != layers:
        raise Unmapped(REFUSED, f"the pattern has {len(pattern)} layers, --num-layers {layers}")
    layout = pattern_layout(pattern)
    if layout is None:
        raise Unmapped(REFUSED, "ptdp's MoE layers are every n-th after the first dense ones "
                                "(model.moe_first_dense_layers, model.moe_layer_freq)")
    freq, dense = layout
    return {"model.moe_layer_freq": freq, **({"model.moe_first_dense_layers": dense} if dense
                                             else {})}


def _list_expression(text: str) -> list[int]:
    """Megatron evaluates the pattern with Python; ptdp takes only lists of 0/1 joined by + and
    repeated by *."""
    def value(node):
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if max(abs(x) for x in (left, right) if isinstance(x, int)) > 100_000:
                raise ValueError(text)   # no model has that many layers
            return left * right
        raise ValueError(text)
    try:
        result = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        raise Unmapped(REFUSED, f"{text!r}: not a list of 0 and 1") from None
    if not isinstance(result, list) or any(v not in (0, 1) for v in result):
        raise Unmapped(REFUSED, f"{text!r}: not a list of 0 and 1")
    return result


def expert_tensor_parallel(value, given):
    if int(value) == given_int(given, "--tensor-model-parallel-size", 1):
        return {}
    raise Unmapped(REFUSED, "ptdp splits experts over the tensor group (parallel.tensor), "
                            "as Megatron's default")


_PERF = "a performance option; ptdp's results do not depend on it"
_KERNEL = "a kernel or communication choice for experts; ptdp's experts are its own"
_CAPACITY = "only with --moe-expert-capacity-factor"

MOE_ARGS: tuple[Arg, ...] = (
    Arg("--num-experts", "model.num_experts", EXACT, num_experts,
        note="with --disable-bias-linear: ptdp's experts have no biases"),
    Arg("--moe-router-topk", "model.moe_top_k", EXACT, moe_only(integer)),
    Arg("--moe-ffn-hidden-size", "model.moe_ffn_hidden_size", EXACT, moe_only(integer),
        note="absent, --ffn-hidden-size in both"),
    Arg("--moe-shared-expert-intermediate-size", "model.moe_shared_ffn_hidden_size", EXACT,
        moe_only(integer)),
    Arg("--moe-shared-expert-gate", "model.moe_shared_expert_gate", EXACT,
        moe_only(const(True)), nargs=0),
    Arg("--moe-layer-freq", "model.moe_layer_freq", EXACT, layer_freq,
        note="n, or a list such as ([0]*3+[1]*29): model.moe_first_dense_layers and "
             "model.moe_layer_freq"),
    Arg("--moe-router-load-balancing-type", None, EXACT, load_balancing_type, nargs="+",
        note="aux_loss (the default), seq_aux_loss (model.moe_aux_loss_scope: sequence) or none",
        model=True),
    Arg("--moe-aux-loss-coeff", "model.moe_aux_loss_coeff", EXACT, aux_loss_coeff, nargs="+"),
    Arg("--moe-z-loss-coeff", "model.moe_z_loss_coeff", EXACT, moe_only(number)),
    Arg("--moe-router-score-function", "model.moe_score_function", EXACT, score_function,
        note="sigmoid also sets model.moe_renormalize (k > 1), as Megatron renormalises"),
    Arg("--moe-router-pre-softmax", "model.moe_renormalize", EXACT, pre_softmax, nargs=0,
        note="softmax over all experts, not renormalised (Megatron's default: over the top k)"),
    Arg("--moe-router-topk-scaling-factor", "model.moe_routed_scaling_factor", EXACT,
        moe_only(number)),
    Arg("--moe-router-enable-expert-bias", "model.moe_expert_bias_rate", EXACT, expert_bias,
        nargs=0, note="the rate of --moe-router-bias-update-rate (default 1e-3); sigmoid only, "
                      "as Megatron"),
    Arg("--moe-router-bias-update-rate", "model.moe_expert_bias_rate", EXACT, bias_update_rate,
        note="with --moe-router-enable-expert-bias"),
    Arg("--moe-router-num-groups", "model.moe_router_groups", EXACT, router_groups,
        note="node-limited routing, with --moe-router-group-topk (without it Megatron limits "
             "nothing); sigmoid or pre-softmax scores"),
    Arg("--moe-router-group-topk", "model.moe_router_group_top_k", EXACT, router_group_topk),
    Arg("--moe-router-dtype", None, EXACT, router_dtype,
        note="fp32: ptdp's router always computes in fp32 (absent, Megatron's uses the model's "
             "dtype)"),
    Arg("--moe-grouped-gemm", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--moe-use-legacy-grouped-gemm", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--moe-token-dispatcher-type", None, IGNORED, ignore(_KERNEL)),
    Arg("--moe-permute-fusion", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--moe-router-fusion", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--moe-shared-expert-overlap", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--moe-enable-deepep", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--moe-flex-dispatcher-backend", None, IGNORED, ignore(_KERNEL)),
    Arg("--overlap-moe-expert-parallel-comm", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--moe-layer-recompute", None, IGNORED, ignore(_PERF), nargs=0),
    Arg("--moe-per-layer-logging", None, IGNORED,
        ignore("ptdp logs each layer's expert loads in its metrics file"), nargs=0),
    Arg("--moe-router-padding-for-fp8", None, IGNORED, ignore("ptdp has no FP8"), nargs=0),
    Arg("--moe-expert-capacity-factor", "model.moe_capacity_factor", EXACT, capacity_factor,
        note="approximate with sequence or context parallelism (Megatron drops per rank's "
             "tokens, ptdp per micro-batch)"),
    Arg("--moe-pad-expert-input-to-capacity", None, IGNORED, pad_to_capacity, nargs=0),
    Arg("--moe-token-drop-policy", "model.moe_drop_policy", EXACT, drop_policy),
    Arg("--moe-*", None, REFUSED, refuse("not one of ptdp's MoE options (docs/moe.md)"),
        model=True),
)
