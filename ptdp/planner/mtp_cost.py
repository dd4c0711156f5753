"""Time of the multi-token-prediction depths (ptdp/planner/mtp.py counts them) on the last
pipeline stage, per micro-batch: what cost_model.py adds to the last rank, and the partitioner
to the last stage's profile (ptdp/planner/partitioner.py).

A depth runs, forward and backward:
* enorm and hnorm and the concatenation of their outputs (elementwise, on the rank's tokens:
  T/t with sequence parallelism), and eh_proj, a [T or T/t, 2h] x [2h, h] GEMM whole on every
  tensor rank (replicated, so not split by t);
* one transformer layer of the last decoder layer's kind: a decoder layer's time, recomputation
  and tensor-parallel collectives, and an MoE layer's MLP and all-to-alls when it is one
  (expert_cost.py);
* the model's embedding of the tokens ahead and its output layer and loss, each as long as the
  first stage's embedding and the main head (compute.head_times), with their collectives.

Nothing of it overlaps the rest of the stage's work.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config.catalogue import schedule_spec
from ptdp.planner import comm
from ptdp.planner.compute import BYTES, elementwise_time, gemm_time, recompute_seconds
from ptdp.planner.expert_cost import all_to_all_seconds, moe_layer_time_change
from ptdp.planner.mtp import depth_is_moe


@dataclass(frozen=True)
class DepthTimes:
    """The D depths' seconds per micro-batch on the last rank (compute without the
    oversubscription of CPU ranks, which cost_model.py applies)."""

    forward: float
    backward: float
    recompute: float
    tensor_comm: float
    all_to_all: float


def depth_head_times(hw, precision: str, shape, b: int, t: int, ht,
                     sequence_parallel: bool = False, split: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one depth beyond its transformer layer: the two norms and
    the concatenation (read and write 8h a token: 4h in, 4h out), eh_proj, the embedding lookup
    and the final norm, logits and loss (`ht`: compute.head_times'; `split`: their backward as
    zb-h1 runs it)."""
    h, e = shape.hidden, BYTES[precision]
    tokens = b * shape.seq / (t if sequence_parallel else 1)
    proj = gemm_time(hw, precision, tokens, h, 2 * h)
    proj_backward = (gemm_time(hw, precision, tokens, 2 * h, h)
                     + gemm_time(hw, precision, 2 * h, h, tokens))
    norms = elementwise_time(hw, 8 * tokens * h * e, 3)
    head_backward = ht.head_backward_split if split else ht.head_backward
    embed_backward = ht.embed_backward_split if split else ht.embed_backward
    return (norms + proj + ht.embed_forward + ht.head_forward,
            2 * norms + proj_backward + embed_backward + head_backward)


def depth_times(hw, work, lay, shape, attention: str, lt, layer_backward: float, ht,
                embed_comm: float, head_comm: float, busy: int) -> DepthTimes:
    """The depths on the last rank of layout `lay` (cost_model.py's Workload `work` and Layout):
    `shape` the rank's s/c tokens, `lt` a decoder layer's compute.LayerTimes and
    `layer_backward` its backward as the schedule runs it, `ht` the head's times, `embed_comm`
    and `head_comm` the tensor-parallel collectives of the embedding and of the logits and
    loss, `busy` the ranks at work on a node."""
    prec, b, t, d = work.precision, lay.micro_batch, lay.tensor, shape.mtp_layers
    split = schedule_spec(lay.schedule).split_backward
    head_fwd, head_bwd = depth_head_times(hw, prec, shape, b, t, ht, lay.sequence_parallel,
                                          split)
    overhead = (hw.measured or {}).get("layer_overhead_s", 0.0) / 2   # the trainer's, a layer
    forward = lt.forward + head_fwd + overhead
    backward = layer_backward + head_bwd + overhead
    recompute = recompute_seconds(hw, prec, shape, b, t, attention, lt, lay.recompute,
                                  lay.recompute_modules, lay.sequence_parallel)
    act_bytes = b * shape.seq * shape.hidden * BYTES[prec]
    tensor = (comm.layer_tensor_comm(hw, work, lay, act_bytes, embed_comm, busy) + embed_comm
              + head_comm)
    all_to_all = 0.0
    if depth_is_moe(shape):
        moe_fwd, moe_bwd = moe_layer_time_change(hw, prec, shape, b, t, lay.expert)
        forward, backward = forward + moe_fwd, backward + moe_bwd
        recompute += moe_fwd if lay.recompute == "full" else 0.0
        all_to_all = all_to_all_seconds(hw, prec, shape, b, t, lay.expert, lay.recompute,
                                        lay.sequence_parallel, work.gpus_per_node, busy)
    return DepthTimes(d * forward, d * backward, d * recompute, d * tensor, d * all_to_all)
