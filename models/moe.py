"""The mixture-of-experts MLP: a router, E routed experts, optional shared experts (docs/moe.md).

A token's MLP output is sum_j gate_j * expert_{i_j}(x) over its k chosen experts i_j, plus the
shared experts' output that every token gets. Routing is dropless (every token reaches its k
experts) unless `moe_capacity_factor` caps each expert's share of a micro-batch
(models/capacity.py); either way no layout changes what a token computes.

Router (`Router`): scores = x W_r^T in fp32, softmax or sigmoid; the k best experts by score
(plus the per-expert selection bias of auxiliary-loss-free balancing, which picks but never
weighs), ties broken towards the lower expert index (a stable sort); the chosen scores,
renormalised to sum 1 if `moe_renormalize`, times `moe_routed_scaling_factor`, are the gates.
Node-limited routing (`moe_router_groups` G > 1, DeepSeek-V2/V3's device- and node-limited
routing): the experts form G groups of E/G consecutive indices (with expert parallelism and
G = the nodes an expert group spans, a group is a node's experts), each group scores the sum of
its best k/G' selection scores, and a token's k experts come from its best G' groups
(`moe_router_group_top_k`) only; megatron-core's `group_limited_topk`.
Its losses: the load-balancing loss, coeff * E * sum_i f_i P_i over the micro-batch's or each
sequence's tokens (`moe_aux_loss_scope`), f_i counting each token's k best scores (not its
biased or group-limited choice), as DeepSeek-V3 and megatron-core define it (models/balance.py),
and the z-loss, coeff * mean_tokens logsumexp(x W_r^T)^2. Where a layout splits a micro-batch's
tokens over ranks (the sequence-parallel tensor group, the context ring), each rank's loss is its
tokens' share; with sequence parallelism the reported value is completed over the tensor group
while the gradient stays each rank's share (the router weight's gradient is then summed over the
group, as sequence-parallel weights' are). So every layout computes the single process's loss.

Experts (`Expert`, `MoEMLP.route`): the model's activation (GeLU, or SwiGLU/GeGLU with fc1's rows alternating
gate and up as the dense MLP's), hidden size `moe_ffn_hidden_size`, no biases (as Mixtral,
Qwen3 and DeepSeek-V3), fc1 column- and fc2 row-split over the tensor group like the dense MLP.
One parameter per expert, named by its global index (`mlp.experts.{i}.fc1.weight`), so a
checkpoint is the same whoever holds which experts. The (token, choice) pairs are sorted by
expert (a stable argsort), the experts run as grouped GEMMs on their contiguous rows (every
local expert runs, with zero rows if it got none, so every weight gets its gradient each
micro-batch), and the rows are put back in token order and summed with their gates. The
permutations, the grouped GEMMs and why they are fast are ptdp/parallel/experts.py's.

Tensor parallelism: the router sees the MLP input as the layer has it (replicated, or this
rank's 1/t of the sequence); its gates and choices enter the tensor region like the experts'
input does (`enter_tensor_region`: f, or the sequence all-gather), so the gates' gradients,
partial per tensor rank, are summed there, and the routed output leaves it like a row-parallel
GEMM's (g, or the reduce-scatter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ptdp.kernels import ACTIVATIONS, GATES
from ptdp.models.balance import balance_loss
from ptdp.models.capacity import kept_choices
from ptdp.parallel.experts import (Groups, all_to_all, by_local_expert, exchange_counts,
                                   grouped_linear, inverse_permutation, permute)
from ptdp.parallel.layers import normal_param, scaled_std
from ptdp.parallel.roles import declare_role
from ptdp.parallel.sequence import (enter_tensor_region, leave_tensor_region,
                                    mark_sequence_parallel)
from ptdp.parallel.weight_grad import PLAIN

AUX_LOSS, Z_LOSS = "moe_aux_loss", "moe_z_loss"


def moe_aux_loss_names(model) -> tuple[str, ...]:
    """The side outputs an MoE model's stages return (ptdp/training/pipeline.py declares them):
    those with a coefficient above 0."""
    if not model.num_experts:
        return ()
    return tuple(name for name, coeff in ((AUX_LOSS, model.moe_aux_loss_coeff),
                                          (Z_LOSS, model.moe_z_loss_coeff)) if coeff > 0)


def counting() -> bool:
    """Whether this forward is a training forward to count loads in: not validation (no
    gradients) and not a recomputation (it runs inside a backward pass)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


