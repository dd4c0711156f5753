"""Megatron-LM's uneven pipeline arguments translate into parallel.stage_layers exactly, as
megatron-core places the layers (ptdp/megatron/pipeline_layers.py), or are refused in one line."""

import pytest

from ptdp.megatron.translate import translate

BASE = ["--num-layers", "8", "--pipeline-model-parallel-size", "4"]


def _translated(*words):
    t = translate([*BASE, *words])
    return t.values, [str(line) for line in t.lines if line.kind == "refused"]


@pytest.mark.parametrize("words,stages", [
    (["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"],
     [1, 3, 3, 1]),
    (["--decoder-last-pipeline-num-layers", "2"], [2, 2, 2, 2]),
    (["--decoder-first-pipeline-num-layers", "0", "--decoder-last-pipeline-num-layers", "2"],
     [0, 3, 3, 2]),
    # v = 2: each of a rank's chunks holds half its layers, stage c*p + r
    (["--decoder-first-pipeline-num-layers", "0", "--decoder-last-pipeline-num-layers", "4",
      "--num-virtual-stages-per-pipeline-rank", "2"], [0, 1, 1, 2, 0, 1, 1, 2]),
    (["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
      "--num-layers", "6"], [1, 2, 2, 1]),
    (["--account-for-loss-in-pipeline-split", "--num-layers", "7"], [2, 2, 2, 1]),
    (["--pipeline-model-parallel-layout", "Et|(tt|)*2tttL"], [1, 2, 2, 3]),
])
def test_uneven_flags_become_stage_layers(words, stages):
    values, refused = _translated(*words)
    assert refused == [] and values["parallel.stage_layers"] == stages


def test_layout_sets_the_virtual_stages():
    values, _ = _translated("--pipeline-model-parallel-layout", "E|t*2|t*2|t|t|t|t|L")
    assert values["parallel.stage_layers"] == [0, 2, 2, 1, 1, 1, 1, 0]
    assert values["parallel.chunks"] == 2 and values["schedule.name"] == "interleaved"


@pytest.mark.parametrize("words,line", [
    (["--decoder-first-pipeline-num-layers", "3"],
     "refused: --decoder-first-pipeline-num-layers 3: the other 3 pipeline ranks cannot share the "
     "remaining 5 of 8 layers evenly"),
    (["--pipeline-model-parallel-layout", "E|tt|tEt|ttL"],
     "refused: --pipeline-model-parallel-layout E|tt|tEt|ttL: stage 2 'tEt': ptdp's stages hold "
     "transformer layers (t), the embedding on the first (E), the loss (L) and the MTP depths "
     "(m) on the last"),
    (["--pipeline-model-parallel-layout", "E|tt|tt|tt|tt|L"],
     "refused: --pipeline-model-parallel-layout E|tt|tt|tt|tt|L: 6 stages are not a multiple of "
     "p = 4"),
    (["--account-for-loss-in-pipeline-split"],
     "refused: --account-for-loss-in-pipeline-split: 8 layers + 1 do not split into 4 virtual "
     "stages evenly"),
])
def test_layouts_ptdp_cannot_run_are_refused_in_one_line(words, line):
    assert _translated(*words)[1] == [line]
