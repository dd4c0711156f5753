"""Mixture-of-experts counts for the planner: which layers are MoE, parameters (total, active and
per expert rank), forward FLOPs of an MoE layer's MLP, and the bytes an MoE layer keeps and
sends. Torch-free, and free of the other planner modules (formulas.py builds on it), so it takes
any object with ModelShape's fields (ptdp/planner/formulas.py); stage placement is
ptdp/config/stages.py's.

An MoE layer replaces the dense MLP (width f = shape.ffn) by
* a router, h -> E scores (a bias-free linear, as Mixtral's, Qwen3's and DeepSeek-V3's; the
  latter's selection bias is not a trained weight and is not counted);
* E routed experts, each an MLP of the model's activation and width f_moe (shape.moe_ffn):
  (1+g)·h·f_moe + f_moe·h weights (g = 1 for SwiGLU's gate), plus (1+g)·f_moe + h biases when
  the model has biases;
* optionally a shared expert of width f_shared (shape.shared_ffn), which every token passes,
  with an optional sigmoid gate h -> 1 (Qwen2-MoE).

Layer i (from 0) is MoE when E > 0, i >= moe_first_dense_layers and
(i - moe_first_dense_layers) % moe_layer_freq == 0 (`is_moe_layer`: the model's own rule,
ptdp/config/schema.py's `moe_layer`): DeepSeek-V3 keeps its first 3 layers dense,
moe_layer_freq = 2 alternates MoE and dense layers from the first MoE one.

A token passes its k routed experts and the shared one: "active" parameters and FLOPs count
those (Megatron reports MFU on them), the parameter total counts all E.

With token dropping (model.moe_capacity_factor c, models/capacity.py) each expert runs at most
c times its balanced share of the k·T choices and the dropped ones are neither sent nor run:
under balanced routing the experts run min(1, c) of the choices (`kept_share`), which scales
their GEMMs, the all-to-all's bytes and the expert inputs, fc1 and activation outputs they
keep. The expert outputs the combine keeps stay whole (a dropped choice's as zeros). The FLOPs
stay the model's (as Megatron's count, which ignores dropping).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ptdp.config.schema import moe_layer
from ptdp.config.stages import StageMap


def is_moe_layer(shape, layer: int) -> bool:
    return moe_layer(layer, shape.experts, shape.dense_first, shape.moe_freq)


def moe_layer_count(shape) -> int:
    """The MoE layers, the multi-token-prediction depths' included (ptdp/planner/mtp.py: of
    the last decoder layer's kind, layers num_layers, num_layers + 1, ...)."""
    last = shape.layers - 1
    return sum(is_moe_layer(shape, min(i, last))
               for i in range(shape.layers + shape.mtp_layers))


def rank_moe_layers(shape, p: int, v: int = 1, stages: StageMap | None = None) -> list[int]:
    """MoE layers each pipeline rank holds: virtual stage j holds layers [j·l/(p·v),
    (j+1)·l/(p·v)) (the even split the trainer makes without parallel.stage_layers), on the
    ranks `stages` places them (default: Megatron's looped placement, every schedule's)."""
    if not shape.experts:
        return [0] * p
    return list(_rank_moe_layers(shape.layers, shape.experts, shape.dense_first, shape.moe_freq,
                                 stages or StageMap(p, v)))


@functools.lru_cache(maxsize=1024)   # a plan search asks for each layout's, thousands of times
def _rank_moe_layers(layers: int, experts: int, dense_first: int, freq: int,
                     stages: StageMap) -> tuple[int, ...]:
    per_stage = layers // stages.num_stages
    return tuple(sum(moe_layer(i, experts, dense_first, freq) for stage in stages.stages_of(rank)
                     for i in range(stage * per_stage, (stage + 1) * per_stage))
                 for rank in range(stages.p))


def mlp_parameter_split(shape, ffn: int, bias: bool | None = None) -> tuple[int, int]:
    """(split by t, replicated) parameters of one MLP of width `ffn`: fc1's weight (and biases)
    and fc2's weight are split; fc2's bias is whole on every tensor rank. `bias`: whether it
    has biases (default: the model's; a routed expert has none, models/moe.py)."""
    h, g = shape.hidden, shape.gated
    bias = shape.bias if bias is None else bias
    split = h * (1 + g) * ffn + ((1 + g) * ffn if bias else 0) + ffn * h
    return split, (h if bias else 0)


@dataclass(frozen=True)
class MoeMlpParameters:
    """One MoE layer's MLP: its routed experts (all E of them) and the rest (router, shared
    expert and its gate), each as (split by t, replicated on tensor ranks)."""

    routed_split: int
    routed_replicated: int
    other_split: int
    other_replicated: int

    def per_rank(self, t: int, e: int) -> float:
        """On one rank of t tensor and e expert ranks: E/e experts, each tensor-split."""
        return (self.routed_split / t + self.routed_replicated) / e + (
            self.other_split / t + self.other_replicated)

    @property
    def total(self) -> int:
        return (self.routed_split + self.routed_replicated + self.other_split
                + self.other_replicated)


