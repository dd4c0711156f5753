"""Megatron-LM's uneven pipeline arguments -> `parallel.stage_layers` (ptdp/config/stages.py).

As megatron-core places layers (`get_num_layers_to_build`, `PipelineParallelLayerLayout`):

* `--decoder-first-pipeline-num-layers F`, `--decoder-last-pipeline-num-layers La`: the first
  (last) pipeline rank holds F (La) layers, the other ranks share the rest evenly; with v
  virtual stages per rank each of a rank's chunks holds 1/v of its layers (virtual stage
  ``c*p + r`` of rank r).
* `--account-for-embedding-in-pipeline-split`, `--account-for-loss-in-pipeline-split`: the
  embedding (the loss) counts as one layer of an even split over the p*v virtual stages, so
  the first (last) virtual stage holds one layer fewer.
* `--pipeline-model-parallel-layout`: every virtual stage spelled out in order, `|` between
  stages, `E` the embedding (first stage), `t` a transformer layer, `L` the loss (last stage),
  `m` a multi-token-prediction depth (as many as --mtp-num-layers, after every `t`; ptdp runs
  them on the last stage, so a layout placing them earlier is refused), `X*n` and `(...)*n`
  repeat, commas are cosmetic; it also fixes v = stages / p.

Each converter works out the whole list from every argument given, so the flags that belong
together agree. Torch-free.
"""

from __future__ import annotations

import re

from ptdp.config.catalogue import INTERLEAVED
from ptdp.config.stages import StageMap
from ptdp.megatron.converters import REFUSED, Unmapped, given_int

FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
EMBEDDING = "--account-for-embedding-in-pipeline-split"
LOSS = "--account-for-loss-in-pipeline-split"
LAYOUT = "--pipeline-model-parallel-layout"
MTP = "--mtp-num-layers"
_VIRTUAL = ("--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size")


def _sizes(given: dict) -> tuple[int, int, int]:
    """(layers, p, v) of the command line."""
    layers = given_int(given, "--num-layers")
    if layers is None:
        raise Unmapped(REFUSED, "needs --num-layers to work out parallel.stage_layers")
    if "--num-layers-per-virtual-pipeline-stage" in given:
        raise Unmapped(REFUSED, "with --num-layers-per-virtual-pipeline-stage Megatron splits "
                                "evenly; give --num-virtual-stages-per-pipeline-rank instead")
    v = next((int(given[f]) for f in _VIRTUAL if given.get(f) is not None), 1)
    return layers, given_int(given, "--pipeline-model-parallel-size", 1), v


def _check(stages: list[int], layers: int) -> dict:
    if min(stages) < 0 or sum(stages) != layers:
        raise Unmapped(REFUSED, f"{stages} is not a split of {layers} layers")
    return {"parallel.stage_layers": stages}