class Router(nn.Module):
    """x [.., h] -> (chosen experts [.., k], their gates [.., k] fp32, {aux loss name: value}).

    `expert_bias` (fp32, [E]) is the selection bias of auxiliary-loss-free balancing and
    `loads` (fp64, [E]) the choices counted since the last optimizer step; both are state of
    the trainer (ptdp/training/experts.py), kept off the module's buffers so that casting the
    model to bf16 leaves them alone.
    """

    def __init__(self, ctx, key: str):
        super().__init__()
        cfg, tp = ctx.model, ctx.tp
        self.ctx, self.E, self.k = ctx, cfg.num_experts, cfg.moe_top_k
        self.weight = mark_sequence_parallel(normal_param(
            (self.E, cfg.hidden_size), cfg.init_std, ctx.seed, f"{key}.weight", None, tp), tp)
        self.expert_bias = torch.zeros(self.E)
        self.loads = torch.zeros(self.E, dtype=torch.float64)
        self.aux_names = moe_aux_loss_names(cfg)

    def forward(self, x):
        cfg = self.ctx.model
        # fp32 scores: the router's weight gradient stays in B with zb-h1 (a tiny GEMM)
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if cfg.moe_score_function == "softmax" else logits.sigmoid()
        select = scores
        if cfg.moe_expert_bias_rate > 0:
            self.expert_bias = self.expert_bias.to(x.device)
            select = scores.detach() + self.expert_bias
        if cfg.moe_router_groups > 1:
            select = best_groups_only(select.detach(), cfg.moe_router_groups,
                                      cfg.moe_router_group_top_k, self.k)
        chosen = torch.sort(select.detach(), dim=-1, descending=True, stable=True)[1][..., :self.k]
        gates = scores.gather(-1, chosen)
        if cfg.moe_renormalize:
            gates = gates / gates.sum(-1, keepdim=True).clamp(min=1e-20)
        gates = gates * cfg.moe_routed_scaling_factor
        if cfg.moe_capacity_factor is not None:   # token dropping (models/capacity.py)
            kept = kept_choices(chosen, gates, cfg, self.ctx)
            gates = gates * kept
            chosen = chosen.masked_fill(~kept, self.E)   # expert E: dropped, no expert runs it
        counts = torch.bincount(chosen.reshape(-1), minlength=self.E + 1)[:self.E].to(torch.float64)
        if self.training and counting():
            self.loads = self.loads.to(x.device) + counts
        return chosen, gates, self._losses(logits, scores)

    def _losses(self, logits, scores) -> dict:
        """This rank's share of the micro-batch's aux losses (module docstring)."""
        if not self.aux_names:
            return {}
        cfg, tp, cp = self.ctx.model, self.ctx.tp, self.ctx.cp
        tokens = logits[..., 0].numel() * (tp.size if tp.sequence_parallel else 1) * cp.size
        losses = {}
        if AUX_LOSS in self.aux_names:
            losses[AUX_LOSS] = balance_loss(scores, cfg, self.ctx)
        if Z_LOSS in self.aux_names:
            lse = torch.logsumexp(logits.reshape(-1, self.E), dim=-1)
            losses[Z_LOSS] = cfg.moe_z_loss_coeff * lse.square().sum() / tokens
        if tp.sequence_parallel:
            losses = _completed_over_tensor(losses, tp)
        return losses


def best_groups_only(select: torch.Tensor, groups: int, group_top_k: int,
                     k: int) -> torch.Tensor:
    """`select` [.., E] with every expert outside the token's best `group_top_k` of `groups`
    groups (consecutive experts) at -inf; a group's score is the sum of its best k //
    group_top_k values (ties between groups go to the lower group, as between experts)."""
    per_group = select.unflatten(-1, (groups, -1))
    group_scores = per_group.topk(k // group_top_k, dim=-1).values.sum(-1)
    best = torch.sort(group_scores, dim=-1, descending=True, stable=True)[1][..., :group_top_k]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
    return per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)


def _completed_over_tensor(losses: dict, tp) -> dict:
    """Each value summed over the tensor group, each gradient still this rank's share's."""
    values = torch.stack(list(losses.values())).detach()
    total = values.clone()
    dist.all_reduce(total, group=tp.group)
    return {name: loss + (total[i] - values[i]) for i, (name, loss) in enumerate(losses.items())}


