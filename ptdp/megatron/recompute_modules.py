"""Megatron-LM's `--recompute-modules` as `train.recompute_modules` (ptdp/config/recompute.py):
the converter and Megatron's default of the table row in ptdp/megatron/arguments.py."""

from __future__ import annotations

from ptdp.megatron.converters import IGNORED, REFUSED, Unmapped

# Megatron's module -> ptdp's; the others are refused with the reason
SAME = ("core_attn", "layernorm", "mlp")
REFUSED_MODULES = {
    "moe_act": "ptdp's activation module recomputes the dense MLP's and the shared experts' "
               "activations, not the routed experts'",
    "moe": "ptdp does not recompute the MoE layer (its all-to-alls) alone",
    "shared_experts": "ptdp does not recompute the shared experts alone",
    "mla_up_proj": "ptdp does not recompute latent attention's up-projections alone",
}


def _selective(given: dict) -> bool:
    return (given.get("--recompute-granularity") == "selective"
            or "--recompute-activations" in given)


def recompute_modules(value, given):
    """The list, name by name; Megatron reads it only with selective granularity."""
    if not _selective(given):
        raise Unmapped(IGNORED, "Megatron uses it only with --recompute-granularity selective")
    modules = [value] if isinstance(value, str) else list(value)
    for name in modules:
        if name in REFUSED_MODULES:
            raise Unmapped(REFUSED, f"{name}: {REFUSED_MODULES[name]}")
        if name not in SAME:
            raise Unmapped(REFUSED, f"{name!r} is no module of Megatron's --recompute-modules")
    # what train.recompute_modules refuses (ptdp/config/recompute.py), refused here first
    if "layernorm" in modules and "--sequence-parallel" in given:
        raise Unmapped(REFUSED, "layernorm with --sequence-parallel: ptdp's linears keep their "
                                "all-gathered inputs, so recomputing the norms saves nothing")
    if "mlp" in modules and int(given.get("--num-experts") or 0) > 0:
        raise Unmapped(REFUSED, "mlp with --num-experts: ptdp recomputes the dense MLP only")
    return modules


def selective_default(given: dict):
    """Megatron's selective granularity recomputes core_attn unless told otherwise; ptdp's
    default is the norms and the activation, so the translation writes Megatron's."""
    return ["core_attn"] if _selective(given) else None
