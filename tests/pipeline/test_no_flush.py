"""PipeDream-2BW and PipeDream async train by their stated update rules, on local gloo ranks.

Oracles (tests/pipeline/no_flush_oracles.py) are single-process simulations of the rules with
the same data order. 2BW: after k batches the weights equal W(t+1) = W(t) - lr*AdamW(clip(grad
f(W(t-1)))) within 1e-5 for (p, t, d, v) in (2,1,1,1), (2,2,1,1), (2,1,2,1), (2,1,1,2),
(2,2,2,1) and p = 1, GPT and BERT (Llama-style and the block options' model too at (2,2,1,1)). PipeDream: every backward uses its forward's version, by the
ids the executor logged, equal to the rule's (weight stashing: k-p+1+stage; vertical sync:
k-p+1 everywhere), and the weights equal the rule's simulation. Live versions are counted by the
executor's version store: 2 for 2BW on every rank, at most p for PipeDream.
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch.distributed as dist

from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import MODELS, TINY, relative_error
from tests.pipeline.no_flush_oracles import (oracle_overrides, pipedream_versions,
                                             simulate_pipedream, simulate_two_bw)

RTOL = 1e-5
ITERS = {"2bw": 4, "pipedream": 3}
TWO_BW = ["schedule.name=2bw"]
PIPEDREAM = ["schedule.name=pipedream", "train.clip_grad=0"]

# name -> (world size, overrides, archs)
RUNS = {
    "2bw-p1":          (1, TWO_BW, ("gpt", "bert")),
    "2bw-p2":          (2, TWO_BW + ["parallel.pipeline=2"], ("gpt", "bert")),
    "2bw-p2-v2":       (2, TWO_BW + ["parallel.pipeline=2", "parallel.chunks=2"], ("gpt", "bert")),
    "2bw-p2-t2":       (4, TWO_BW + ["parallel.pipeline=2", "parallel.tensor=2"],
                        ("gpt", "bert", "llama", "blocks")),   # blocks: QK-norm's tensor sum
    "2bw-p2-d2":       (4, TWO_BW + ["parallel.pipeline=2", "parallel.data=2"], ("gpt", "bert")),
    "2bw-p2-t2-d2":    (8, TWO_BW + ["parallel.pipeline=2", "parallel.tensor=2",
                                     "parallel.data=2"], ("gpt", "bert")),
    "2bw-p2-t2-sg-recompute": (4, TWO_BW + ["parallel.pipeline=2", "parallel.tensor=2",
                                            "parallel.scatter_gather=true",
                                            "train.recompute=full",
                                            "train.recompute_num_layers=2"], ("gpt",)),
    "2bw-p2-d2-selective": (4, TWO_BW + ["parallel.pipeline=2", "parallel.data=2",
                                         "train.recompute=selective"], ("bert",)),
    "2bw-p2-d2-bf16":  (4, TWO_BW + ["parallel.pipeline=2", "parallel.data=2",
                                     "train.precision=bf16"], ("gpt",)),
    "2bw-p2-fp16":     (2, TWO_BW + ["parallel.pipeline=2", "train.precision=fp16",
                                     "train.initial_loss_scale=4096"], ("gpt",)),
    "pd-p2":           (2, PIPEDREAM + ["parallel.pipeline=2"], ("gpt", "bert", "llama")),
    "pd-p2-vs":        (2, PIPEDREAM + ["parallel.pipeline=2", "schedule.vertical_sync=true"],
                        ("gpt", "bert")),
    "pd-p2-bf16":      (2, PIPEDREAM + ["parallel.pipeline=2", "train.precision=bf16"], ("gpt",)),
    "pd-p4":           (4, PIPEDREAM + ["parallel.pipeline=4"], ("gpt",)),
    "pd-p4-vs":        (4, PIPEDREAM + ["parallel.pipeline=4", "schedule.vertical_sync=true"],
                        ("gpt",)),
    "pd-p2-d2-t2-vs":  (8, PIPEDREAM + ["parallel.pipeline=2", "parallel.data=2",
                                        "parallel.tensor=2", "schedule.vertical_sync=true"],
                        ("gpt",)),
}
EXACT_2BW = ["2bw-p1", "2bw-p2", "2bw-p2-t2", "2bw-p2-d2", "2bw-p2-v2", "2bw-p2-t2-d2",
             "2bw-p2-t2-sg-recompute", "2bw-p2-d2-selective"]


def _overrides(name: str, arch: str) -> list[str]:
    return [*MODELS[arch], *RUNS[name][1]]


def train_runs(runs: list[list[str]]) -> list[dict]:
    """Runs on every rank: each override list for its schedule's ITERS, what the tests need."""
    from ptdp.config import load_config
    from ptdp.parallel.roles import role_of
    from ptdp.training import Trainer
    out = []
    for overrides in runs:
        name = next(o.split("=")[1] for o in overrides if o.startswith("schedule.name="))
        iters = ITERS[name]
        cfg = load_config(None, TINY + overrides + [f"train.iters={iters}"],
                          world_size=dist.get_world_size())
        trainer = Trainer(cfg)
        steps, outstanding = [], []
        for it in range(iters):
            steps.append(trainer.train_step(it))
            p2p = trainer.pipeline.executor.p2p     # sends still held after each iteration
            outstanding.append(len(p2p.pending_sends) + len(getattr(p2p, "previous_sends", [])))
        out.append({"losses": [s.loss for s in steps], "grad_norms": [s.grad_norm for s in steps],
                    "weights": trainer.full_state(), "log": trainer.step.versions.log,
                    "peaks": [g.peak for g in trainer.step.versions.groups],
                    "outstanding_sends": outstanding,
                    "coords": trainer.state.grid.coords, "m": trainer.state.m,
                    "stage_of": {n: trainer.state.grid.pp_rank
                                 for n, p in trainer.named_parameters() if not role_of(p).duplicate}})
    return out


