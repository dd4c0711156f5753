"""Time of the mixture-of-experts parts of a layout (ptdp/planner/moe.py counts them): the
MoE layers' MLP against a dense one, the all-to-alls that carry tokens to their experts and
back, and the expert gradients' reduction.

* An MoE layer's MLP on one rank of e expert ranks: the router (T x h -> E), E/e experts
  each running the e*k*T/E tokens routed to it (balanced routing; with token dropping the
  kept share of them, moe.kept_share) through fc1 and fc2 split by t, the shared expert on all
  T tokens, and the permutation copies; its difference from the
  dense MLP's GEMMs is added to the (measured or analytic) layer time, forward and backward.
* Per MoE layer and micro-batch: dispatch and combine forward, their gradients backward (and
  the forward's two again under full recomputation), each moving k*T*h elements per rank, of
  which (e-1)/e leave it (comm.all_to_all_time). T is the rank's tokens, b*s/c, or b*s/(c*t)
  with sequence parallelism (each tensor rank dispatches its own share). They sit between
  the router and the experts and never overlap compute. Expert groups are placed as in
  comm.expert_link: inside a node when t*e ranks fit in one.
* Expert gradients are all-reduced (or reduce-scattered) over the d*c/e ranks that hold the
  same experts, timed at the data-parallel link of the whole d*c group.
"""

from __future__ import annotations

from ptdp.planner import comm
from ptdp.planner.compute import BYTES, elementwise_time, gemm_time
from ptdp.planner.moe import all_to_all_bytes, all_to_alls_per_layer, kept_share


def _gemm_pair(hw, precision: str, m: float, n: float, k: float,
               count: float = 1.0) -> tuple[float, float]:
    """Forward and backward (data + weight gradient) seconds of `count` [m,k]x[k,n] GEMMs."""
    if m <= 0 or n <= 0:
        return 0.0, 0.0
    return (gemm_time(hw, precision, m, n, k, count),
            gemm_time(hw, precision, m, k, n, count) + gemm_time(hw, precision, k, n, m, count))


def _mlp(hw, precision: str, tokens: float, h: int, g: int, f: int, t: int,
         count: float = 1.0) -> tuple[float, float]:
    up = _gemm_pair(hw, precision, tokens, (1 + g) * f / t, h, count)
    down = _gemm_pair(hw, precision, tokens, h, f / t, count)
    return up[0] + down[0], up[1] + down[1]


def moe_layer_time_change(hw, precision: str, shape, b: int, t: int,
                          e: int) -> tuple[float, float]:
    """(forward, backward) seconds an MoE layer's MLP takes beyond the dense MLP's, for a
    micro-batch of b sequences of shape.seq tokens on one tensor and expert rank."""
    tokens, h, g = b * shape.seq, shape.hidden, shape.gated
    kept = kept_share(shape)
    per_expert = kept * e * shape.top_k * tokens / shape.experts
    experts = _mlp(hw, precision, per_expert, h, g, shape.moe_ffn, t, shape.experts // e)
    shared = _mlp(hw, precision, tokens, h, g, shape.shared_ffn, t) if shape.shared_ffn else (0, 0)
    router = _gemm_pair(hw, precision, tokens, shape.experts, h)
    dense = _mlp(hw, precision, tokens, h, g, shape.ffn, t)
    # permute and un-permute k*T rows of h (read + write), the experts' activation function
    # (every choice is permuted and combined; the activation runs on the kept ones)
    copies = shape.top_k * tokens * (4 * h + kept * (2 + g) * shape.moe_ffn / t)
    fwd_copies = elementwise_time(hw, copies * BYTES[precision], 3)
    bwd_copies = elementwise_time(hw, 2 * copies * BYTES[precision], 6)
    forward = experts[0] + shared[0] + router[0] + fwd_copies - dense[0]
    backward = experts[1] + shared[1] + router[1] + bwd_copies - dense[1]
    return forward, backward


def all_to_all_seconds(hw, precision: str, shape, b: int, t: int, e: int, recompute: str,
                       sequence_parallel: bool, gpus_per_node: int, busy: int) -> float:
    """One MoE layer's all-to-alls per micro-batch on the critical path (module docstring);
    `shape` holds the rank's s/c tokens."""
    if e <= 1:
        return 0.0
    tokens = b * shape.seq / (t if sequence_parallel else 1)
    link = comm.expert_link(hw, t, e, gpus_per_node, busy)
    one = comm.all_to_all_time(e, all_to_all_bytes(shape, tokens, BYTES[precision]), link)
    return all_to_alls_per_layer(recompute) * one


def expert_gradient_comm(hw, work, lay, expert_params: float, busy: int) -> tuple[float, float]:
    """(reduction, all-gather) seconds for the routed experts' fp32 gradients and, with the
    distributed optimizer, their updated weights, over the d*c/e ranks holding the same
    experts (cost_model's Workload `work` and Layout `lay`)."""
    n = lay.replicas // lay.expert
    if n <= 1 or expert_params <= 0:
        return 0.0, 0.0
    link = lambda kind: comm.data_link(hw, lay.tensor, lay.replicas,  # noqa: E731
                                       work.gpus_per_node, busy, kind)
    if not lay.distributed_optimizer:
        return comm.all_reduce_time(n, expert_params * 4, link("all_reduce")), 0.0
    return (comm.reduce_scatter_time(n, expert_params * 4, link("reduce_scatter")),
            comm.all_gather_time(n, expert_params * BYTES[work.precision], link("all_gather")))
