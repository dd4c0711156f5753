"""Megatron-LM's multi-token-prediction arguments -> ptdp's `model.mtp_layers`,
`model.mtp_loss_scale` (models/mtp.py): their rows of the table in ptdp/megatron/arguments.py
(MTP_ARGS), and converters. Torch-free.

Megatron-LM core_v0.16.1 (megatron/training/arguments.py, from TransformerConfig's fields):
--mtp-num-layers (None: off), --mtp-loss-scaling-factor (0.1, ptdp's default too), and
--mtp-standalone (set by megatron-core from --pipeline-model-parallel-layout, read only by
its p2p exchanges). Its validate_args takes MTP with rotary (or no) positions only. Its GPT
builder (gpt_builders.py) gives each depth the last decoder layer's spec, except with experts
when the depths' stage holds no decoder layer: then its MoE layer spec, which differs from
ptdp's depth (the last decoder layer's kind) when that layer is dense. Later Megatron-LM
versions add --mtp-use-repeated-layer (one layer run at every depth), --mtp-detach-heads (the
depths' loss kept from the main model), --mtp-hsm (hidden-state mixing across depths) and
--mtp-hybrid-override-pattern (hybrid models' depths): refused. Where the depths sit is
ptdp/megatron/pipeline_layers.py's (`m` in --pipeline-model-parallel-layout).
"""

from __future__ import annotations

from ptdp.megatron.converters import (EXACT, IGNORED, REFUSED, Unmapped, given_int, ignore,
                                      number, refuse)
from ptdp.megatron.moe_flags import layer_freq
from ptdp.megatron.pipeline_layers import LAYOUT, MTP, layout_stages
from ptdp.megatron.rows import Arg


def _rope(given: dict) -> bool:
    return (given.get("--position-embedding-type") == "rope"
            or "--use-rotary-position-embeddings" in given)


def mtp_layers(value, given):
    depths = int(value)
    if depths and not _rope(given):
        raise Unmapped(REFUSED, "Megatron-LM takes multi-token prediction with rotary positions "
                                "only (--position-embedding-type rope), as ptdp")
    if depths and given.get(LAYOUT) is not None and _moe_depths_after_dense(given):
        raise Unmapped(REFUSED, "the layout's last stage holds the MTP depths without decoder "
                                "layers: Megatron-LM then builds them as MoE layers, but the "
                                "last decoder layer (ptdp's depths' kind) is dense")
    return depths


def _moe_depths_after_dense(given: dict) -> bool:
    """Whether Megatron's depths are MoE layers where the last decoder layer is dense."""
    last = layout_stages(given[LAYOUT])[-1]
    layers = given_int(given, "--num-layers")
    if "m" not in last or "t" in last or not given_int(given, "--num-experts", 0) \
            or layers is None:
        return False
    try:
        found = layer_freq(given.get("--moe-layer-freq", 1), given)
    except Unmapped:   # (its own row refuses it)
        return False
    freq, dense = found["model.moe_layer_freq"], found.get("model.moe_first_dense_layers", 0)
    return (layers - 1) < dense or (layers - 1 - dense) % freq != 0


def with_mtp(convert):
    """A converter that applies only with --mtp-num-layers (Megatron ignores it without)."""
    def wrapped(value, given):
        if not given_int(given, MTP, 0):
            raise Unmapped(IGNORED, f"Megatron uses it only with {MTP}")
        return convert(value, given)
    return wrapped


MTP_ARGS: tuple[Arg, ...] = (
    Arg(MTP, "model.mtp_layers", EXACT, mtp_layers,
        note="D depths, each a transformer layer of the last decoder layer's kind, on the last "
             "pipeline stage; with rotary positions"),
    Arg("--mtp-loss-scaling-factor", "model.mtp_loss_scale", EXACT, with_mtp(number),
        note="λ (0.1 in both): the objective adds λ/D times each depth's loss"),
    Arg("--mtp-standalone", None, IGNORED,
        ignore("megatron-core sets it from --pipeline-model-parallel-layout, whose m entries "
               "place the depths; it changes only its p2p exchanges"), nargs=0),
    Arg("--mtp-use-repeated-layer", None, REFUSED,
        refuse("one MTP layer run at every depth; ptdp's depths each have their own layer"),
        nargs=0, model=True),
    Arg("--mtp-detach-heads", None, REFUSED,
        refuse("the depths' loss would not reach the main model; ptdp's reaches it"), nargs=0),
    Arg("--mtp-hsm", None, REFUSED,
        refuse("hidden-state mixing across depths in training; ptdp's depth k reads depth "
               "k - 1's output"), nargs=0),
    Arg("--mtp-hybrid-override-pattern", None, REFUSED,
        refuse("a hybrid (Mamba) model's depths; ptdp has no state-space layers"), model=True),
    Arg("--mtp-*", None, REFUSED,
        refuse("an MTP option ptdp does not take (it maps --mtp-num-layers and "
               "--mtp-loss-scaling-factor)"), model=True),
)
