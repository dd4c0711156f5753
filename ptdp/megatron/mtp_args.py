"""Multi-token prediction in a Megatron checkpoint's `args` <-> ptdp's `model.mtp_layers`,
`model.mtp_loss_scale` (models/mtp.py), both ways, refusing in one line what ptdp's depths
would compute otherwise.

megatron-core 0.16.1 (transformer_config.py): `mtp_num_layers` (None: off) depths, each adding
`mtp_loss_scaling_factor` (0.1) / D times its loss (gpt_model.py `_postprocess`), with rotary
positions (Megatron-LM refuses others). Later Megatron-LM versions add `mtp_use_repeated_layer`
(one layer run at every depth: refused, ptdp's depths have their own), `mtp_detach_heads` and
`mtp_hsm` (how the depths train, not what they compute: noted). The names are
ptdp/megatron/mtp_names.py's.
"""

from __future__ import annotations

from ptdp.megatron.errors import argument, require

# Megatron-LM's default λ (megatron/core/transformer/transformer_config.py), ptdp's too
LOSS_SCALE = 0.1
_TRAINS_OTHERWISE = {
    "mtp_detach_heads": "the depths' loss did not reach the main model (--mtp-detach-heads); "
                        "ptdp's training lets it",
    "mtp_hsm": "the depths mixed their inputs across depths in training (--mtp-hsm); ptdp's "
               "depth k always reads depth k - 1's output"}


def mtp_config(args) -> dict:
    """ModelConfig keys of a checkpoint's multi-token prediction ({} without)."""
    depths = int(argument(args, "mtp_num_layers", 0))
    if not depths:
        return {}
    require(not argument(args, "mtp_use_repeated_layer", False),
            "--mtp-use-repeated-layer: Megatron runs one MTP layer at every depth; ptdp's "
            "depths each have their own layer, so the model would differ")
    kind = argument(args, "position_embedding_type", "learned_absolute")
    require(kind == "rope", f"--mtp-num-layers={depths} with --position-embedding-type={kind}: "
                            f"ptdp's prediction depths need rotary positions")
    return {"mtp_layers": depths,
            "mtp_loss_scale": float(argument(args, "mtp_loss_scaling_factor", LOSS_SCALE))}


def mtp_notes(args) -> list[str]:
    """What converts exactly but trained otherwise in Megatron, one line each."""
    if not argument(args, "mtp_num_layers", 0):
        return []
    return [why for name, why in _TRAINS_OTHERWISE.items() if argument(args, name, False)]


def mtp_megatron_args(cfg) -> dict:
    """Megatron-LM's arguments of ptdp's multi-token prediction."""
    return {"mtp_num_layers": cfg.mtp_layers or None,
            "mtp_loss_scaling_factor": cfg.mtp_loss_scale if cfg.mtp_layers else LOSS_SCALE}


def mtp_flags(args) -> list[str]:
    """The load command's words for them (none without)."""
    depths = getattr(args, "mtp_num_layers", None)
    if not depths:
        return []
    return ["--mtp-num-layers", str(depths),
            "--mtp-loss-scaling-factor", str(args.mtp_loss_scaling_factor)]
