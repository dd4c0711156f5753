"""Megatron-LM's multi-token-prediction flags translate to model.mtp_layers and
model.mtp_loss_scale (ptdp/megatron/mtp_flags.py), a --pipeline-model-parallel-layout with its
depths (m) on the last stage to parallel.stage_layers (ptdp/megatron/pipeline_layers.py), and
every other MTP setting is refused (or ignored) in one line."""

import pytest

from ptdp.config import load_config
from ptdp.megatron.translate import translate

ROPE = ["--position-embedding-type", "rope"]
PIPE = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", *ROPE]


def _translated(*words):
    t = translate(list(words), defaults=False)
    values = {k: v for k, v in t.values.items() if k != "model.arch"}
    return values, [(str(line), line.blocks) for line in t.lines]


def test_depths_and_scale_map_exactly_and_pass_ptdp_check():
    values, lines = _translated("--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3",
                                *ROPE)
    assert lines == []
    assert (values["model.mtp_layers"], values["model.mtp_loss_scale"]) == (2, 0.3)
    t = translate(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                   "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-3",
                   "--train-iters", "2", "--mtp-num-layers", "2",
                   "--use-rotary-position-embeddings", "--vocab-size", "64"])
    cfg = load_config(None, [f"{k}={v}" for k, v in t.values.items()], world_size=1)
    assert (cfg.model.mtp_layers, cfg.model.mtp_loss_scale) == (2, 0.1)   # Megatron's λ


@pytest.mark.parametrize("layout, stages", [
    ("Ett|ttmL", [2, 2]),
    ("Et*2|t,t,m,L", [2, 2]),           # Megatron's cosmetic commas
    ("Ett|tt|mL", [2, 2, 0]),           # the depths' stage without decoder layers
])
def test_a_layout_with_the_depths_on_the_last_stage_translates(layout, stages):
    values, lines = _translated(*PIPE, "--pipeline-model-parallel-size", str(len(stages)),
                                "--mtp-num-layers", "1", "--pipeline-model-parallel-layout",
                                layout)
    assert lines == [] and values["parallel.stage_layers"] == stages
    assert values["model.mtp_layers"] == 1


@pytest.mark.parametrize("words, line, blocks", [
    (["--mtp-num-layers", "1"],
     "refused: --mtp-num-layers 1: Megatron-LM takes multi-token prediction with rotary "
     "positions only (--position-embedding-type rope), as ptdp", True),
    (["--mtp-use-repeated-layer", *ROPE],
     "refused: --mtp-use-repeated-layer: one MTP layer run at every depth; ptdp's depths each "
     "have their own layer", True),
    (["--mtp-detach-heads"],
     "refused: --mtp-detach-heads: the depths' loss would not reach the main model; ptdp's "
     "reaches it", False),
    (["--mtp-hsm"],
     "refused: --mtp-hsm: hidden-state mixing across depths in training; ptdp's depth k reads "
     "depth k - 1's output", False),
    (["--mtp-hybrid-override-pattern", "*-"],
     "refused: --mtp-hybrid-override-pattern *-: a hybrid (Mamba) model's depths; ptdp has no "
     "state-space layers", True),
    (["--mtp-something-new", "3"],
     "refused: --mtp-something-new 3: an MTP option ptdp does not take (it maps "
     "--mtp-num-layers and --mtp-loss-scaling-factor)", True),
    (["--mtp-loss-scaling-factor", "0.2"],
     "ignored: --mtp-loss-scaling-factor 0.2: Megatron uses it only with --mtp-num-layers",
     False),
    (["--mtp-standalone"],
     "ignored: --mtp-standalone: megatron-core sets it from --pipeline-model-parallel-layout, "
     "whose m entries place the depths; it changes only its p2p exchanges", False),
    ([*PIPE, "--mtp-num-layers", "1", "--num-layers", "4", "--pipeline-model-parallel-size",
      "3", "--pipeline-model-parallel-layout", "Ett|ttm|L"],
     "refused: --pipeline-model-parallel-layout Ett|ttm|L: stage 1 'ttm': MTP depths (m) before "
     "the last stage; ptdp runs them on the last stage, with the loss", False),
    ([*PIPE, "--pipeline-model-parallel-layout", "Ett|ttmL"],
     "refused: --pipeline-model-parallel-layout Ett|ttmL: m (an MTP depth) appears 1 times but "
     "--mtp-num-layers is 0: Megatron-LM requires them equal", False),
    ([*PIPE, "--mtp-num-layers", "1", "--pipeline-model-parallel-layout", "Ett|tmtL"],
     "refused: --pipeline-model-parallel-layout Ett|tmtL: a transformer layer (t) after an MTP "
     "depth (m): megatron-core places every decoder layer before them", False),
    # experts, every 2nd layer (the last, 3, dense), the depths alone on the last stage
    ([*PIPE, "--pipeline-model-parallel-size", "3", "--pipeline-model-parallel-layout",
      "Ett|tt|mL", "--mtp-num-layers", "1", "--num-experts", "4", "--disable-bias-linear",
      "--moe-layer-freq", "2"],
     "refused: --mtp-num-layers 1: the layout's last stage holds the MTP depths without decoder "
     "layers: Megatron-LM then builds them as MoE layers, but the last decoder layer (ptdp's "
     "depths' kind) is dense", True),
])
def test_what_ptdp_would_compute_otherwise_is_one_line(words, line, blocks):
    assert _translated(*words)[1] == [(line, blocks)]