def routers_by_layer(chunk: nn.Module) -> dict[int, Router]:
    """{global layer index: its router} of a chunk's MoE layers (models/chunk.py's `stack`, and
    the multi-token-prediction depths' layers, num_layers onwards, models/mtp.py)."""
    stacks = [chunk.stack] + [depth.stack for depth in getattr(chunk, "mtp", None) or ()]
    return {stack.first + i: layer.mlp.router for stack in stacks
            for i, layer in enumerate(stack.layers) if isinstance(layer.mlp, MoEMLP)}


class _Weight(nn.Module):
    """A weight under its own name (`fc1.weight`), as the dense MLP's linears name theirs."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


class Expert(nn.Module):
    """One routed expert: tokens [n, h] -> this tensor rank's partial output [n, h]."""

    weight_ops = PLAIN   # zb-h1 rebinds it (ptdp/parallel/weight_grad.py)

    def __init__(self, ctx, key: str, hidden: int):
        super().__init__()
        cfg, tp = ctx.model, ctx.tp
        width = 2 * hidden if cfg.gated else hidden
        self.activation = ACTIVATIONS[cfg.activation]
        self.fc1 = _Weight(normal_param((width, cfg.hidden_size), cfg.init_std, ctx.seed,
                                        f"{key}.fc1.weight", 0, tp))
        self.fc2 = _Weight(normal_param((cfg.hidden_size, hidden),
                                        scaled_std(cfg.init_std, cfg.num_layers), ctx.seed,
                                        f"{key}.fc2.weight", 1, tp))

    def forward(self, x):
        """(The block runs its experts together: MoEMLP._experts; this is one on its own.)"""
        hidden = self.activation(self.weight_ops.linear(x, self.fc1.weight), None)
        return self.weight_ops.linear(hidden, self.fc2.weight)


def expert_order(chosen: torch.Tensor, num_experts: int):
    """The (token, choice) pairs of `chosen` [N, k] sorted by expert (a stable argsort: within
    an expert, in token order), its inverse, and how many each expert got [E] (on the device:
    no host sync here); with token dropping [E + 1], the last the dropped choices' (expert E)."""
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, inverse_permutation(order), torch.bincount(flat, minlength=num_experts)


def combine(out: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor,
            gates: torch.Tensor) -> torch.Tensor:
    """Expert outputs in `order`'s rows [N k, h] -> sum_j gate_j * output_j per token [N, h]."""
    n, k = gates.shape
    out = permute(out, inverse, order)    # back in (token, choice) order
    return (out.view(n, k, -1) * gates.to(out.dtype).unsqueeze(-1)).sum(1)


class SharedExperts(nn.Module):
    """The shared experts as one MLP every token passes through, optionally gated by
    sigmoid(x w_g) per token (Qwen2-MoE)."""

    def __init__(self, ctx, layer: int, mlp_type):
        super().__init__()
        cfg, tp = ctx.model, ctx.tp
        key = f"layers.{layer}.mlp.shared"
        self.mlp = mlp_type(ctx, layer, hidden=cfg.moe_shared_ffn_hidden_size, key=key)
        self.gate = None
        if cfg.moe_shared_expert_gate:
            self.gate = mark_sequence_parallel(normal_param(
                (1, cfg.hidden_size), cfg.init_std, ctx.seed, f"{key}.gate.weight", None, tp), tp)

    def forward(self, x):
        out, bias = self.mlp(x)
        if bias is not None:
            out = out + bias
        if self.gate is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate))
        return out


