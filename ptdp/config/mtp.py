"""Multi-token prediction's keys (model.mtp_layers, model.mtp_loss_scale; models/mtp.py): checks
of the keys against the model and the schedule, one line each. Torch-free, like the rest of
ptdp/config/; ptdp/config/validation.py calls them."""

from __future__ import annotations

from ptdp.config.catalogue import SCHEDULES, names_where
from ptdp.config.models import MODEL_FAMILIES, family_names
from ptdp.config.problems import Problems
from ptdp.config.schema import Config, ModelConfig


def check_mtp_model(m: ModelConfig, out: Problems) -> None:
    """The keys, and the models they apply to: causal decoders with rotary positions."""
    if not out.positive(m.mtp_layers, "model.mtp_layers", strict=False,
                        hint=" (0: no multi-token prediction)"):
        return
    if m.mtp_layers == 0:
        return
    out.positive(m.mtp_loss_scale, "model.mtp_loss_scale")
    family = MODEL_FAMILIES.get(m.arch)
    out.require(family is None or family.causal,
                f"model.mtp_layers > 0 (multi-token prediction) applies to model.arch="
                f"{family_names(lambda f: f.causal)} only: it predicts the tokens further "
                f"ahead of a causal decoder's")
    out.require(m.position_embedding == "rope",
                "model.mtp_layers > 0 needs model.position_embedding=rope: a depth embeds the "
                "tokens ahead at their own positions, which a learned table would have to share "
                "between the first and the last pipeline stage")


def check_mtp_layout(cfg: Config, out: Problems) -> None:
    """The depths' losses are side outputs of the last stage, which only a flushing schedule
    adds to the objective (ptdp/pipeline/executor.py)."""
    spec = SCHEDULES.get(cfg.schedule.name)
    if cfg.model.mtp_layers > 0 and spec is not None:
        out.require(spec.flushing,
                    f"model.mtp_layers > 0 needs a flushing schedule "
                    f"({', '.join(names_where(lambda s: s.flushing))}), not schedule.name="
                    f"{cfg.schedule.name}: the depths' losses are side outputs of the last stage")
