"""Multi-token prediction (DeepSeek-V3's MTP, Megatron's --mtp-num-layers; models/mtp.py) in the
planner: what its D = `mtp_layers` depths add to the parameters, FLOPs and memory. Torch-free,
and free of the other planner modules but moe.py (formulas.py builds on it), so it takes any
object with ModelShape's fields (ptdp/planner/formulas.py); their times are mtp_cost.py's.

Depth k runs on the last pipeline stage after the main head: two norms (enorm, hnorm; h values
each), the projection eh_proj [h, 2h] (no bias; replicated over the tensor ranks and applied to
the rank's tokens, T/t of them with sequence parallelism, all T otherwise), one transformer
layer of the last decoder layer's kind (dense or MoE, its window: `depth_is_moe`), its own
final norm, then the model's embedding (of the tokens k ahead) and output layer and loss again.

* Parameters: per depth a decoder layer of that kind, eh_proj 2h^2 and three norms of n h (n =
  2 for LayerNorm, 1 for RMSNorm); the word table and output layer are the model's own, counted
  once. The last stage holds the depths whole but for their layer's tensor-split part, and with
  p > 1 a copy of the word table (V h / t) to embed the depths' tokens: beside an untied output
  layer a table of its own (a tied table's copy is both), whose gradient is summed with the
  first stage's in the embedding group, as a tied table's.
* FLOPs: model FLOPs, as Megatron's num_floating_point_operations counts them
  (megatron/training/training.py: num_layers + mtp_num_layers layers, the depths' of the last
  layer's kind; the eh projection's 2h^2 multiply-adds and the logits (1 + mtp_num_layers)
  times per token). Here the depth's layer is a decoder layer in Eq. 4.2's passes (4 with full
  recomputation, which recomputes it as it does a decoder layer); eh_proj 2 T 2h h and the
  logits 2 T h V forward, 3 passes each (never recomputed). Norms are not counted, as nowhere
  in ptdp (Megatron adds 3h multiply-adds a token per depth for them).
* Memory on the last stage, per micro-batch in flight there (`depth_micro_batches`): the
  depth's layer as a decoder layer of its kind keeps (memory.py), and beyond it
  (`depth_extra_bytes`) the inputs of enorm, hnorm, eh_proj (2h) and the final norm, 5h a token
  of the rank's tokens; the logits GEMM's input, h a token, whole (all-gathered with sequence
  parallelism); and the logits the loss keeps for backward, V/t a token: in the model's dtype
  on GPUs (the compiled loss keeps the logits), the fp32 softmax on CPU
  (ptdp/parallel/cross_entropy.py). The main head's stay alive while the depths run.
"""

from __future__ import annotations

from ptdp.planner.moe import is_moe_layer, mlp_parameter_split, moe_mlp_parameters


def depth_is_moe(shape) -> bool:
    """A depth's layer is of the last decoder layer's kind (ModelConfig.is_moe_layer)."""
    return bool(shape.experts) and is_moe_layer(shape, shape.layers - 1)


def depth_own_parameters(shape) -> int:
    """One depth's parameters beside its transformer layer, all whole on every tensor rank:
    eh_proj 2h·h and enorm, hnorm and the final norm, n·h each."""
    h = shape.hidden
    return 2 * h * h + 3 * shape.norm_parameters * h


def mtp_forward_flops(shape, tokens: float, vocab: float) -> float:
    """Forward FLOPs of the D depths beyond their transformer layers (2 a multiply-add):
    eh_proj 2·T·2h·h and the logits 2·T·h·V, per depth."""
    h = float(shape.hidden)
    return shape.mtp_layers * (4.0 * tokens * h * h + 2.0 * tokens * h * vocab)


def _moe_rank_change(shape, t: int, e: int) -> float:
    """What an MoE depth's MLP holds on one tensor and expert rank beyond a dense MLP's."""
    if not depth_is_moe(shape):
        return 0.0
    split, replicated = mlp_parameter_split(shape, shape.ffn)
    return moe_mlp_parameters(shape).per_rank(t, e) - (split / t + replicated)


def mtp_stage_parameters(shape, t: int, e: int, layer: float, vocab_padded: int,
                         first: bool) -> float:
    """The depths' parameters on one tensor (and expert) rank of the last stage, `layer` a dense
    decoder layer's there (memory.layer_parameters), plus the word table's copy with p > 1 (not
    `first`) beside an untied output layer."""
    if not shape.mtp_layers:
        return 0.0
    copy = vocab_padded * shape.hidden / t if not first and not shape.tie_embeddings else 0.0
    depth = layer + _moe_rank_change(shape, t, e) + depth_own_parameters(shape)
    return shape.mtp_layers * depth + copy


def mtp_expert_parameters(shape, t: int, e: int) -> float:
    """The depths' routed-expert parameters on one tensor and expert rank of the last stage
    (reduced over the d·c/e ranks holding the same experts)."""
    if not shape.mtp_layers or not depth_is_moe(shape):
        return 0.0
    mlp = moe_mlp_parameters(shape)
    return shape.mtp_layers * (mlp.routed_split / t + mlp.routed_replicated) / e


def depth_micro_batches(spec, p: int, m: int) -> float:
    """Micro-batches whose depths the last stage holds at its peak: the last stage's in-flight
    count of a schedule without chunks (the depths are on the last chunk, which runs each
    micro-batch's backward right after its forward): 1 for 1F1B and interleaving, all m for
    GPipe; ZB-H1's min(p, m), counting those waiting for their W pass as whole (safe side)."""
    return spec.in_flight(p, 1, m, p - 1)


def depth_extra_bytes(shape, b: int, t: int, element: int, sequence_parallel: bool,
                      vocab_padded: int, logit_bytes: float) -> float:
    """Bytes one depth keeps per micro-batch beyond its transformer layer (module docstring):
    5h a token of the rank's tokens, the logits' input h a token whole, and the kept logits
    (`logit_bytes` each) V/t a token."""
    tokens = shape.seq * b
    local = tokens / (t if sequence_parallel else 1)
    h = shape.hidden
    return (5 * local + tokens) * h * element + tokens * vocab_padded / t * logit_bytes