def first_last(value, given):
    """--decoder-first/last-pipeline-num-layers -> the layers of every virtual stage."""
    layers, p, v = _sizes(given)
    if p < 2:
        raise Unmapped(REFUSED, "needs --pipeline-model-parallel-size > 1")
    if EMBEDDING in given or LOSS in given or LAYOUT in given:
        raise Unmapped(REFUSED, f"Megatron takes it without {EMBEDDING}, {LOSS} or {LAYOUT}")
    ends = {0: given_int(given, FIRST), p - 1: given_int(given, LAST)}
    ends = {rank: n for rank, n in ends.items() if n is not None}
    rest, others = layers - sum(ends.values()), p - len(ends)
    if rest < 0 or (others and rest % others) or (not others and rest):
        raise Unmapped(REFUSED, f"the other {others} pipeline ranks cannot share the remaining "
                                f"{rest} of {layers} layers evenly")
    per_rank = [ends.get(r, rest // others if others else 0) for r in range(p)]
    if any(n % v for n in per_rank):
        raise Unmapped(REFUSED, f"per-rank layers {per_rank} do not split into {v} virtual "
                                f"stages each")
    stages = StageMap(p, v)   # Megatron's looped placement: virtual stage c*p + r on rank r
    return _check([per_rank[stages.rank_of(s)] // v for s in range(p * v)], layers)


def accounted(value, given):
    """--account-for-embedding/loss-in-pipeline-split: an even split of the layers plus the
    embedding and the loss as one layer each."""
    layers, p, v = _sizes(given)
    if LAYOUT in given:
        raise Unmapped(REFUSED, f"Megatron takes it without {LAYOUT}")
    embedding, loss = int(EMBEDDING in given), int(LOSS in given)
    total, n = layers + embedding + loss, p * v
    if total % n:
        raise Unmapped(REFUSED, f"{layers} layers + {embedding + loss} do not split into "
                                f"{n} virtual stages evenly")
    stages = [total // n] * n
    stages[0] -= embedding
    stages[-1] -= loss
    return _check(stages, layers)


def layout(value, given):
    """--pipeline-model-parallel-layout -> stage_layers, and v = its stages / p. Multi-token
    prediction's depths (m) only on the last stage, where ptdp runs them."""
    return _layout(value, given, mtp_last=True)


def _layout(value, given, mtp_last: bool) -> dict:
    """`mtp_last`: refuse m before the last stage (the flags); a checkpoint's layers are
    counted wherever its depths sat."""
    layers, p, _ = _sizes(given)
    stages = layout_stages(value)
    v, rest = divmod(len(stages), p)
    if rest:
        raise Unmapped(REFUSED, f"{len(stages)} stages are not a multiple of p = {p}")
    for k, stage in enumerate(stages):
        last = k == len(stages) - 1
        allowed = "tm" + ("E" if k == 0 else "") + ("L" if last else "")
        if set(stage) - set(allowed):
            raise Unmapped(REFUSED, f"stage {k} '{stage}': ptdp's stages hold transformer "
                                    f"layers (t), the embedding on the first (E), the loss (L) "
                                    f"and the MTP depths (m) on the last")
        if "m" in stage and not last and mtp_last:
            raise Unmapped(REFUSED, f"stage {k} '{stage}': MTP depths (m) before the last stage; "
                                    f"ptdp runs them on the last stage, with the loss")
    _check_depths("".join(stages), given_int(given, MTP, 0) or 0)
    out = _check([stage.count("t") for stage in stages], layers)
    out.update({"parallel.chunks": v, **({"schedule.name": INTERLEAVED.name} if v > 1 else {})})
    return out


def _check_depths(text: str, depths: int) -> None:
    """The m entries: as many as --mtp-num-layers, after every t (megatron-core's checks)."""
    if text.count("m") != depths:
        raise Unmapped(REFUSED, f"m (an MTP depth) appears {text.count('m')} times but {MTP} is "
                                f"{depths}: Megatron-LM requires them equal")
    if depths and "t" in text[text.index("m"):]:
        raise Unmapped(REFUSED, "a transformer layer (t) after an MTP depth (m): megatron-core "
                                "places every decoder layer before them")


def layout_stages(value) -> list[str]:
    """A layout's virtual stages, repetitions expanded, cosmetic commas and spaces dropped."""
    return _expand(re.sub(r"[\s,]", "", str(value))).split("|")


def _expand(text: str) -> str:
    """Megatron's repetitions: `(group)*n` and `X*n`, innermost group first."""
    group = re.compile(r"\(([^()]*)\)\*(\d+)")
    while group.search(text):
        text = group.sub(lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    if re.search(r"[()*]", text):
        raise Unmapped(REFUSED, "cannot read its repetitions")
    return text


def counts_from_args(args, pipeline: int, chunks: int) -> list[int] | None:
    """The layers of every virtual stage of the Megatron job a checkpoint's `args` describe
    (as the flags above convert), or None when its split is even. Raises Unmapped where ptdp
    cannot hold its layout."""
    flags = {FIRST: "decoder_first_pipeline_num_layers", LAST: "decoder_last_pipeline_num_layers",
             LAYOUT: "pipeline_model_parallel_layout", EMBEDDING: EMBEDDING[2:].replace("-", "_"),
             LOSS: LOSS[2:].replace("-", "_")}
    given = {flag: getattr(args, name, None) for flag, name in flags.items()}
    given = {flag: value for flag, value in given.items()
             if value is not None and value is not False}   # a first stage of 0 layers counts
    if not given or pipeline == 1:
        return None
    given.update({"--num-layers": args.num_layers, "--pipeline-model-parallel-size": pipeline,
                  "--num-virtual-stages-per-pipeline-rank": chunks,
                  MTP: getattr(args, "mtp_num_layers", None) or 0})
    if LAYOUT in given:   # the depths' stage does not move a checkpoint's layers
        return _layout(given[LAYOUT], given, mtp_last=False)["parallel.stage_layers"]
    convert = first_last if FIRST in given or LAST in given else accounted
    return convert(given[next(iter(given))], given)["parallel.stage_layers"]