@functools.lru_cache(maxsize=None)
def _world(world: int) -> dict:
    keys = [(name, arch) for name, (w, _, archs) in RUNS.items() if w == world for arch in archs]
    per_rank = run_on_ranks(world, train_runs, [_overrides(*k) for k in keys],
                            timeout_s=within(280))
    return {k: [per_rank[r][i] for r in range(world)] for i, k in enumerate(keys)}


def result(name: str, arch: str) -> list[dict]:
    return _world(RUNS[name][0])[(name, arch)]


def oracle_runs(jobs: list[tuple]) -> list[dict]:
    out = []
    for kind, overrides, args in jobs:
        fn = simulate_two_bw if kind == "2bw" else simulate_pipedream
        out.append(fn(overrides, *args))
    return out


def _oracle_job(name: str, arch: str) -> tuple:
    """The simulation run (name, arch) is held to: (kind, overrides, arguments); fp32, the
    oracle of the bf16/fp16 runs too."""
    fp32 = oracle_overrides([o for o in _overrides(name, arch)
                             if not o.startswith("train.precision")])
    if name.startswith("2bw"):
        return ("2bw", fp32, (ITERS["2bw"],))
    stage_of = {}
    for rank in result(name, arch):
        stage_of.update(rank["stage_of"])
    p = 1 + max(stage_of.values())
    d = 1 + max(r["coords"].data for r in result(name, arch))
    return ("pipedream", fp32, (ITERS["pipedream"], p, d, stage_of,
                                "schedule.vertical_sync=true" in RUNS[name][1]))


@functools.lru_cache(maxsize=None)
def _oracles() -> dict:
    """Every distinct oracle once, in one single-process job. A rule reads the model and the
    optimizer settings, not the layout (oracle_overrides), so e.g. every fp32 2BW run of GPT
    shares one simulation: 13 for the 27 runs."""
    wanted = {(name, arch): _oracle_job(name, arch)
              for name, (_, _, archs) in RUNS.items() for arch in archs}
    distinct = list({repr(job): job for job in wanted.values()}.values())
    simulated = run_on_ranks(1, oracle_runs, distinct, timeout_s=within(280))[0]
    by_job = dict(zip(map(repr, distinct), simulated))
    return {key: by_job[repr(job)] for key, job in wanted.items()}


def assert_matches(got: dict, want: dict, what: str, rtol: float = RTOL) -> None:
    for i, (x, y) in enumerate(zip(got["losses"], want["losses"])):
        assert abs(x - y) <= rtol * abs(y), f"{what}: loss {i} is {x}, the rule gives {y}"
    assert got["weights"].keys() == want["weights"].keys()
    for key, expected in want["weights"].items():
        err = relative_error(got["weights"][key], expected)
        assert err <= rtol, f"{what}: {key} differs from the rule by {err:.2e}"


# ---------------------------------------------------------------------------- 2BW


@pytest.mark.parametrize("name,arch", [(n, a) for n in EXACT_2BW for a in RUNS[n][2]])
def test_two_bw_weights_follow_the_delay_one_rule(name, arch):
    ranks, want = result(name, arch), _oracles()[(name, arch)]
    assert_matches(ranks[0], want, f"{arch} {name}")
    for rank in ranks:     # every rank reports the same loss and norm
        assert rank["losses"] == ranks[0]["losses"]
        for x, y in zip(rank["grad_norms"], want["grad_norms"]):
            assert abs(x - y) <= RTOL * y


