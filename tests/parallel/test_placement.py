"""Placement on nodes: with t ranks adjacent, tensor groups stay inside a node and pipeline
stages cross nodes; when t does not divide the ranks per node, `ptdp check` and `ptdp train`
warn (one line, naming a straddling group; `ptdp train`'s, from a real two-node launch, is in
tests/test_multinode.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

from ptdp.checks import check_job
from ptdp.parallel.grid import group_rows
from ptdp.parallel.placement import groups_across_nodes, nodes_of, placement_warnings

ROOT = Path(__file__).resolve().parents[2]


def test_two_nodes_by_four_ranks_keep_tensor_groups_in_a_node_and_cross_with_the_pipeline():
    rows = group_rows(p=2, d=2, t=2)
    assert [nodes_of(g, 4) for g in rows["tensor"]] == [[0], [0], [1], [1]]
    assert [nodes_of(g, 4) for g in rows["data"]] == [[0], [0], [1], [1]]
    assert rows["pipeline"] == [[0, 4], [1, 5], [2, 6], [3, 7]]   # stage s on node s
    assert groups_across_nodes(2, 2, 2, 4) == {"tensor": [], "data": [],
                                               "pipeline": rows["pipeline"]}
    assert placement_warnings(2, 2, 2, 1, 4) == []


@pytest.mark.parametrize("ranks_per_node", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("p,t,d", [(2, 2, 2), (1, 4, 6), (3, 6, 1), (2, 8, 3), (4, 1, 6)])
def test_tensor_groups_stay_in_a_node_exactly_when_t_divides_the_node(p, t, d, ranks_per_node):
    world = p * t * d
    if world % ranks_per_node:
        pytest.skip("torchrun needs whole nodes")
    crossing = groups_across_nodes(p, t, d, ranks_per_node)
    multi_node = world > ranks_per_node
    straddles = multi_node and ranks_per_node % t != 0
    assert bool(crossing["tensor"]) == straddles
    assert bool(placement_warnings(p, t, d, 1, ranks_per_node)) == straddles
    if multi_node and ranks_per_node % (t * d) == 0 and p > 1:   # a stage per node or less
        assert not crossing["data"] and crossing["pipeline"]


def test_t6_on_8_rank_nodes_warns_naming_a_group():
    [line] = placement_warnings(1, 6, 8, 1, 8)
    assert line.startswith("parallel.tensor=6 does not divide the 8 ranks per node: 4 of 8 "
                           "tensor groups span nodes (e.g. ranks 6..11 on nodes 0..1)")
    assert "parallel.tensor=4" in line


def test_ptdp_check_warns_with_the_node_size_and_still_passes():
    found = check_job(str(ROOT / "configs/gpt_tiny.yaml"), ["parallel.tensor=4"], 4,
                      ranks_per_node=2)
    assert not found.errors and len(found.warnings) == 1
    assert found.warnings[0].startswith("parallel.tensor=4 does not divide the 2 ranks per node")
    assert check_job(str(ROOT / "configs/gpt_tiny.yaml"), ["parallel.tensor=2"], 4,
                     ranks_per_node=2).warnings == []
    res = subprocess.run([sys.executable, "-m", "ptdp", "check", "configs/gpt_tiny.yaml",
                          "parallel.tensor=4", "--world-size", "4", "--nproc-per-node", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    assert "  warning: parallel.tensor=4 does not divide the 2 ranks per node" in res.stdout


def test_context_ranks_count_in_the_placement():
    """(p, t, c, d) = (1, 3, 2, 1) on 4 ranks per node: the second tensor group (ranks 3..5)
    spans nodes 0 and 1; without c in the count the job would look like 3 ranks on one node."""
    [line] = placement_warnings(1, 3, 1, 2, 4)
    assert "1 of 2 tensor groups span nodes (e.g. ranks 3..5 on nodes 0..1)" in line
