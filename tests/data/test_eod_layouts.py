"""The end-of-document options under tensor, sequence, pipeline and context parallelism: every
layout trains the model one process trains (the project's oracle, tests/equivalence.py), on
documents whose <eod> falls inside the samples; the Llama runs add sliding windows on some
layers (the document mask and the windows through the context ring's per-block masks). One
spawned 4-rank job (4 layers, 2 iterations); parallel.data=4 is the reference (each rank a
whole model, which the suite shows equals one process)."""

from __future__ import annotations

import numpy as np
import pytest

from ptdp.data.indexed import IndexedDatasetWriter
from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import MODELS, assert_equivalent, train_and_collect

EOD = 3
OPTIONS = ["data.reset_position_ids=true", "data.reset_attention_mask=true",
           "data.eod_mask_loss=true"]
WINDOW = ["model.sliding_window=4", "model.sliding_window_layers=[0,2]"]
RUNS = {   # name -> overrides; the options on, on indexed data
    "gpt d4": MODELS["gpt"] + ["parallel.data=4"] + OPTIONS,
    "gpt p2 t2 sp": MODELS["gpt"] + ["parallel.pipeline=2", "parallel.tensor=2",
                                     "parallel.sequence_parallel=true",
                                     "schedule.name=1f1b"] + OPTIONS,
    # Llama (grouped-query heads) with sliding windows on layers 0 and 2 (4 tokens: with c = 2
    # a window crosses chunk borders) besides the documents: the ring's masked blocks, and
    # interleaved pipeline stages with tensor and sequence parallelism
    "llama d4": MODELS["llama"] + ["parallel.data=4"] + OPTIONS + WINDOW,
    "llama c2 t2": MODELS["llama"] + ["parallel.context=2", "parallel.tensor=2"] + OPTIONS
    + WINDOW,
    "llama p2 v2 t2 sp": MODELS["llama"] + ["parallel.pipeline=2", "parallel.chunks=2",
                                            "parallel.tensor=2", "parallel.sequence_parallel=true",
                                            "schedule.name=interleaved"] + OPTIONS + WINDOW,
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("eod") / "docs"
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, 100, {"special_ids": {"<eod>": EOD}}) as writer:
        for _ in range(120):   # documents of 1..12 tokens: several per 16-token sample
            writer.add_document([np.append(rng.integers(4, 100, int(rng.integers(0, 12))), EOD)])
    data = ["data.source=indexed", f"data.paths=[{prefix}]", "data.split=1", "model.num_layers=4"]
    runs = [overrides + data for overrides in RUNS.values()]
    per_rank = run_on_ranks(4, train_and_collect, runs, 2, False, timeout_s=within(240))
    return {name: [per_rank[r][i] for r in range(4)] for i, name in enumerate(RUNS)}


@pytest.mark.parametrize("name, reference", [("gpt p2 t2 sp", "gpt d4"),
                                             ("llama c2 t2", "llama d4"),
                                             ("llama p2 v2 t2 sp", "llama d4")])
def test_layouts_match_with_eod_options(results, name, reference):
    for rank in results[name]:
        assert_equivalent(rank, results[reference][0], name)
