"""Multi-token prediction's weight names between megatron-core's MultiTokenPredictionBlock and
ptdp's prediction depths (models/mtp.py; ptdp/megatron/names.py maps the rest, and
ptdp/megatron/mtp_args.py the arguments).

megatron-core (megatron/core/transformer/multi_token_prediction.py) names depth j (0-based)
`mtp.layers.{j}.`: `enorm`, `hnorm` (norms of the embedding of the token ahead and of the
previous hidden state), `eh_proj` (a ColumnParallelLinear 2h -> h without bias, its input
[enorm(embedding); hnorm(hidden)], embedding first as ptdp's; its rows split over tensor
ranks in legacy files), `transformer_layer` (a decoder layer of the last decoder layer's spec,
its parameters named as a decoder layer's) and `final_layernorm`. In torch_dist they are
numbered per depth, never stacked, the layer's norms under TransformerEngine's fused names as
the decoder's. ptdp's are `mtp.{j}.enorm`, `hnorm`, `eh_proj`, `layer.` (a decoder layer's
names after `layers.{i}.`, global layer index num_layers + j) and `final_ln`.
"""

from __future__ import annotations

import re

MEGATRON_PREFIX = "mtp.layers."
_DEPTH = re.compile(r"^mtp\.layers\.(\d+)\.")
_DECODER_LAYER = re.compile(r"^(?:decoder|encoder)\.layers\.(\d+)\.")


def layer_prefixes(cfg):
    """(global layer index, ptdp prefix, Megatron prefix) of every depth's transformer layer."""
    for j in range(cfg.mtp_layers):
        yield cfg.num_layers + j, f"mtp.{j}.layer.", f"{MEGATRON_PREFIX}{j}.transformer_layer."


def depth_pairs(cfg, norm_kinds):
    """(ptdp, Megatron) names of each depth's norms and projection (not its layer)."""
    for j in range(cfg.mtp_layers):
        ours, theirs = f"mtp.{j}.", f"{MEGATRON_PREFIX}{j}."
        for a, b in (("enorm", "enorm"), ("hnorm", "hnorm"), ("final_ln", "final_layernorm")):
            for kind in norm_kinds:
                yield f"{ours}{a}.{kind}", f"{theirs}{b}.{kind}"
        yield f"{ours}eh_proj.weight", f"{theirs}eh_proj.weight"


def layer_index(cfg, name: str) -> int | None:
    """The global transformer-layer index of a Megatron name: a decoder layer's number, or a
    depth's layer num_layers + j; None for any other name."""
    if match := _DECODER_LAYER.match(name):
        return int(match.group(1))
    if (match := _DEPTH.match(name)) and ".transformer_layer." in name:
        return cfg.num_layers + int(match.group(1))
    return None


def depth_count(names) -> int:
    """How many depths a Megatron state's names hold (0: none)."""
    return 1 + max((int(m.group(1)) for n in names if (m := _DEPTH.match(n))), default=-1)
