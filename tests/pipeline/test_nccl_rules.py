"""The pipeline exchange under NCCL's point-to-point rules, imposed on gloo.

`tests/pipeline/nccl_rules.py` ignores tags (matching by order only, with a header check on
every message) and completes each rank's batches strictly in issue order without buffering.
Under it every pipelined layout of the equivalence tests must still train exactly like one
process; the no-flush schedules (2BW interleaved with scatter/gather, PipeDream with vertical
sync and d = 2) must train exactly as with the plain exchange, with validation and a checkpoint
(collectives on every rank) at every iteration boundary; and the naive exchange (receive right before use),
which the plan checker rejects, must really hang under it, so the transport is known to have
teeth.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ptdp.runtime.local_ranks import RankFailure, run_on_ranks
from ptdp.pipeline.comm_plan import PlanError, Step, Transfer, check_plans, needed_message, produced_message
from ptdp.pipeline.schedules import build_all
from ptdp.config.catalogue import schedule_spec
from tests.deadline import within
from tests.equivalence import LAYOUTS, TINY, assert_equivalent, reference, run_layouts

# every layout of the equivalence tests with p > 1; GPT in all, BERT in the richest one
PIPELINED = {name: spec for name, spec in LAYOUTS.items()
             if any(o.startswith("parallel.pipeline=") and o != "parallel.pipeline=1"
                    for o in spec[1])}
CASES = [(name, "gpt") for name in sorted(PIPELINED)] + [("p2-t2-v2-sg", "bert")]


def _strict_world(world: int) -> dict:
    cases = [c for c in CASES if PIPELINED[c[0]][0] == world]
    runs = [[f"model.arch={arch}", *PIPELINED[name][1]] for name, arch in cases]
    return dict(zip(cases, run_layouts(world, runs, nccl_rules=True)))


@pytest.fixture(scope="module")
def strict_results():
    """{(layout, arch): per-rank results}, one spawned job per world size, all started
    together (one job alone leaves cores idle: its ranks wait on exchanges and start-up)."""
    worlds = sorted({PIPELINED[name][0] for name, _ in CASES})
    with ThreadPoolExecutor(len(worlds)) as pool:
        jobs = [pool.submit(_strict_world, world) for world in worlds]
    return {case: ranks for job in jobs for case, ranks in job.result().items()}


def test_every_pipelined_layout_is_covered():
    assert {"p2-gpipe", "p2-1f1b", "p4-v2-interleaved", "p2-t2-v2-sg",
            "p2-t2-d2-1f1b"} <= set(PIPELINED)


@pytest.mark.parametrize("layout,arch", CASES)
def test_pipelined_layouts_match_single_process_under_nccl_rules(strict_results, layout, arch):
    ranks = strict_results[(layout, arch)]
    assert all(r["batches"] > 0 for r in ranks), "the in-order transport was not used"
    assert_equivalent(ranks[0], reference(arch), f"{arch} {layout} under NCCL rules")


def test_sent_outputs_are_freed_until_their_backward(strict_results):
    """Megatron's deallocate_output_tensor: once sent (complete at once under the in-order
    transport, as NCCL reports it), a stage output keeps only its autograd graph. Rank 0 of
    GPipe holds all m = 4 outputs before its first backward: one element each instead of
    [s, b, h] = [16, 2, 32] fp32 (4096 bytes), and every loss, gradient and weight is the
    single process's (above)."""
    ranks = strict_results[("p2-gpipe", "gpt")]
    assert ranks[0]["held_per_mb"] == 4, ranks[0]["held_per_mb"]
    for name, arch in CASES:   # every other pipelined layout frees them too
        first = strict_results[(name, arch)][0]
        assert first["held_per_mb"] <= 8, (name, arch, first["held_per_mb"])


