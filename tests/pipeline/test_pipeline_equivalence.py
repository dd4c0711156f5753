"""Pipeline layouts (every schedule, interleaving, scatter/gather, recomputation) equal the
single-process run, and scatter/gather sends 1/t of the boundary bytes."""

import pytest

from ptdp.config.stages import StageMap
from tests.equivalence import ARCHS, ITERS, assert_equivalent, layout_result, reference

PIPELINE_LAYOUTS = ["p2-gpipe", "p2-1f1b", "p4-v2-interleaved", "p2-t2-v2-sg", "p2-t2-v2",
                    "p2-t2-recompute-full", "t2-d2-selective", "p2-t2-d2-1f1b"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", PIPELINE_LAYOUTS)
def test_pipeline_layouts_match_single_process(arch, layout):
    ranks = layout_result(layout, arch)
    assert_equivalent(ranks[0], reference(arch), f"{arch} {layout}")


def boundary_sends(pp_rank: int, p: int, v: int, m: int) -> int:
    """Messages a pipeline rank sends per iteration: activations forward, gradients back."""
    last = p * v - 1
    return m * sum((s < last) + (s > 0) for s in StageMap(p, v).stages_of(pp_rank))


@pytest.mark.parametrize("layout,t", [("p2-t2-v2-sg", 2), ("p2-t2-v2", 1)])
def test_scatter_gather_sends_one_tth_of_bsh(layout, t):
    """b*s*h/t fp32 values per message with scatter/gather (t=2), b*s*h without."""
    b, s, h, m, iters, p, v = 2, 16, 32, 4, ITERS, 2, 2
    for rank in layout_result(layout, "gpt"):
        pp_rank = rank["coords"].pipeline
        expected = iters * boundary_sends(pp_rank, p, v, m) * (b * s * h // t) * 4
        assert rank["bytes_sent"] == expected, (pp_rank, rank["bytes_sent"], expected)
