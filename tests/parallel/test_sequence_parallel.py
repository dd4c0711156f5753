"""Sequence parallelism (parallel.sequence_parallel=true) equals the single-process run.

Layouts (p, t, d) = (2, 2, 1), (1, 2, 2), (2, 2, 2), GPT and BERT, fp32, under the in-order
(NCCL-rules) transport; boundary tensors are 1/t of the sequence; with dropout on, the masks
are the ones the layout without sequence parallelism draws; checkpoints resume exactly and load
into layouts with and without it.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import ARCHS, ITERS, RTOL, assert_equivalent, reference, relative_error
from tests.features import LAYOUTS, SP, _trainer, feature_layout, resume_job
from tests.pipeline.test_pipeline_equivalence import boundary_sends


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda l: "p{}-t{}-d{}".format(*l))
def test_sequence_parallel_layouts_match_single_process(arch, layout):
    for rank in feature_layout(tuple(SP), layout, arch):
        assert_equivalent(rank, reference(arch), f"{arch} {layout} sequence-parallel")


def test_boundary_tensors_are_one_tth_of_the_sequence():
    """Each tensor rank sends its own [s/t, b, h] slice: b*s*h/t fp32 values per message."""
    b, s, h, m, iters, p, t = 2, 16, 32, 4, ITERS, 2, 2
    for rank in feature_layout(tuple(SP), (2, 2, 1), "gpt"):
        expected = iters * boundary_sends(rank["coords"].pipeline, p, 1, m) * (b * s * h // t) * 4
        assert rank["bytes_sent"] == expected


def _dropout_job() -> dict:
    """t = 2 with dropout 0.1, with and without sequence parallelism (and with recomputation)."""
    out = {}
    base = ["parallel.tensor=2", "model.dropout=0.1"]
    for name, extra in {"plain": [], "sp": SP, "sp-full": SP + ["train.recompute=full"],
                        "sp-selective": SP + ["train.recompute=selective"]}.items():
        trainer = _trainer(base + extra)
        step = trainer.step.forward_backward(0)
        trainer.step.reduce_gradients()
        out[name] = (float(step.resolve().loss), trainer.full_state(grads=True))
    return out if dist.get_rank() == 0 else {}


def test_dropout_masks_equal_those_without_sequence_parallelism():
    """Each rank drops its rows of the full tensor's mask (default generator, same draws)."""
    with ThreadPoolExecutor(2) as pool:   # both jobs at once: the single process uses one core
        dropout = pool.submit(run_on_ranks, 2, _dropout_job, timeout_s=within(240))
        single = pool.submit(run_on_ranks, 1, _single_loss, timeout_s=within(120))
    out = dropout.result()[0]
    ref_loss, ref_grads = out["plain"]
    for name in ("sp", "sp-full", "sp-selective"):
        loss, grads = out[name]
        assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (name, loss, ref_loss)
        for key, expected in ref_grads.items():
            assert relative_error(grads[key], expected) <= RTOL, (name, key)
    no_dropout = single.result()[0]
    assert abs(no_dropout - ref_loss) > 1e-4  # dropout really ran


def _single_loss() -> float:
    trainer = _trainer([])
    return float(trainer.step.forward_backward(0).resolve().loss)


RESUME = {"sp": ["parallel.pipeline=2", "parallel.tensor=2", "model.dropout=0.1", *SP],
          "sp0": ["parallel.pipeline=2", "parallel.tensor=2", *SP],
          "plain": ["parallel.pipeline=2", "parallel.tensor=2"],
          "reshard": [("sp0", "plain"), ("plain", "sp0")]}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp-checkpoints")
    return run_on_ranks(4, resume_job, str(root), RESUME, timeout_s=within(400))[0]


@pytest.mark.parametrize("name", ["sp", "sp0"])
def test_sequence_parallel_resumes_exactly(resumed, name):
    """Dropout on (sp): the RNG streams and data position resume too."""
    assert resumed[f"{name} resumed"] == resumed[f"{name} straight"][2:]
    for key, value in resumed[f"{name} straight weights"].items():
        assert relative_error(resumed[f"{name} resumed weights"][key], value) == 0.0, key


@pytest.mark.parametrize("source,target", RESUME["reshard"])
def test_checkpoints_load_with_and_without_sequence_parallelism(resumed, source, target):
    got, want = resumed[f"{source} -> {target}"], resumed[f"{source} straight"][2:]
    for x, y in zip(got, want):
        assert abs(x - y) <= RTOL * abs(y)
    for key, value in resumed[f"{source} straight weights"].items():
        assert relative_error(resumed[f"{source} -> {target} weights"][key], value) <= RTOL, key


def test_sharded_regions_keep_one_tth_of_the_activations():
    """tools/bench_sequence_parallel.py's measurement at a tiny shape: LayerNorm, dropout and
    residual regions (and the layer input) save exactly 1/t of the bytes per rank; the
    dropout mask less still, kept as bool (1 byte an element where F.dropout on CPU keeps the
    fp32 scaled mask: 4), plus its 0-d scale."""
    from tools.bench_sequence_parallel import SHARDED, measure
    shape = {"hidden": 32, "heads": 4, "seq": 16, "batch": 2}
    with ThreadPoolExecutor(2) as pool:   # both jobs at once
        jobs = [pool.submit(run_on_ranks, 2, measure, shape, flag, timeout_s=within(120))
                for flag in (False, True)]
    plain, sp = (job.result()[0] for job in jobs)
    for region in SHARDED:
        if region == "dropout+add":
            assert sp[region] == plain[region] // (2 * 4) + 8, (region, sp[region], plain[region])
            continue
        assert sp[region] * 2 == plain[region] > 0, (region, sp[region], plain[region])
    assert sp["attention"] == plain["attention"]   # the tensor-parallel regions are unchanged
