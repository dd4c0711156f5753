"""The rank grid: named axes (pipeline, data, context, tensor; tensor fastest), groups asked by
axis names, and the embedding group beside them."""

import itertools

import pytest
import torch

from ptdp.runtime.local_ranks import run_on_ranks
from ptdp.parallel.grid import (Coordinates, RankGrid, axis_rows, coordinates_of,
                                embedding_rows, grid_layout, group_rows)
from tests.deadline import within

SHAPES = [(p, d, c, t) for p, d, c, t in itertools.product((1, 2, 3), (1, 2, 3), (1, 2), (1, 2, 4))]


def test_coordinates_t_fastest_then_d_then_p():
    p, d, t = 2, 3, 4
    coords = [coordinates_of(r, p, d, t) for r in range(p * d * t)]
    assert coords[:5] == [Coordinates(0, 0, 0), Coordinates(0, 0, 1), Coordinates(0, 0, 2),
                          Coordinates(0, 0, 3), Coordinates(0, 1, 0)]
    assert coords[12] == Coordinates(1, 0, 0)
    assert len(set(coords)) == p * d * t


def test_named_groups_written_out_for_p2_d2_c2_t2():
    """Rank = ((p*2 + d)*2 + c)*2 + t; checked by hand."""
    layout = grid_layout(p=2, d=2, t=2, c=2)
    assert axis_rows(layout, ["tensor"])[:3] == [[0, 1], [2, 3], [4, 5]]
    assert axis_rows(layout, ["context"])[:3] == [[0, 2], [1, 3], [4, 6]]
    assert axis_rows(layout, ["data"])[:3] == [[0, 4], [1, 5], [2, 6]]
    assert axis_rows(layout, ["pipeline"])[:2] == [[0, 8], [1, 9]]
    assert axis_rows(layout, ["data", "context"]) == [[0, 2, 4, 6], [1, 3, 5, 7],
                                                      [8, 10, 12, 14], [9, 11, 13, 15]]
    # a set is a set: the order the names come in changes nothing
    assert axis_rows(layout, ["context", "data"]) == axis_rows(layout, ["data", "context"])
    assert axis_rows(layout, ["pipeline", "tensor"])[:2] == [[0, 1, 8, 9], [2, 3, 10, 11]]
    with pytest.raises(ValueError, match="expert"):
        axis_rows(layout, ["expert"])


def _todays_group_rows(p, d, t, c):
    """The grid's groups as ptdp built them by hand before named axes (862578d)."""
    grid = torch.arange(p * d * c * t).reshape(p, d, c, t)
    return {"tensor": grid.reshape(-1, t).tolist(),
            "data": grid.permute(0, 2, 3, 1).reshape(-1, d).tolist(),
            "pipeline": grid.permute(1, 2, 3, 0).reshape(-1, p).tolist(),
            "context": grid.permute(0, 1, 3, 2).reshape(-1, c).tolist(),
            "replica": grid.permute(0, 3, 1, 2).reshape(-1, d * c).tolist(),
            "model": grid.permute(1, 2, 0, 3).reshape(d * c, -1).tolist()}


NAMES = {"tensor": ["tensor"], "data": ["data"], "pipeline": ["pipeline"],
         "context": ["context"], "replica": ["data", "context"], "model": ["pipeline", "tensor"]}


@pytest.mark.parametrize("p,d,c,t", SHAPES)
def test_named_groups_are_todays_groups(p, d, c, t):
    """Same members, same order in a group, same creation order, for every kind of group."""
    layout = grid_layout(p, d, t, c)
    for kind, rows in _todays_group_rows(p, d, t, c).items():
        assert axis_rows(layout, NAMES[kind]) == rows, kind
    assert group_rows(p, d, t, c)["tensor"] == axis_rows(layout, ["tensor"])


@pytest.mark.parametrize("p,d,c,t", SHAPES)
def test_a_group_is_the_ranks_that_differ_only_along_its_axes(p, d, c, t):
    """From coordinates alone: every rank is in exactly one group of each set, with exactly
    the ranks that agree with it on the other axes, ordered along the named axes."""
    world = p * d * c * t
    coords = [coordinates_of(r, p, d, t, c) for r in range(world)]
    layout = grid_layout(p, d, t, c)
    for names in (["tensor"], ["data"], ["pipeline"], ["context"], ["data", "context"],
                  ["pipeline", "tensor"]):
        rows = axis_rows(layout, names)
        assert sorted(r for row in rows for r in row) == list(range(world))
        others = [a for a in ("pipeline", "data", "context", "tensor") if a not in names]
        for row in rows:
            key = {tuple(getattr(coords[r], a) for a in others) for r in row}
            assert len(key) == 1
            along = [tuple(getattr(coords[r], a) for a in names) for r in row]
            assert along == sorted(along)


def test_the_embedding_group_is_first_and_last_stage_or_the_stages_named():
    assert embedding_rows(p=3, d=2, t=1) == [[0, 4], [1, 5]]
    assert embedding_rows(p=1, d=2, t=2) == [[0], [1], [2], [3]]
    assert embedding_rows(p=4, d=1, t=1, stages=(0, 1)) == [[0, 1]]   # a V: both on one rank
    with pytest.raises(ValueError, match="stages of 4"):
        embedding_rows(p=4, d=1, t=1, stages=(0, 4))


