"""The search: ranking properties, pruning reasons, and the source's layout takeaways."""

import time

import pytest

from ptdp.planner.cost_model import SCHEDULES, Workload
from ptdp.planner.errors import PlanError
from ptdp.planner.search import parse_fix, search, why_slower
from tests.planner.conftest import searched
from tests.planner.planner_cases import (GPT3_175B, GPT_145B, GPT_162B, GPT_1T, GPT_5_9B, Layout,
                                         gpt, run)


def _search(hw, shape, batch, gpus, fixed=None, **kw):
    return searched(hw, Workload(shape, batch, "bf16", hw.gpus_per_node), gpus, fixed, **kw)


# The source's takeaways are about the source's techniques: without sequence parallelism,
# the zero-bubble schedule and the recomputation of norms and activations (which make deeper
# pipelines and smaller t pay; tested below); its selective recomputation is core_attn alone.
SOURCE_ONLY = {"schedules": ("gpipe", "1f1b", "interleaved")}


def _source_search(hw, shape, batch, gpus, fixed=None, **kw):
    return _search(hw, shape, batch, gpus, {"sequence_parallel": False,
                                            "recompute_modules": ("core_attn",), **(fixed or {})},
                   **SOURCE_ONLY, **kw)


@pytest.fixture(scope="module")
def gpt3_plan(a100):
    return _source_search(a100, GPT3_175B, 1536, 1024)


def test_ranking_is_sorted_feasible_and_complete(gpt3_plan, a100):
    times = [p.step_time_s for p in gpt3_plan.ranked]
    assert times == sorted(times)
    assert all(p.memory_gb_per_gpu <= a100.memory_gb for p in gpt3_plan.ranked)
    assert all(p.layout.gpus == 1024 for p in gpt3_plan.ranked)
    rejected = sum(gpt3_plan.rejected.counts.values())
    assert gpt3_plan.rejected.counts["out of memory"] > 0
    assert len(gpt3_plan.ranked) + gpt3_plan.rejected.counts["out of memory"] == gpt3_plan.evaluated
    assert rejected > 0


def test_gpt3_plan_keeps_tensor_parallelism_in_a_node(gpt3_plan):
    # Takeaway #1 (L3825): t up to the GPUs per node, pipeline across nodes.
    best = gpt3_plan.best.layout
    assert best.tensor == 8 and best.pipeline > 1
    assert all(p.layout.tensor <= 8 for p in gpt3_plan.ranked[:20])
    assert best.schedule != "2bw"            # not considered unless asked for
    assert gpt3_plan.best.tflops_per_gpu > 120


def test_recomputation_only_when_memory_or_throughput_calls_for_it(a100):
    # §4.3.5 / Fig. 4.17: 145B on 128 GPUs with (t, p) = (8, 16). On 80 GB the stashes fit,
    # so recomputing would only cost time; on 40 GB something must be recomputed.
    fixed = {"tensor": 8, "pipeline": 16, "schedule": "1f1b"}
    roomy = _search(a100, GPT_145B, 16, 128, fixed, attention="materialized").best
    assert roomy.layout.recompute == "none"
    from ptdp.hardware import load_hardware
    small = _search(load_hardware("a100-40gb"), GPT_145B, 16, 128, fixed,
                    attention="materialized")
    assert small.best.layout.recompute != "none"
    assert not any(p.layout.recompute == "none" for p in small.ranked)


def test_tensor_pipeline_tradeoff_peaks_at_t_equal_gpus_per_node(a100):
    # Fig. 4.13: 162B on 64 GPUs, peak at t = 8; poor combinations are far slower (up to 2x).
    for batch in (32, 128):
        tflops = {t: run(a100, GPT_162B, batch, Layout(64 // t, t, 1, micro_batch=1,
                                                      recompute="full")).tflops_per_gpu
                  for t in (2, 4, 8, 16, 32)}
        assert max(tflops, key=tflops.get) == 8
        assert tflops[8] / min(tflops.values()) > 1.4


