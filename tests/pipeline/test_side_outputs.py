"""Side outputs through the pipeline: aux losses from any stage, two tensors per boundary.

A test-only chunk family (tests/pipeline/side_chunks.py: every stage adds an aux loss, every
boundary carries two tensors of different shapes) trained by the executor under GPipe, 1F1B,
interleaved (v = 2) and zb-h1 at p = 2, and 1F1B and interleaved at p = 4, with the plain and
the in-order (NCCL-rules) transport, equals one process: the losses, the aux losses (averaged
over micro-batches, summed over the stages that produce them) and the final weights, to fp32
round-off. The plans with several tensors per boundary hold under NCCL's rules for every
flushing schedule; the contract's errors name the stage.
"""

import functools

import pytest
import torch

from ptdp.config import load_config
from ptdp.config.catalogue import names_where
from ptdp.metrics.log import (MetricsLog, aux_loss_fields, aux_loss_text, interval_average,
                              read_metrics)
from ptdp.metrics.report import end_summary
from ptdp.parallel.stage_output import StageOutput
from ptdp.pipeline.comm_plan import PlanError, check_plans, plan_exchanges
from ptdp.pipeline.executor import PipelineExecutor
from ptdp.pipeline.p2p import P2P
from ptdp.pipeline.schedules import build_all
from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.pipeline.side_chunks import (AUX_NAMES, SideChunk, batch, boundary_shapes,
                                        train_pipelined, train_single)

RTOL = 1e-5
ITERS = 3
# (schedule, v, m) per pipeline size p
RUNS = {2: [("gpipe", 1, 4), ("1f1b", 1, 4), ("interleaved", 2, 4), ("zb-h1", 1, 4)],
        4: [("1f1b", 1, 4), ("interleaved", 2, 4)]}
CASES = [(p, *run, rules) for p in RUNS for run in RUNS[p] for rules in (False, True)]


@functools.lru_cache(maxsize=None)
def _pipelined(p: int, nccl_rules: bool) -> dict:
    per_rank = run_on_ranks(p, train_pipelined, RUNS[p], ITERS, nccl_rules, timeout_s=within(300))
    return {run: [per_rank[r][i] for r in range(p)] for i, run in enumerate(RUNS[p])}


@functools.lru_cache(maxsize=None)
def _single(num_stages: int, m: int) -> dict:
    return train_single(num_stages, m, ITERS)


def _close(x: float, y: float) -> bool:
    return abs(x - y) <= RTOL * max(abs(y), 1e-6)


@pytest.mark.parametrize("p,schedule,v,m,nccl_rules", CASES,
                         ids=[f"p{c[0]}-{c[1]}-v{c[2]}" + ("-nccl" if c[4] else "") for c in CASES])
def test_side_outputs_train_like_one_process(p, schedule, v, m, nccl_rules):
    ranks = _pipelined(p, nccl_rules)[(schedule, v, m)]
    want = _single(p * v, m)
    if nccl_rules:
        assert all(r["batches"] > 0 for r in ranks), "the in-order transport was not used"
    for rank in ranks:   # every rank reports the whole value
        for it in range(ITERS):
            assert _close(rank["losses"][it], want["losses"][it]), (it, rank["losses"], want)
            assert rank["aux"][it].keys() == set(AUX_NAMES)
            for name in AUX_NAMES:
                assert want["aux"][it][name] > 0
                assert _close(rank["aux"][it][name], want["aux"][it][name]), (it, name)
    weights = {k: v for rank in ranks for k, v in rank["weights"].items()}
    assert weights.keys() == want["weights"].keys()
    for name, expected in want["weights"].items():
        err = ((weights[name] - expected).norm() / expected.norm()).item()
        assert err <= RTOL, (name, err)


def test_aux_losses_change_the_gradients():
    """The oracle has teeth: without the aux losses the weights after one step differ."""
    with_aux = _single(2, 4)["weights"]
    plain = train_single(2, 4, ITERS, with_aux=False)["weights"]
    assert any(not torch.allclose(with_aux[k], plain[k], rtol=1e-4) for k in with_aux)


FLUSHING = names_where(lambda spec: spec.flushing)


@pytest.mark.parametrize("name", FLUSHING)
def test_two_tensor_boundaries_plan_safely_under_nccl_rules(name):
    shapes = {0: (16, 2, 32), 1: (16, 2, 4)}
    for p in range(2, 7):
        for v in ([1] if name in ("1f1b", "zb-h1") else [1, 2]):
            for m in (p, 2 * p):
                plans = plan_exchanges(build_all(name, p, v, m), p, v,
                                       lambda msg: shapes[msg.index], lambda boundary: 2)
                check_plans(plans)
                sent = [t.message for steps in plans for s in steps for t in s.exchange if t.send]
                # every boundary crosses ranks (p > 1): 2 tensors each way per micro-batch
                assert len(sent) == 2 * 2 * m * (p * v - 1)
                assert {msg.index for msg in sent} == {0, 1}