@pytest.mark.parametrize("name", ["2bw-p1", "2bw-p2", "2bw-p2-v2", "2bw-p2-t2-d2"])
def test_two_bw_micro_batch_k_uses_version_max_of_k_over_m_minus_1_and_0(name):
    """From the executor's log: forward and backward of micro-batch k run with version
    max(k // m - 1, 0), and no rank ever holds more than two versions."""
    for rank in result(name, "gpt"):
        m = rank["m"]
        assert rank["peaks"] == [2]
        seen = {}
        for kind, mb, stage, (version,) in rank["log"]:
            assert version == max(mb // m - 1, 0), (kind, mb, stage, version)
            seen.setdefault((mb, stage), []).append((kind, version))
        assert all([k for k, _ in v] == ["F", "B"] and v[0][1] == v[1][1] for v in seen.values())
        assert len(seen) == ITERS["2bw"] * m * len({s for (_, s) in seen})


@pytest.mark.parametrize("name", ["2bw-p2", "2bw-p2-v2", "pd-p4"])
def test_sends_held_across_iterations_do_not_accumulate(name):
    """A no-flush run retires each iteration's sends by the end of the next one: the sends
    (and the activations they keep alive) still held stay at one iteration's worth instead
    of growing every iteration (gloo reports a send completed only once it was waited for)."""
    for rank in result(name, "gpt"):
        held = rank["outstanding_sends"]
        assert max(held[1:]) == held[1] and held[-1] <= held[1], f"sends held per iteration: {held}"


def test_mixed_precision_stays_close_to_the_fp32_rule():
    """2BW in bf16 (fp32 masters, d=2 reduction) and fp16 (per-batch loss scale), PipeDream in
    bf16: not exact, close."""
    for name, tol in (("2bw-p2-d2-bf16", 0.02), ("2bw-p2-fp16", 0.01), ("pd-p2-bf16", 0.02)):
        got, want = result(name, "gpt")[0], _oracles()[(name, "gpt")]
        for x, y in zip(got["losses"], want["losses"]):
            assert abs(x - y) <= tol * y, (name, got["losses"], want["losses"])
        assert all(peak == 2 for peak in result(name, "gpt")[0]["peaks"])


# ---------------------------------------------------------------------------- PipeDream


@pytest.mark.parametrize("name,arch", [("pd-p2", "gpt"), ("pd-p2", "bert"), ("pd-p2", "llama"),
                                       ("pd-p4", "gpt"),
                                       ("pd-p2-vs", "gpt"), ("pd-p2-vs", "bert"),
                                       ("pd-p4-vs", "gpt"), ("pd-p2-d2-t2-vs", "gpt")])
def test_pipedream_weights_follow_the_stashing_or_vertical_sync_rule(name, arch):
    assert_matches(result(name, arch)[0], _oracles()[(name, arch)], f"{arch} {name}")


@pytest.mark.parametrize("name", ["pd-p2", "pd-p4", "pd-p2-vs", "pd-p4-vs", "pd-p2-d2-t2-vs"])
def test_pipedream_backward_uses_its_forwards_stashed_version(name):
    """Version ids from the executor's log: each backward has its forward's; the forward's is
    the rule's (stage's own weights), and the last stage's tied embedding copy always has the
    version rank 0 used for the same input."""
    vertical = name.endswith("-vs")
    ranks = result(name, "gpt")
    p = 1 + max(r["coords"].pipeline for r in ranks)
    for rank in ranks:
        stage = rank["coords"].pipeline
        forwards = {}
        for kind, mb, s, ids in rank["log"]:
            if kind == "F":
                assert ids[0] == pipedream_versions(mb, p, stage, vertical), (kind, mb, s, ids)
                if len(ids) > 1:
                    assert ids[1] == pipedream_versions(mb, p, 0, vertical)
                forwards[mb] = ids
            else:
                assert ids == forwards.pop(mb), (mb, s, ids)
        assert not forwards


@pytest.mark.parametrize("name", ["pd-p2", "pd-p4", "pd-p2-vs", "pd-p4-vs"])
def test_pipedream_live_versions_stay_within_p(name):
    """Counted by the version store: weight stashing keeps one per in-flight input, max(p - r,
    2) on stage r (the newest and the one being made at least); vertical sync keeps the
    versions from the oldest in-flight tag to the newest, p on every stage. The source's bound
    is p (Table 7.1: PipeDream (p, p))."""
    ranks = result(name, "gpt")
    p = 1 + max(r["coords"].pipeline for r in ranks)
    for rank in ranks:
        stage = rank["coords"].pipeline
        own = p if name.endswith("-vs") else max(p - stage, 2)
        assert rank["peaks"][0] == own <= p
        if stage == p - 1:
            assert rank["peaks"][1] == 2            # the tied copy: newest and the next


# ---------------------------------------------------------------------------- resume


def _resume_job(directory: str, overrides: list[str]):
    from ptdp.config import load_config
    from ptdp.training import Trainer
    base = TINY + overrides + ["train.iters=6", f"checkpoint.dir={directory}",
                               "checkpoint.save_interval=3", "log.progress=false"]
    world = dist.get_world_size()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        whole = Trainer(load_config(None, base, world_size=world)).train()
        resumed = Trainer(load_config(None, base + [f"checkpoint.load={directory}/iter_0000003",
                                                    f"checkpoint.dir={directory}/again"],
                                      world_size=world))
        shadow = sorted(resumed.step.versions.groups[0].buffers)
        again = resumed.train()
    return [r["loss"] for r in whole], [r["loss"] for r in again], shadow


def test_two_bw_resumes_with_both_versions_and_the_exact_loss_sequence(tmp_path):
    """Saved after 3 iterations: W(3) and the shadow W(2), which batch 3 still runs with."""
    whole, again, versions = run_on_ranks(2, _resume_job, str(tmp_path),
                                          TWO_BW + ["parallel.pipeline=2"],
                                          timeout_s=within(200))[0]
    assert versions == [2, 3]
    assert again == whole[3:]