class MoEMLP(nn.Module):
    """The MoE block in a layer's MLP place: x [s, b, h] (or [s/t, b, h] with sequence
    parallelism) -> (output, None: no bias left to add). Its aux losses of the latest forward
    are `aux_losses` (models/transformer.py's stack collects them)."""

    def __init__(self, ctx, layer: int, mlp_type):
        super().__init__()
        cfg = ctx.model
        key = f"layers.{layer}.mlp"
        self.tp = ctx.tp
        self.E, self.k, self.ep, self.gated = cfg.num_experts, cfg.moe_top_k, ctx.ep, cfg.gated
        self.activation = cfg.activation
        self.widths = (cfg.hidden_size, cfg.moe_ffn_hidden_size // ctx.tp.size)   # GEMMs' inner
        self.router = Router(ctx, f"{key}.router")
        self.experts = nn.ModuleDict({str(i): Expert(ctx, f"{key}.experts.{i}",
                                                     cfg.moe_ffn_hidden_size)
                                      for i in ctx.ep.held(cfg.num_experts)})
        if ctx.ep.size > 1:   # the ranks holding the same experts: their gradients' group
            for param in self.experts.parameters():
                declare_role(param, reduce_axes=("expert_data",))
        self.shared = (SharedExperts(ctx, layer, mlp_type) if cfg.moe_shared_ffn_hidden_size
                       else None)
        self.aux_losses: dict = {}
        self.drops = cfg.moe_capacity_factor is not None   # token dropping (models/capacity.py)

    @torch.compiler.disable   # data-dependent sizes: the block runs eagerly in a compiled layer
    def forward(self, x):
        s, b, h = x.shape
        chosen, gates, self.aux_losses = self.router(x)
        tokens = enter_tensor_region(x, self.tp)           # [s, b, h] on every tensor rank
        chosen, gates = enter_tensor_region(chosen, self.tp), enter_tensor_region(gates, self.tp)
        routed = self.route(tokens.reshape(-1, h), chosen.reshape(-1, self.k),
                            gates.reshape(-1, self.k))
        out = leave_tensor_region(routed.view(tokens.shape), self.tp)
        if self.shared is not None:
            out = out + self.shared(x)
        return out, None

    def route(self, x, chosen, gates):
        """x [N, h] (inside the tensor region), chosen and gates [N, k] -> [N, h], this tensor
        rank's partial sums: the experts' grouped GEMMs on their contiguous rows, the rows of
        other ranks' experts sent there and back with expert parallelism."""
        # with dropping, counts[E] is the dropped choices' (0 when none is: a count for it anyway)
        order, inverse, counts = expert_order(chosen, self.E + 1 if self.drops else self.E)
        rows = permute(x, order // self.k, inverse, self.k)
        dropped = 0
        if self.drops:   # the dropped choices sort last (expert E): no expert runs them
            dropped = int(counts[self.E])                  # (a host sync, with dropping only)
            rows, counts = rows[:rows.shape[0] - dropped], counts[:self.E]
            if dropped and self.ep.size == 1:   # fc1 keeps its input: a copy of the kept rows,
                rows = rows.clone()             # not a view of every choice's (e > 1 sends them)
        if self.ep.size == 1:
            out = self._experts(rows, Groups.of(counts, rows, self.widths))
        else:
            out = self._expert_parallel(rows, counts.tolist())
        if dropped:   # their gates are 0: any output does, zeros cost nothing to combine
            out = torch.cat([out, out.new_zeros(dropped, out.shape[1])])
        return combine(out, order, inverse, gates)

    def _experts(self, rows, groups: Groups):
        """Rows grouped by this rank's experts -> their outputs: fc1, the activation once over
        all rows, fc2 (ptdp/parallel/experts.py's grouped GEMMs). SwiGLU's gate and up products
        come apart and contiguous (fc1's rows alternate them): the same values as the dense
        MLP's activation on the interleaved columns, without its strided backward (4x faster
        on this CPU)."""
        experts = list(self.experts.values())
        ops = experts[0].weight_ops
        fc1 = [e.fc1.weight for e in experts]
        if self.gated:
            gate, up = grouped_linear(rows, fc1, groups, ops, halves=2)
            hidden = GATES[self.activation](gate) * up
        else:
            hidden = ACTIVATIONS[self.activation](grouped_linear(rows, fc1, groups, ops)[0], None)
        return grouped_linear(hidden, [e.fc2.weight for e in experts], groups, ops)[0]

    def _expert_parallel(self, rows, sizes: list[int]):
        """Rows sorted by global expert -> their outputs, via the ranks holding the experts
        (ptdp/parallel/experts.py)."""
        ep, per_rank = self.ep, self.E // self.ep.size
        received = exchange_counts(torch.tensor(sizes, device=rows.device), ep).tolist()
        send = [sum(sizes[r * per_rank:(r + 1) * per_rank]) for r in range(ep.size)]
        receive = [sum(row) for row in received]
        arrived = all_to_all(rows, ep, send, receive)
        order, local_sizes = by_local_expert(received)
        order = order.to(rows.device)
        inverse = inverse_permutation(order)
        out = self._experts(permute(arrived, order, inverse),
                            Groups.of(local_sizes, arrived, self.widths))
        out = permute(out, inverse, order)   # back in arrival order
        return all_to_all(out, ep, receive, send)
