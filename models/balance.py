"""The routers' load-balancing loss (Switch/GShard's, in DeepSeek-V3's and Megatron's form).

    moe_aux_loss = coeff * E * sum_i f_i P_i,   f_i = (tokens whose top-k scores hold expert i)
                                                      / (T k),
                                                P_i = (1 / T) sum_t s'_{i,t}

over the T tokens of a micro-batch (`model.moe_aux_loss_scope: micro_batch`, Megatron's
aux_loss) or of each sequence, then averaged over the micro-batch's sequences (`sequence`,
DeepSeek-V3's sequence-wise balance loss, Megatron's seq_aux_loss). As in DeepSeek-V3's paper
and megatron-core (`compute_routing_scores_for_aux_loss`), f_i counts each token's k best
*scores*, not the experts it was sent to: the selection bias of auxiliary-loss-free balancing
and node-limited routing's groups change the choice, not the loss. s' are the scores normalised
per token: softmax's as they are, sigmoid's divided by their sum.

Where a layout splits a sequence's tokens over ranks (the sequence-parallel tensor group, the
context ring), the counts are summed over those ranks first and each rank's loss is its tokens'
share of the P sums, so the ranks' losses add up to the single process's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def balance_loss(scores: torch.Tensor, cfg, ctx) -> torch.Tensor:
    """This rank's share of the loss, from its tokens' scores [s, b, E] (s: this rank's
    positions of the sequences: 1/t of them with sequence parallelism, its chunks with context
    parallelism)."""
    E, k = cfg.num_experts, cfg.moe_top_k
    if cfg.moe_score_function == "sigmoid":
        scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    best = torch.topk(scores.detach(), k, dim=-1).indices
    picked = torch.zeros_like(scores, dtype=torch.float32).scatter_(-1, best, 1.0)
    per_sequence = cfg.moe_aux_loss_scope == "sequence"
    # token sums per group: [b, E] (each sequence) or [1, E] (the micro-batch)
    dims = (0,) if per_sequence else (0, 1)
    counts = sum_over_token_ranks(picked.sum(dims, keepdim=not per_sequence).reshape(-1, E), ctx)
    split = (ctx.tp.size if ctx.tp.sequence_parallel else 1) * ctx.cp.size
    tokens = scores.shape[0] * split * (1 if per_sequence else scores.shape[1])   # T
    probs = scores.sum(dims, keepdim=not per_sequence).reshape(-1, E) / tokens
    f = (counts / (tokens * k)).to(probs.dtype)
    return cfg.moe_aux_loss_coeff * E * (f * probs).sum() / f.shape[0]


def sum_over_token_ranks(counts: torch.Tensor, ctx) -> torch.Tensor:
    """`counts` summed over the ranks holding other tokens of the same sequences: the
    sequence-parallel tensor group and the context ring."""
    counts = counts.clone()
    if ctx.tp.sequence_parallel:
        dist.all_reduce(counts, group=ctx.tp.group)
    if ctx.cp.size > 1:
        dist.all_reduce(counts, group=ctx.cp.group)
    return counts
