"""Uneven pipeline stages (parallel.stage_layers) train exactly like one process.

Every flushing schedule (GPipe, 1F1B, interleaved, zb-h1) with uneven layouts, stages without
transformer layers at either end, with t, d, c, sequence parallelism, the distributed optimizer
and recomputation, also under NCCL's in-order transport (tests/pipeline/nccl_rules.py), equals
the single-process losses, gradients and weights (tests/equivalence.py); 2BW and PipeDream follow
their simulated update rules (tests/pipeline/no_flush_oracles.py). Runs of one world size share
one spawned job.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import pytest

from ptdp.config import ConfigError, load_config
from ptdp.config.stages import layer_counts, layer_ranges
from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import (ITERS, MODELS, TINY, assert_equivalent, reference,
                               train_and_collect)

P4 = ["parallel.pipeline=4", "parallel.stage_layers=[1,3,3,1]"]
P3V2 = ["parallel.pipeline=3", "parallel.chunks=2", "schedule.name=interleaved",
        "parallel.stage_layers=[0,2,2,2,2,0]", "train.global_batch_size=12"]
P2 = ["model.num_layers=4", "parallel.pipeline=2", "parallel.stage_layers=[3,1]"]

# name -> (world size, arch, overrides, under NCCL's in-order rules)
FLUSHING = {
    "p4-1f1b":           (4, "gpt", P4 + ["schedule.name=1f1b"], False),
    "p4-1f1b-nccl":      (4, "llama", P4 + ["schedule.name=1f1b"], True),
    "p4-gpipe":          (4, "bert", P4 + ["schedule.name=gpipe"], False),
    "p4-zb-h1-nccl":     (4, "gpt", P4 + ["schedule.name=zb-h1"], True),
    "p2-t2-distopt-sp":  (4, "llama", P2 + ["parallel.tensor=2", "parallel.sequence_parallel=true",
                                            "train.distributed_optimizer=true"], False),
    "p2-d2-distopt":     (4, "gpt", P2 + ["parallel.data=2", "train.distributed_optimizer=true"],
                          False),
    "p2-d2-recompute":   (4, "bert", ["parallel.pipeline=2", "parallel.data=2",
                                      "parallel.stage_layers=[0,8]", "train.recompute=full",
                                      "train.recompute_num_layers=3"], False),
    "p2-c2":             (4, "gpt", ["parallel.pipeline=2", "parallel.context=2",
                                     "parallel.stage_layers=[5,3]"], True),
    "p3-v2":             (3, "gpt", P3V2, False),
    "p3-v2-nccl":        (3, "bert", P3V2, True),
}
# name -> (world size, overrides): gpt, 2BW for 4 iterations, PipeDream for 3 (test_no_flush.py)
NO_FLUSH = {
    "2bw-p4":            (4, ["schedule.name=2bw", "parallel.pipeline=4",
                              "parallel.stage_layers=[2,2,3,1]"]),
    "pd-p2":             (2, ["schedule.name=pipedream", "train.clip_grad=0",
                              "parallel.pipeline=2", "parallel.stage_layers=[1,7]"]),
}


def _reference_overrides(name: str) -> list[str]:
    """The single process's run for a layout: the same model and batch."""
    _, arch, overrides, _ = FLUSHING[name]
    return [*MODELS[arch],
            *(o for o in overrides if o.startswith(("model.", "train.global_batch_size")))]


def _rank_job(flushing: list[tuple[list[str], bool]], no_flush: list[list[str]]):
    from tests.pipeline.test_no_flush import train_runs
    return ([train_and_collect([overrides], ITERS, nccl)[0] for overrides, nccl in flushing],
            train_runs(no_flush))


def _world(world: int) -> dict:
    flushing = [n for n, (w, *_) in FLUSHING.items() if w == world]
    no_flush = [n for n, (w, _) in NO_FLUSH.items() if w == world]
    per_rank = run_on_ranks(world, _rank_job,
                            [([*MODELS[FLUSHING[n][1]], *FLUSHING[n][2]], FLUSHING[n][3])
                             for n in flushing],
                            [[*MODELS["gpt"], *NO_FLUSH[n][1]] for n in no_flush],
                            timeout_s=within(400))
    results = {n: [per_rank[r][0][i] for r in range(world)] for i, n in enumerate(flushing)}
    results.update({n: [per_rank[r][1][i] for r in range(world)] for i, n in enumerate(no_flush)})
    return results


_JOBS: dict = {}   # world size -> future of _world(world size)