def grid_groups(p, t, d, c=1):
    grid = RankGrid(p, t, d, timeout_s=30, context=c)
    names = {"tensor": ("tensor",), "data": ("data",), "pipeline": ("pipeline",),
             "model": ("pipeline", "tensor"), "context": ("context",),
             "replica": ("data", "context")}
    out = {kind: grid.ranks(*axes) for kind, axes in names.items()}
    out |= {"coords": grid.coords, "embedding": grid.embedding_ranks,
            "replica_index": grid.index("context", "data"),
            "replica_size": grid.size("data", "context"),
            "coordinate": [grid.coordinate(a) for a in ("pipeline", "data", "context", "tensor")]}
    for axes in names.values():   # the group holds exactly the ranks listed
        group = grid.group(*axes)
        assert torch.distributed.get_world_size(group) == len(grid.ranks(*axes))
        assert torch.distributed.get_rank(group) == grid.index(*axes)
    try:
        grid.group("expert")
    except ValueError as e:
        out["unknown"] = str(e)
    return out


@pytest.fixture(scope="module")
def grid_2_2_2():
    return run_on_ranks(8, grid_groups, 2, 2, 2, timeout_s=within(120))


def test_groups_for_p2_t2_d2(grid_2_2_2):
    rank5 = grid_2_2_2[5]  # p=1, d=0, t=1
    assert rank5["coords"] == Coordinates(pipeline=1, data=0, tensor=1)
    assert rank5["tensor"] == [4, 5]            # adjacent ranks: one node on a cluster
    assert rank5["data"] == [5, 7]
    assert rank5["pipeline"] == [1, 5]
    assert rank5["model"] == [0, 1, 4, 5]       # all (p, t) of data replica 0
    assert rank5["embedding"] == [1, 5]         # first and last stage, same (d, t)
    assert rank5["context"] == [5] and rank5["replica"] == [5, 7]   # c = 1
    assert "no layout" in rank5["unknown"]


def test_every_rank_in_exactly_one_group_of_each_kind(grid_2_2_2):
    for kind, size in (("tensor", 2), ("data", 2), ("pipeline", 2), ("model", 4)):
        groups = {tuple(r[kind]) for r in grid_2_2_2}
        members = sorted(x for g in groups for x in g)
        assert members == list(range(8)), kind
        assert all(len(g) == size for g in groups), kind
        for rank, r in enumerate(grid_2_2_2):
            assert rank in r[kind], (kind, rank)


def test_context_ranks_index_data_major():
    """p=1, d=2, c=2, t=1: rank = d*2 + c; the replica index is d*c + c (data-major)."""
    ranks = run_on_ranks(4, grid_groups, 1, 1, 2, 2, timeout_s=within(120))
    assert [r["replica"] for r in ranks] == [[0, 1, 2, 3]] * 4
    assert [r["replica_index"] for r in ranks] == [0, 1, 2, 3]
    assert [r["replica_size"] for r in ranks] == [4] * 4
    assert [r["context"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["coordinate"] for r in ranks] == [[0, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0],
                                                [0, 1, 1, 0]]


def later_grids_reuse_groups():
    """Grids built one after another in one process (a second trainer): the same set, members
    and timeout get the first grid's group and no new threads; any other set, layout or
    timeout gets its own; after the world is torn down and made again, new ones."""
    import os
    import torch.distributed as dist

    def threads():
        return len(os.listdir("/proc/self/task"))

    first = RankGrid(1, 2, 1, timeout_s=30)
    before = threads()
    again = [RankGrid(1, 2, 1, timeout_s=30) for _ in range(4)]
    out = {"added_threads": threads() - before,
           "same": all(g.group("tensor") is first.group("tensor")
                       and g.embedding_group is first.embedding_group for g in again),
           # a set keeps its own group where its members are another set's
           "own_per_set": first.group("pipeline", "tensor") is not first.group("tensor")}
    other_timeout = RankGrid(1, 2, 1, timeout_s=31)
    pipeline = RankGrid(2, 1, 1, timeout_s=30)   # [0, 1] again, as the pipeline set
    out["other_timeout_new"] = other_timeout.group("tensor") is not first.group("tensor")
    out["other_layout_new"] = pipeline.group("pipeline") not in (
        first.group("tensor"), first.group("pipeline", "tensor"))
    total = torch.ones(1)
    dist.all_reduce(total, group=again[-1].group("tensor"))
    out["sum"] = total.item()
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()   # the same rendezvous, a new prefix
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("again", store), rank=rank,
                            world_size=world)
    remade = RankGrid(1, 2, 1, timeout_s=30)
    total = torch.ones(1)
    dist.all_reduce(total, group=remade.group("tensor"))
    out["sum_after_remade_world"] = total.item()
    return out


def test_a_later_grid_reuses_the_groups_of_an_earlier_one():
    for rank in run_on_ranks(2, later_grids_reuse_groups, timeout_s=within(120)):
        assert rank == {"added_threads": 0, "same": True, "own_per_set": True,
                        "other_timeout_new": True, "other_layout_new": True, "sum": 2.0,
                        "sum_after_remade_world": 2.0}