NO_FLUSH_UNDER_RULES = [
    ["schedule.name=2bw", "parallel.pipeline=2", "parallel.tensor=2", "parallel.chunks=2",
     "parallel.scatter_gather=true"],
    ["schedule.name=pipedream", "parallel.pipeline=2", "parallel.data=2", "train.clip_grad=0",
     "schedule.vertical_sync=true"],
]


def _no_flush_both_ways(directory: str) -> list:
    import contextlib
    import os

    import torch.distributed as dist

    from ptdp.config import load_config
    from ptdp.training import Trainer
    from tests.pipeline.nccl_rules import InOrderTransport

    out = []
    for i, overrides in enumerate(NO_FLUSH_UNDER_RULES):
        runs = []
        for strict in (True, False):
            # validation (exchanges on the same group) and checkpoints (collectives) between
            # every two iterations of the strict run
            extra = ([f"checkpoint.dir={directory}/{i}", "checkpoint.save_interval=1",
                      "train.eval_interval=1", "train.eval_iters=1"] if strict else [])
            cfg = load_config(None, TINY + overrides + extra + ["train.iters=4", "log.progress=false"],
                              world_size=dist.get_world_size())
            trainer = Trainer(cfg)
            if strict:
                trainer.pipeline.p2p.transport = InOrderTransport(trainer.state.grid.group("pipeline"))
            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
                history = trainer.train()
            runs.append(([r["loss"] for r in history], trainer.full_state(),
                         getattr(trainer.pipeline.p2p.transport, "batches", None)))
        out.append(runs)
    return out


def test_no_flush_schedules_train_the_same_under_nccl_rules_with_checkpoints(tmp_path):
    for (strict, plain) in run_on_ranks(4, _no_flush_both_ways, str(tmp_path),
                                        timeout_s=within(240))[0]:
        assert strict[2] > 0, "the in-order transport was not used"
        assert strict[0] == plain[0]
        for name, value in plain[1].items():
            assert torch.equal(strict[1][name], value), name


def naive_plans(name: str, p: int, v: int, m: int) -> list[list[Step]]:
    """Receive each tensor right before the action that needs it, send right after."""
    plans, last = [], p * v
    rank_of = schedule_spec(name).stage_map(p, v).rank_of
    for rank, actions in enumerate(build_all(name, p, v, m)):
        steps, previous = [], None
        for action in actions + [None]:
            ops = []
            sent = previous and produced_message(previous, last)
            if sent:
                ops.append(Transfer(True, rank_of(sent.dst), sent, (16, 2, 32)))
            needed = action and needed_message(action, last)
            if needed:
                ops.append(Transfer(False, rank_of(needed.src), needed, (16, 2, 32)))
            steps.append(Step(tuple(ops), action))
            previous = action
        plans.append(steps)
    return plans


def _train_with_naive_plan(overrides):
    import torch.distributed as dist

    from ptdp.config import load_config
    from ptdp.training import Trainer
    from tests.pipeline.nccl_rules import InOrderTransport

    cfg = load_config(None, TINY + overrides, world_size=dist.get_world_size())
    trainer = Trainer(cfg)
    # (the exchange below cannot complete: the timeout only bounds how long it is waited for)
    trainer.pipeline.p2p.transport = InOrderTransport(trainer.state.grid.group("pipeline"), timeout_s=1)
    trainer.step.plans[trainer.state.m] = naive_plans("interleaved", 2, 2, cfg.num_micro_batches)[
        trainer.state.grid.pp_rank]
    return trainer.train_step(0).loss


def test_naive_exchange_deadlocks_in_the_checker_and_under_the_transport():
    with pytest.raises(PlanError, match="deadlock"):
        check_plans(naive_plans("interleaved", 2, 2, 4))
    overrides = ["parallel.pipeline=2", "parallel.chunks=2", "schedule.name=interleaved"]
    with pytest.raises(RankFailure, match="in-order transport timed out"):
        run_on_ranks(2, _train_with_naive_plan, overrides, timeout_s=60)
