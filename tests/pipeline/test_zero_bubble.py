"""Zero-bubble pipeline (schedule.name=zb-h1): the schedule, its bubble and memory, the split
backward, and exact equality with the single-process run, alone and with sequence parallelism.

Layouts (p, t, d) = (2, 2, 1), (1, 2, 2), (2, 2, 2), GPT and BERT, fp32, under the in-order
(NCCL-rules) transport; checkpoints resume exactly.
"""

import functools
from fractions import Fraction

import pytest
import torch

from ptdp.runtime.local_ranks import run_on_ranks
from ptdp.parallel.weight_grad import weight_grads_of
from ptdp.pipeline.schedules import build_all, format_schedule, max_in_flight
from ptdp.pipeline.timeline import simulate
from tests.deadline import within
from tests.equivalence import ARCHS, RTOL, assert_equivalent, reference, relative_error
from tests.features import LAYOUTS, SP, ZB, _trainer, feature_layout, resume_job


def test_zb_h1_known_order():
    """Rank r keeps r weight-gradient passes pending and runs them at the end."""
    assert format_schedule("zb-h1", 2, 1, 4) == (
        "rank 0: F0  F1  B0  Wg0 F2  B1  Wg1 F3  B2  Wg2 B3  Wg3\n"
        "rank 1: F0  B0  F1  B1  Wg0 F2  B2  Wg1 F3  B3  Wg2 Wg3")


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_bubble_is_a_third_of_1f1b_with_equal_pass_times(p):
    """t_F = t_B = t_W = 1: PipeDream-Flush idles (p-1)(t_F+t_B+t_W), ptdp's 1F1B, whose
    cooldown sends input gradients first, (p-1)(t_F+t_B), ZB-H1 (p-1)(t_F+t_B-t_W)."""
    one = Fraction(1)
    for m in (p, 2 * p, 4 * p):
        zb = simulate("zb-h1", p, 1, m, t_f=one, t_b=2 * one)
        ours = simulate("1f1b", p, 1, m, t_f=one, t_b=2 * one)
        whole = simulate("1f1b", p, 1, m, t_f=one, t_b=2 * one, t_w=0 * one)
        assert zb.makespan - zb.ideal == (p - 1) * 1
        assert ours.makespan - ours.ideal == (p - 1) * 2
        assert whole.makespan - whole.ideal == (p - 1) * 3


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (8, 16)])
def test_peak_activations_equal_1f1b(p, m):
    """A micro-batch's activations live from F to Wg: no rank holds more than 1F1B's peak."""
    zb = [max_in_flight(row) for row in build_all("zb-h1", p, 1, m)]
    flush = [max_in_flight(row) for row in build_all("1f1b", p, 1, m)]
    assert max(zb) == max(flush) == min(p, m)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("feature", [ZB, ZB + SP], ids=["zb", "zb+sp"])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda l: "p{}-t{}-d{}".format(*l))
def test_zero_bubble_layouts_match_single_process(arch, feature, layout):
    for rank in feature_layout(tuple(feature), layout, arch):
        assert_equivalent(rank, reference(arch), f"{arch} {layout} {feature}")


def _where_weights_get_gradients() -> dict:
    """Which pass (B or Wg) accumulated each parameter's gradient, on pipeline rank 0 of a
    (p=2, t=1) zb-h1 GPT run, and how many data-parallel buckets launched inside a Wg."""
    trainer = _trainer(["parallel.pipeline=2", "parallel.data=2", *ZB])
    inside = [False]
    (queue,) = [weight_grads_of(chunk) for chunk in trainer.state.chunks.values()]
    run = queue.run

    def traced_run(mb):
        inside[0] = True
        try:
            run(mb)
        finally:
            inside[0] = False

    queue.run = traced_run
    seen: dict[str, set] = {}
    for name, param in trainer.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, n=name: seen.setdefault(n, set()).add("Wg" if inside[0] else "B"))
    launches = []
    bucket_launch = type(trainer.state.dp_grads.buckets[0]).launch
    for bucket in trainer.state.dp_grads.buckets:
        bucket.launch = lambda group, b=bucket: (launches.append(inside[0]),
                                                 bucket_launch(b, group))
    trainer.train_step(0)
    return {"seen": seen, "launches": launches, "rank": trainer.state.grid.coords.pipeline}


def test_weight_gradients_wait_for_the_wg_pass(four_ranks):
    """GEMM, LayerNorm and embedding weights get their gradients only in Wg; the fused chains'
    biases and the position table in B; every data-parallel bucket that holds a deferred weight
    launches inside a Wg (after the B of the last micro-batch)."""
    for out in (rank["wg"] for rank in four_ranks):
        seen = out["seen"]
        for name, passes in seen.items():
            deferred = not name.endswith(("proj.bias", "fc1.bias", "fc2.bias", "position"))
            assert passes == ({"Wg"} if deferred else {"B"}), (out["rank"], name, passes)
        assert out["launches"] and all(out["launches"]), out["launches"]


RESUME = {"zb": ["parallel.pipeline=2", "parallel.tensor=2", "model.dropout=0.1", *ZB],
          "zb-sp": ["parallel.pipeline=2", "parallel.tensor=2", "model.dropout=0.1", *ZB, *SP],
          "zb0": ["parallel.pipeline=2", "parallel.tensor=2", *ZB, *SP],
          "targets": {"1f1b": ["parallel.pipeline=2", "parallel.tensor=2"]},   # loaded into only
          "reshard": [("zb0", "1f1b")]}


def _four_rank_job(root: str, runs: dict) -> dict:
    """The resumes, then where the weights get their gradients: one spawn of 4 ranks."""
    return {"resume": resume_job(root, runs), "wg": _where_weights_get_gradients()}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("zb-checkpoints")
    return run_on_ranks(4, _four_rank_job, str(root), RESUME, timeout_s=within(500))


@pytest.fixture(scope="module")
def resumed(four_ranks):
    return four_ranks[0]["resume"]


@pytest.mark.parametrize("name", ["zb", "zb-sp", "zb0"])
def test_zero_bubble_resumes_exactly(resumed, name):
    assert resumed[f"{name} resumed"] == resumed[f"{name} straight"][2:]
    for key, value in resumed[f"{name} straight weights"].items():
        assert torch.equal(resumed[f"{name} resumed weights"][key], value), key


def test_a_zero_bubble_checkpoint_continues_under_1f1b(resumed):
    got, want = resumed["zb0 -> 1f1b"], resumed["zb0 straight"][2:]
    assert all(abs(x - y) <= RTOL * abs(y) for x, y in zip(got, want))
    for key, value in resumed["zb0 straight weights"].items():
        assert relative_error(resumed["zb0 -> 1f1b weights"][key], value) <= RTOL, key


@functools.lru_cache(maxsize=None)
def _recomputed() -> dict:
    from tests.equivalence import run_layouts
    modes = ("full", "selective")
    runs = [["parallel.pipeline=2", *ZB, f"train.recompute={mode}"] for mode in modes]
    return dict(zip(modes, run_layouts(2, runs, timeout_s=within(300))))   # one spawned job


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_zero_bubble_with_recomputation_matches_single_process(recompute):
    """The re-run forward happens inside B; its weight gradients still wait for Wg."""
    for rank in _recomputed()[recompute]:
        assert_equivalent(rank, reference("gpt"), f"zb-h1 recompute={recompute}")
