"""Token dropping (`model.moe_capacity_factor`; Megatron's --moe-expert-capacity-factor): each
expert takes at most

    capacity = ceil(N k / E * factor)

of a micro-batch's N tokens' N k choices; the others are dropped (their gate 0: the token keeps
its other experts' outputs, unrenormalised, and its residual). Which choices an expert keeps
(`model.moe_drop_policy`): its `probs` policy keeps the choices with the largest gates, its
`position` policy the earliest tokens; ties go to the earlier token (position-major, as the
[s, b] layout flattens). This is megatron-core's `apply_router_token_dropping` on one rank.

N is the whole micro-batch, whatever the layout: where ranks split a micro-batch's tokens (the
sequence-parallel tensor group, the context ring) they gather every choice, gate and token
position and take the same decision, so every layout drops what one process drops. (Megatron
decides on each rank's own tokens: its drops change with the layout.)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """The choices one expert keeps of `tokens` tokens' k each (megatron-core's get_capacity)."""
    return math.ceil(tokens * k / experts * factor)


def kept_choices(chosen: torch.Tensor, gates: torch.Tensor, cfg, ctx) -> torch.Tensor:
    """chosen, gates [s, b, k] (this rank's tokens) -> which choices their experts keep [s, b, k]
    (bool). Detached: the decision takes no gradient."""
    s, b, k = chosen.shape
    order = _token_order(s, b, ctx, chosen.device)                     # [s, b] global index
    parts = _gathered([chosen.reshape(-1, k), gates.detach().float().reshape(-1, k),
                       order.reshape(-1)], ctx)
    every_chosen, every_gate, every_order = parts
    n = every_order.numel()
    limit = capacity(n, k, cfg.num_experts, cfg.moe_capacity_factor)
    expert = every_chosen.reshape(-1)
    first = every_order.repeat_interleave(k)                           # the pair's token
    key = (every_gate.reshape(-1) if cfg.moe_drop_policy == "probs"
           else torch.zeros_like(first, dtype=torch.float32))
    # pairs sorted by expert, then key (descending), then token: each sort stable
    rank = torch.argsort(first, stable=True)
    rank = rank[torch.argsort(-key[rank], stable=True)]
    rank = rank[torch.argsort(expert[rank], stable=True)]
    sorted_expert = expert[rank]
    starts = torch.searchsorted(sorted_expert, sorted_expert, right=False)
    place = torch.arange(rank.numel(), device=rank.device) - starts     # within its expert
    kept = torch.empty_like(expert, dtype=torch.bool)
    kept[rank] = place < limit
    mine = _my_offset(s * b, ctx) * k
    return kept[mine:mine + s * b * k].view(s, b, k)


def _token_order(s: int, b: int, ctx, device) -> torch.Tensor:
    """[s, b] each local token's index in the whole micro-batch, position-major."""
    tp, cp = ctx.tp, ctx.cp
    split = tp.size if tp.sequence_parallel else 1
    local = s * split                                   # the context rank's tokens
    positions = (cp.positions(local, device) if cp.size > 1
                 else torch.arange(local, device=device))
    positions = positions[tp.rank * s:(tp.rank + 1) * s] if split > 1 else positions
    return positions.unsqueeze(1) * b + torch.arange(b, device=device)


def _gathered(tensors: list[torch.Tensor], ctx) -> list[torch.Tensor]:
    """Each tensor concatenated over the sequence-parallel tensor group, then the context
    group (rank order)."""
    groups = ([(ctx.tp.group, ctx.tp.size)] if ctx.tp.sequence_parallel else []) + \
             ([(ctx.cp.group, ctx.cp.size)] if ctx.cp.size > 1 else [])
    for group, size in groups:
        out = []
        for x in tensors:
            parts = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(parts, x.contiguous(), group=group)
            out.append(torch.cat(parts))
        tensors = out
    return tensors


def _my_offset(n: int, ctx) -> int:
    """Where this rank's `n` tokens sit in `_gathered`'s concatenation."""
    tp, cp = ctx.tp, ctx.cp
    split = tp.size if tp.sequence_parallel else 1
    return (cp.rank * split + (tp.rank if split > 1 else 0)) * n
