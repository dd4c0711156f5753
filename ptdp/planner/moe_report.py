"""What `ptdp check` prints about a job's layout and its mixture of experts (ptdp/checks.py's
summary): the layout tuple, and for MoE models the experts, the total and active parameters and
which experts each expert rank holds."""

from __future__ import annotations

from ptdp.planner.formulas import ModelShape, active_parameters, decoder_parameters
from ptdp.planner.moe import expert_placement, is_moe_layer


def layout_text(par, seq_length: int, moe: bool) -> str:
    """'layout: (p, t, d) = (...)', with c when context parallelism splits the sequences, and
    the whole (p, t, c, d, e) for a mixture of experts."""
    names, sizes = ["p", "t", "d"], [par.pipeline, par.tensor, par.data]
    if par.context > 1 or moe:
        names.insert(2, "c"), sizes.insert(2, par.context)
    if moe:
        names.append("e"), sizes.append(par.expert)
    text = f"layout: ({', '.join(names)}) = ({', '.join(map(str, sizes))})"
    if par.context > 1:
        text += (f", each rank {seq_length // par.context} of {seq_length} tokens per sequence "
                 f"(ring attention)")
    return text


def _ranges(layers: list[int]) -> str:
    """[3, 4, 5, 7] -> '3-5, 7'."""
    spans, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            spans.append(f"{start}" if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(spans)


def moe_lines(cfg, vocab_padded: int) -> list[str]:
    """The experts, parameters and expert placement of a mixture of experts ([] when dense)."""
    m, par = cfg.model, cfg.parallel
    if not m.num_experts:
        return []
    shape = ModelShape.from_config(m)
    moe = [i for i in range(m.num_layers) if is_moe_layer(shape, i)]
    shared = (f", a shared expert of f = {m.moe_shared_ffn_hidden_size}"
              if m.moe_shared_ffn_hidden_size else "")
    groups = (f" from {m.moe_router_group_top_k} of {m.moe_router_groups} expert groups"
              if m.moe_router_groups > 1 else "")
    dropping = (f", dropping past a capacity factor of {m.moe_capacity_factor:g} "
                f"({m.moe_drop_policy})" if m.moe_capacity_factor is not None else "")
    e, d_c = par.expert, par.data * par.context
    lines = [
        f"experts: {m.num_experts} of f = {m.moe_ffn_hidden_size} in layers {_ranges(moe)} "
        f"({len(moe)} of {m.num_layers}), top-{m.moe_top_k} {m.moe_score_function} routing"
        f"{groups}{dropping}{shared}; {decoder_parameters(shape, vocab_padded) / 1e6:,.2f} M parameters in all, "
        f"{active_parameters(shape, vocab_padded) / 1e6:,.2f} M active per token",
        f"expert placement: e = {e} expert ranks (folded out of d*c = {d_c}; the ranks holding "
        f"the same experts reduce their gradients over d*c/e = {d_c // e}), each "
        f"{m.num_experts // e} expert(s) of every MoE layer:"]
    placement = expert_placement(m.num_experts, e)
    shown = placement if e <= 8 else placement[:3] + [None] + placement[-1:]
    for i, span in enumerate(shown):
        if span is None:
            lines.append("  ...")
            continue
        rank = i if i < 3 or e <= 8 else e - 1
        lines.append(f"  expert rank {rank}: experts [{span[0]}, {span[1]})")
    return lines