def result(name: str) -> list[dict]:
    """Name's per-rank results. Every world size's job starts at the first request, all
    together (one job alone leaves cores idle: its ranks wait on exchanges and start-up);
    their threads end with them."""
    if not _JOBS:
        for size in sorted({w for w, *_ in [*FLUSHING.values(), *NO_FLUSH.values()]}):
            pool = ThreadPoolExecutor(1, thread_name_prefix=f"uneven-{size}")
            _JOBS[size] = pool.submit(_world, size)
            pool.shutdown(wait=False)
    world = FLUSHING[name][0] if name in FLUSHING else NO_FLUSH[name][0]
    return _JOBS[world].result()[name]


def _oracle_job(references: list[list[str]], two_bw: list[str], pipedream: tuple):
    from tests.pipeline.no_flush_oracles import simulate_pipedream, simulate_two_bw
    return ([train_and_collect([overrides], ITERS)[0] for overrides in references],
            simulate_two_bw(two_bw, 4), simulate_pipedream(*pipedream))


@functools.lru_cache(maxsize=None)
def _oracles() -> dict:
    """The single-process references and the no-flush rules, in one single-process job; the
    references of the plain models are tests/equivalence.py's, from its shared job."""
    wanted = sorted({tuple(_reference_overrides(n)) for n in FLUSHING})
    plain = {tuple(MODELS[arch]): arch for arch in MODELS}
    own = [r for r in wanted if r not in plain]
    stage_of = {}
    for rank in result("pd-p2"):
        stage_of.update(rank["stage_of"])
    pd = [*MODELS["gpt"], *NO_FLUSH["pd-p2"][1]]
    refs, two_bw, pipedream = run_on_ranks(
        1, _oracle_job, [list(r) for r in own], [*MODELS["gpt"], *NO_FLUSH["2bw-p4"][1]],
        (pd, 3, 2, 1, stage_of, False), timeout_s=within(400))[0]
    refs = {**dict(zip(own, refs)), **{r: reference(plain[r]) for r in wanted if r in plain}}
    return {"refs": refs, "2bw-p4": two_bw, "pd-p2": pipedream}


# ---------------------------------------------------------------------------- layer ranges


def test_layer_ranges_keep_global_indices():
    assert layer_ranges(8, 4, [1, 3, 3, 1]) == (range(0, 1), range(1, 4), range(4, 7), range(7, 8))
    assert layer_ranges(8, 6, [0, 2, 2, 2, 2, 0])[0] == range(0, 0)
    assert layer_ranges(8, 4) == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))
    assert layer_counts(8, 2, [0, 8]) == (0, 8)
    with pytest.raises(ValueError, match="sums to 9"):
        layer_ranges(8, 2, [4, 5])


@pytest.mark.parametrize("value,message", [
    ("[1,3,3]", "parallel.stage_layers has 3 entries; it needs one per virtual stage, "
                "parallel.pipeline * parallel.chunks = 4"),
    ("[1,3,3,2]", "parallel.stage_layers sums to 9 layers but model.num_layers is 8"),
    ("[-1,5,3,1]", "parallel.stage_layers has a negative layer count (-1)"),
    ("[4,0,3,1]", "parallel.stage_layers: stage 1 holds no layers; only the first stage"),
])
def test_bad_stage_layers_are_one_line_each(value, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, TINY + ["parallel.pipeline=4", f"parallel.stage_layers={value}"],
                    world_size=4)
    assert len(err.value.errors) == 1 and message in err.value.errors[0], err.value.errors


def test_stage_layers_lift_the_divisibility_rule():
    cfg = load_config(None, TINY + ["model.num_layers=7", "parallel.pipeline=2",
                                    "parallel.stage_layers=[4,3]"], world_size=2)
    assert cfg.parallel.stage_layers == [4, 3]


# ---------------------------------------------------------------------------- training


@pytest.mark.parametrize("name", list(FLUSHING))
def test_uneven_layouts_match_single_process(name):
    want = _oracles()["refs"][tuple(_reference_overrides(name))]
    for rank in result(name):
        assert_equivalent(rank, want, name)


def test_parameters_live_where_their_layers_are():
    """[1,3,3,1] at p=4: rank r holds exactly the layers of stage r, under global names."""
    for rank in result("p4-1f1b"):
        r = rank["coords"].pipeline
        layers = {int(n.split(".")[1]) for n in rank["shards"] if n.startswith("layers.")}
        assert layers == set(layer_ranges(8, 4, [1, 3, 3, 1])[r]), (r, layers)


def test_two_bw_uneven_follows_the_delay_one_rule():
    from tests.pipeline.test_no_flush import assert_matches
    ranks = result("2bw-p4")
    assert_matches(ranks[0], _oracles()["2bw-p4"], "2bw [2,2,3,1]")
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)


def test_pipedream_uneven_follows_the_stashing_rule():
    from tests.pipeline.test_no_flush import assert_matches
    assert_matches(result("pd-p2")[0], _oracles()["pd-p2"], "pipedream [1,7]")
