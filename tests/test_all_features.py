"""Sequence parallelism, the zero-bubble schedule and the distributed optimizer all at once
equal the single-process run, and such a run resumes exactly and continues without them.

Each feature has its own tests (tests/parallel/test_sequence_parallel.py,
tests/pipeline/test_zero_bubble.py, tests/optim/test_distributed_optimizer.py); this file checks
that they compose: the sequence-parallel gradient sums run on the optimizer's shard pieces, the
weight-gradient passes fill the shards' buckets before the reduce-scatter, and the boundary
tensors stay 1/t. The distributed optimizer needs d > 1, hence the layouts (1, 2, 2) and (2, 2, 2).
"""

import pytest
import torch

from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import ARCHS, MODELS, RTOL, assert_equivalent, reference, relative_error
from tests.features import LAYOUTS, SP, ZB, feature_layout, resume_job

ALL = (*SP, *ZB, "train.distributed_optimizer=true")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 2, 2)], ids=lambda l: "p{}-t{}-d{}".format(*l))
def test_all_three_together_match_single_process(arch, layout):
    for rank in feature_layout(ALL, layout, arch):
        assert_equivalent(rank, reference(arch), f"{arch} {layout} sp+zb-h1+distopt")


LLAMA = MODELS["llama"]
RESUME = {"all": [*LAYOUTS[(1, 2, 2)], "model.dropout=0.1", *ALL],
          "targets": {"plain": [*LAYOUTS[(1, 2, 2)], "model.dropout=0.1"]},   # loaded into only
          # the Llama-style decoder resharded from (1, 2, 2) with everything to a pipeline
          "llama all": [*LLAMA, *LAYOUTS[(1, 2, 2)], *ALL],
          "llama pipeline": [*LLAMA, *LAYOUTS[(2, 2, 1)]],
          "reshard": [("all", "plain"), ("llama all", "llama pipeline")]}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("all-features")
    return run_on_ranks(4, resume_job, str(root), RESUME, timeout_s=within(500))[0]


@pytest.mark.parametrize("name", ["all", "llama all", "llama pipeline"])
def test_all_three_resume_exactly(resumed, name):
    assert resumed[f"{name} resumed"] == resumed[f"{name} straight"][2:]
    for key, value in resumed[f"{name} straight weights"].items():
        assert torch.equal(resumed[f"{name} resumed weights"][key], value), key


@pytest.mark.parametrize("source,target", RESUME["reshard"])
def test_their_checkpoint_continues_without_them(resumed, source, target):
    """Same masks (sequence-parallel dropout draws the full tensor's), same update: the plain
    layout resumed from the all-features checkpoint continues the same losses; so does a
    Llama-style decoder moved from (1, 2, 2) to (2, 2, 1) (grouped-query QKV rows resharded)."""
    got, want = resumed[f"{source} -> {target}"], resumed[f"{source} straight"][2:]
    assert all(abs(x - y) <= RTOL * abs(y) for x, y in zip(got, want)), (got, want)
    for key, value in resumed[f"{source} straight weights"].items():
        assert relative_error(resumed[f"{source} -> {target} weights"][key], value) <= RTOL, key