@pytest.mark.parametrize("batch", [32, 128, 512])
def test_throughput_falls_with_pipeline_and_tensor_size_for_a_small_model(a100, batch):
    # Figs. 4.14 and 4.15: 5.9B on 64 GPUs, b = 1; data parallelism scales best.
    by_p = [run(a100, GPT_5_9B, batch, Layout(p, 1, 64 // p, micro_batch=1)).tflops_per_gpu
            for p in (2, 4, 8, 16, 32)]
    by_t = [run(a100, GPT_5_9B, batch, Layout(1, t, 64 // t, micro_batch=1)).tflops_per_gpu
            for t in (2, 4, 8, 16, 32)]
    assert by_p == sorted(by_p, reverse=True)
    assert by_t == sorted(by_t, reverse=True)


def test_interleaving_needs_scatter_gather_at_large_batch(a100):
    # Fig. 4.12: 175B on 96 GPUs; interleaved + scatter/gather beats the default schedule and
    # the gap closes as the batch grows; without scatter/gather the default wins at large B.
    def tflops(batch, **kw):
        return run(a100, GPT3_175B, batch, Layout(12, 8, 1, micro_batch=1, recompute="full", **kw),
                   attention="materialized").tflops_per_gpu
    gaps = []
    for batch in (12, 48, 384):
        default = tflops(batch)
        sg = tflops(batch, chunks=2, schedule="interleaved", scatter_gather=True)
        assert sg > default
        gaps.append(sg / default)
    assert gaps == sorted(gaps, reverse=True)
    assert tflops(384) > tflops(384, chunks=2, schedule="interleaved")


def test_2bw_wins_when_allowed_because_it_never_flushes(a100):
    result = _search(a100, GPT_145B, 128, 128, {"tensor": 8, "pipeline": 16}, schedules=SCHEDULES)
    assert result.best.layout.schedule == "2bw"
    assert result.best.bubble_fraction == 0


def test_fix_pins_every_choice(a100):
    fixed = parse_fix("p=8,t=8,b=1,v=2,schedule=interleaved,recompute=full,sg=true")
    result = _search(a100, GPT3_175B, 1536, 1024, fixed)
    assert {(p.layout.pipeline, p.layout.tensor, p.layout.data, p.layout.chunks,
             p.layout.micro_batch, p.layout.schedule, p.layout.recompute,
             p.layout.scatter_gather) for p in result.ranked} == {
        (8, 8, 16, 2, 1, "interleaved", "full", True)}


@pytest.mark.parametrize("text,message", [
    ("p=0", "positive integer"), ("q=3", "unknown key 'q'"), ("schedule=zigzag", "not one of"),
    ("recompute=some", "not one of"), ("sg=maybe", "true or false"), ("p8", "key=value"),
])
def test_bad_fix_is_named(text, message):
    with pytest.raises(PlanError, match=message):
        parse_fix(text)


def test_impossible_fix_names_the_problem(a100):
    with pytest.raises(PlanError, match="p=3: 3 does not divide"):
        _search(a100, GPT3_175B, 1536, 1024, {"pipeline": 3})
    result = _search(a100, GPT3_175B, 2048, 1024, {"pipeline": 1, "tensor": 1})
    assert not result.ranked and "out of memory" in result.rejected.counts
    heads = _search(a100, gpt(4, 1024, 12), 64, 16, {"tensor": 16})
    assert not heads.ranked and "num_heads" in heads.rejected.examples["indivisible"]


def test_why_slower_names_the_cause(a100):
    best = run(a100, GPT_145B, 32, Layout(16, 8, 1, chunks=5, micro_batch=1, schedule="interleaved",
                                          recompute="full"))
    worse = run(a100, GPT_145B, 32, Layout(16, 8, 1, micro_batch=1, recompute="full"))
    assert worse.step_time_s > best.step_time_s
    assert "bubble" in why_slower(worse, best)
    assert why_slower(best, best) == "best"


def test_search_over_3072_gpus_takes_seconds(a100):
    start = time.perf_counter()   # the search itself, never an answer kept from before
    result = search(a100, Workload(GPT_1T, 3072, "bf16", a100.gpus_per_node), 3072,
                    {"sequence_parallel": False, "recompute_modules": ("core_attn",)},
                    **SOURCE_ONLY)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"search took {elapsed:.1f} s"
    best = result.best.layout
    assert best.tensor == 8 and result.best.tflops_per_gpu > 130


def test_gpt_1t_crosses_nodes_with_tensor_parallelism_only_where_t8_cannot_fit(a100):
    """Without sequence parallelism the search over 3,072 GPUs picks t = 16 (docs/planner.md):
    selective's default fits there and not at t = 8, where only full recomputation fits, and
    the 16-GPU all-reduces over the network cost less than recomputing every forward."""
    def layout(t, d, recompute, v=1):
        return Layout(64, t, d, v, 1, "interleaved" if v > 1 else "1f1b", recompute, True)
    t16, t8 = run(a100, GPT_1T, 3072, layout(16, 3, "selective")), \
        run(a100, GPT_1T, 3072, layout(8, 6, "selective"))
    full = run(a100, GPT_1T, 3072, layout(8, 6, "full", v=2))
    assert t16.fits and full.fits and not t8.fits
    assert t8.step_time_s < t16.step_time_s < full.step_time_s
    assert t16.time["tensor_comm"] - full.time["tensor_comm"] < full.time["recompute"]


def test_recomputation_chosen_when_it_buys_throughput(a100):
    # With 2021-style attention kernels (scores kept in memory), GPT-3 on 1024 GPUs can run
    # without recomputation only on deeper pipelines; recomputing lets shallower, faster
    # layouts fit, so the planner recomputes although a no-recomputation layout exists.
    result = _search(a100, GPT3_175B, 1536, 1024, attention="materialized")
    best = result.best
    assert best.layout.recompute in ("selective", "full")
    no_recompute = [p for p in result.ranked if p.layout.recompute == "none"]
    assert no_recompute and no_recompute[0].step_time_s > best.step_time_s


def test_sequence_parallelism_and_zero_bubble_are_chosen_when_they_pay(a100):
    """With t > 1 sequence parallelism costs no time and saves activations (and boundary
    bytes); with p > 1 ZB-H1 idles a third of PipeDream-Flush's bubble, about half of ptdp's
    1F1B's (whose cooldown sends input gradients first), at 1F1B's peak memory."""
    best = _search(a100, GPT3_175B, 1536, 1024).best
    assert best.layout.sequence_parallel and best.layout.schedule == "zb-h1"
    fixed = {"tensor": 8, "pipeline": 16, "micro_batch": 1, "recompute": "none"}
    one = _search(a100, GPT3_175B, 1536, 1024, {**fixed, "schedule": "1f1b",
                                                "sequence_parallel": False}).best
    zb = _search(a100, GPT3_175B, 1536, 1024, {**fixed, "schedule": "zb-h1",
                                               "sequence_parallel": False}).best
    sp = _search(a100, GPT3_175B, 1536, 1024, {**fixed, "schedule": "1f1b",
                                               "sequence_parallel": True}).best
    assert zb.time["bubble"] < one.time["bubble"] * 0.6 and zb.step_time_s < one.step_time_s
    assert sp.memory["activations"] < one.memory["activations"]
    assert sp.time["pipeline_p2p"] < one.time["pipeline_p2p"]
