"""The (p, t, d) rank grid: t varies fastest, then d, then p; groups derived from that."""

import pytest

from ptdp.runtime.local_ranks import run_on_ranks
from ptdp.parallel.grid import Coordinates, RankGrid, coordinates_of


def test_coordinates_t_fastest_then_d_then_p():
    p, d, t = 2, 3, 4
    coords = [coordinates_of(r, p, d, t) for r in range(p * d * t)]
    assert coords[:5] == [Coordinates(0, 0, 0), Coordinates(0, 0, 1), Coordinates(0, 0, 2),
                          Coordinates(0, 0, 3), Coordinates(0, 1, 0)]
    assert coords[12] == Coordinates(1, 0, 0)
    assert len(set(coords)) == p * d * t


def grid_groups(p, t, d):
    grid = RankGrid(p, t, d, timeout_s=30)
    return {"coords": grid.coords, "tensor": grid.tensor_ranks, "data": grid.data_ranks,
            "pipeline": grid.pipeline_ranks, "model": grid.model_ranks,
            "embedding": grid.embedding_ranks}


@pytest.fixture(scope="module")
def grid_2_2_2():
    return run_on_ranks(8, grid_groups, 2, 2, 2, timeout_s=120)


def test_groups_for_p2_t2_d2(grid_2_2_2):
    rank5 = grid_2_2_2[5]  # p=1, d=0, t=1
    assert rank5["coords"] == Coordinates(pipeline=1, data=0, tensor=1)
    assert rank5["tensor"] == [4, 5]            # adjacent ranks: one node on a cluster
    assert rank5["data"] == [5, 7]
    assert rank5["pipeline"] == [1, 5]
    assert rank5["model"] == [0, 1, 4, 5]       # all (p, t) of data replica 0
    assert rank5["embedding"] == [1, 5]         # first and last stage, same (d, t)


def test_every_rank_in_exactly_one_group_of_each_kind(grid_2_2_2):
    for kind, size in (("tensor", 2), ("data", 2), ("pipeline", 2), ("model", 4)):
        groups = {tuple(r[kind]) for r in grid_2_2_2}
        members = sorted(x for g in groups for x in g)
        assert members == list(range(8)), kind
        assert all(len(g) == size for g in groups), kind
        for rank, r in enumerate(grid_2_2_2):
            assert rank in r[kind], (kind, rank)