def test_the_checker_catches_sides_that_disagree_on_a_boundary():
    schedule = build_all("1f1b", 2, 1, 2)
    two = plan_exchanges(schedule, 2, 1, tensors=lambda boundary: 2)
    one = plan_exchanges(schedule, 2, 1)
    with pytest.raises(PlanError, match=r"(act|grad)#1 mb0"):
        check_plans([two[0], one[1]])


def _one_stage_executor(chunk, names=AUX_NAMES) -> PipelineExecutor:
    return PipelineExecutor({0: chunk}, 1, P2P([0]), boundary_shapes=boundary_shapes,
                            activation_dtype=torch.float32, device=torch.device("cpu"),
                            aux_loss_names=names)


def _steps(m: int = 2) -> list:
    return plan_exchanges(build_all("1f1b", 1, 1, m), 1, 1)[0]


def test_one_stage_reports_its_aux_losses_per_name():
    result = _one_stage_executor(SideChunk(0, 1)).run(_steps(), lambda mb: batch(0, mb), 0.5)
    chunk = SideChunk(0, 1)
    expected = sum(chunk(None, batch(0, mb)).aux_losses["head_l2"].item() for mb in range(2))
    assert result.aux_losses["act_l2"].item() == 0.0
    assert abs(result.aux_losses["head_l2"].item() - expected) <= 1e-6 * expected


def test_an_undeclared_aux_loss_names_the_stage():
    with pytest.raises(ValueError, match=r"stage 0 returned aux losses \['head_l2'\] that are "
                                         r"not declared"):
        _one_stage_executor(SideChunk(0, 1), names=("act_l2",)).run(
            _steps(), lambda mb: batch(0, mb), 0.5)


def test_a_wrong_number_of_boundary_tensors_names_the_stage():
    class OneTensor(torch.nn.Module):
        def forward(self, inputs, batch):
            return StageOutput(batch["x"])
    executor = PipelineExecutor({0: OneTensor()}, 2, P2P([0, 1]), boundary_shapes=boundary_shapes,
                                activation_dtype=torch.float32, device=torch.device("cpu"))
    steps = plan_exchanges(build_all("1f1b", 2, 1, 1), 2, 1, tensors=lambda b: 2)[0]
    forward = [s for s in steps if s.action is not None][:1]
    with pytest.raises(ValueError, match=r"stage 0 returned 1 boundary tensor\(s\); its "
                                         r"boundary carries 2"):
        executor.run(forward, lambda mb: batch(0, mb), 1.0)


def test_no_flush_streams_refuse_aux_losses():
    with pytest.raises(ValueError, match=r"auxiliary losses \['act_l2', 'head_l2'\] need a "
                                         r"flushing schedule"):
        _one_stage_executor(SideChunk(0, 1)).stream(lambda mb: batch(0, mb), 1.0,
                                                     rank_actions=lambda action, stream: None)


# ---------------------------------------------------------------------------- metrics


def _record(it: int, loss: float, skipped: bool = False, **aux) -> dict:
    return {"iter": it, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "step_time_s": 0.1,
            "tokens_per_s": 1280.0, "tflops_per_gpu": 0.04, "mfu": None, "loss_scale": 1.0,
            "skipped": skipped, "mem_gb": 0.1, **aux_loss_fields(aux)}


def test_aux_losses_are_record_fields_averaged_and_printed_after_the_loss(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    cfg = load_config(None, ["train.iters=3", "log.interval=3", f"log.metrics_file={path}"],
                      world_size=1)
    records = [_record(1, 4.0, act_l2=0.02), _record(2, 9.0, skipped=True, act_l2=0.5),
               _record(3, 2.0, act_l2=0.04)]
    assert "aux/act_l2" in records[0]
    assert interval_average(records)["aux/act_l2"] == pytest.approx(0.03)   # as the loss
    log = MetricsLog(cfg, is_writer=True)
    for r in records:
        log.log(r)
    log.close()
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("iter      3/3 | loss 3.0000 | aux act_l2 0.03 | lr 1.00e-03 | ")
    assert read_metrics(path) == records
    summary = end_summary(records, cfg, 1.0, torch.device("cpu"), None, None)
    assert "loss: final train 2.0000 | aux act_l2 0.04" in summary


def test_without_aux_losses_the_record_and_line_are_as_before():
    plain = _record(1, 4.0)
    assert aux_loss_fields({}) == {} and aux_loss_text(plain) == ""
    assert set(interval_average([plain])) == set(plain)