def moe_mlp_parameters(shape) -> MoeMlpParameters:
    split, replicated = mlp_parameter_split(shape, shape.moe_ffn, bias=False)
    shared_split, shared_replicated = (mlp_parameter_split(shape, shape.shared_ffn)
                                       if shape.shared_ffn else (0, 0))
    router = shape.experts * shape.hidden
    gate = shape.hidden if shape.shared_ffn and shape.shared_gate else 0
    return MoeMlpParameters(shape.experts * split, shape.experts * replicated, shared_split,
                            shared_replicated + router + gate)


def moe_parameter_change(shape) -> tuple[int, int]:
    """(total, active) parameters an MoE layer has beyond a dense layer of the same shape:
    its MLP (active: k of the E experts) minus the dense MLP's."""
    dense = sum(mlp_parameter_split(shape, shape.ffn))
    mlp = moe_mlp_parameters(shape)
    routed = mlp.routed_split + mlp.routed_replicated
    rest = mlp.other_split + mlp.other_replicated
    return mlp.total - dense, routed * shape.top_k // shape.experts + rest - dense


def rank_expert_parameters(shape, t: int, p: int, v: int, e: int) -> float:
    """Routed-expert parameters on the busiest pipeline rank of one tensor and expert rank:
    those reduced over the d·c/e ranks that hold the same experts rather than over d·c."""
    if not shape.experts:
        return 0.0
    mlp = moe_mlp_parameters(shape)
    per_layer = (mlp.routed_split / t + mlp.routed_replicated) / e
    return max(rank_moe_layers(shape, p, v)) * per_layer


def rank_moe_parameter_change(shape, t: int, p: int, v: int, e: int) -> float:
    """Parameters the busiest pipeline rank holds beyond the same layers all dense."""
    if not shape.experts:
        return 0.0
    split, replicated = mlp_parameter_split(shape, shape.ffn)
    per_layer = moe_mlp_parameters(shape).per_rank(t, e) - (split / t + replicated)
    return max(rank_moe_layers(shape, p, v)) * per_layer


def kept_share(shape) -> float:
    """The share of the routed choices the experts run (module docstring): 1 when dropless."""
    return min(1.0, shape.capacity_factor) if shape.capacity_factor else 1.0


def moe_mlp_forward_flops(shape, tokens: float) -> float:
    """Forward FLOPs of one MoE layer's MLP on `tokens` tokens, active experts only (2 per
    multiply-add, as Eq. 4.2): the router 2·T·h·E, each token's k routed experts and the
    shared one 2·T·h·(2+g)·(k·f_moe + f_shared), the shared gate 2·T·h."""
    h, g = shape.hidden, shape.gated
    gate = 1 if shape.shared_ffn and shape.shared_gate else 0
    widths = (2 + g) * (shape.top_k * shape.moe_ffn + shape.shared_ffn)
    return 2.0 * tokens * h * (widths + shape.experts + gate)


def dense_mlp_forward_flops(shape, tokens: float) -> float:
    return 2.0 * tokens * shape.hidden * (2 + shape.gated) * shape.ffn


def moe_activation_bytes(shape, tokens: float, t: int, element: int) -> float:
    """Bytes an MoE layer's MLP keeps for backward on one tensor rank, per micro-batch of
    `tokens` tokens, beyond a dense MLP's (2+g)·T·f/t elements (memory.py): each of the k·T
    dispatched tokens keeps its expert input (h, whole: experts are split along f), fc1's
    output (1+g)·f_moe/t, fc2's input f_moe/t and the expert output h (the routing weights'
    gradient needs it); the shared expert (2+g)·T·f_shared/t; the router's fp32 scores and
    probabilities 2·T·E. Balanced routing: an expert rank receives as many token copies as
    it sends (k·T; with token dropping the inputs, fc1's and the activation's outputs only
    for the kept share, the outputs whole)."""
    h, g, k = shape.hidden, shape.gated, shape.top_k
    kept = kept_share(shape)
    routed = k * tokens * (h + kept * (h + (2 + g) * shape.moe_ffn / t))
    shared = (2 + g) * tokens * shape.shared_ffn / t
    dense = (2 + g) * tokens * shape.ffn / t
    return (routed + shared - dense) * element + 2 * tokens * shape.experts * 4


def all_to_all_bytes(shape, tokens: float, element: int) -> float:
    """What one rank dispatches per all-to-all: k copies of each of its tokens' h-vectors, those
    kept (kept_share; the combine sends as many back; backward moves their gradients)."""
    return kept_share(shape) * shape.top_k * tokens * shape.hidden * element


def all_to_alls_per_layer(recompute: str) -> int:
    """Dispatch and combine forward, their gradients backward; a full recompute runs the
    forward's two again."""
    return 6 if recompute == "full" else 4


def expert_placement(experts: int, e: int) -> list[tuple[int, int]]:
    """Expert rank i holds experts [i·E/e, (i+1)·E/e)."""
    per = experts // e
    return [(i * per, (i + 1) * per) for i in range(e)]
