"""Schedules are data: check the per-rank action lists themselves (no torch, no processes)."""

from collections import Counter

import pytest

from ptdp.config.catalogue import names_where, schedule_spec
from ptdp.config.stages import StageMap, layer_ranges
from ptdp.pipeline.actions import Action, dependencies
from ptdp.pipeline.schedules import build_all, build_schedule, format_schedule, max_in_flight
from ptdp.pipeline.timeline import simulate

FLUSHING = names_where(lambda spec: spec.flushing)


def _micro_batch_counts(name: str, p: int, v: int) -> list[int]:
    """m values to test: tiny, around p, several multiples (interleaved v>1: multiples only)."""
    if name == "interleaved" and v > 1:
        return [p, 2 * p, 3 * p]
    return sorted({1, 2, max(p - 1, 1), p, p + 1, 2 * p, 3 * p + 1})


CASES = [
    (name, p, v, m)
    for name in FLUSHING
    for p in range(1, 9)
    for v in ([1] if name in ("1f1b", "zb-h1") else range(1, 5))
    for m in _micro_batch_counts(name, p, v)
]


def _id(case):
    name, p, v, m = case
    return f"{name}-p{p}-v{v}-m{m}"


def _split_expected(name: str, actions: list, units: set) -> set:
    """The (mb, stage) whose backward the schedule splits: zb-h1 every one; 1F1B and
    interleaved those after the rank's last forward, on any stage but the first."""
    spec = schedule_spec(name)
    if spec.split_backward:
        return units
    if not spec.split_cooldown:
        return set()
    last_forward = max(i for i, a in enumerate(actions) if a.kind == "F")
    return {(a.mb, a.stage) for a in actions[last_forward + 1:] if a.stage > 0}


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_every_forward_and_backward_once_forward_first(case):
    name, p, v, m = case
    stages = schedule_spec(name).stage_map(p, v)
    for rank, actions in enumerate(build_all(name, p, v, m)):
        expected = {(mb, s) for mb in range(m) for s in stages.stages_of(rank)}
        split = _split_expected(name, actions, expected)
        for kind, units in (("F", expected), ("B", expected), ("Wg", split)):
            pairs = Counter((a.mb, a.stage) for a in actions if a.kind == kind)
            assert set(pairs) == units and set(pairs.values()) <= {1}, (rank, kind)
        position = {a: i for i, a in enumerate(actions)}
        for mb, s in expected:
            kinds = ("F", "B", "Wg") if (mb, s) in split else ("F", "B")
            order = [position[Action(kind, mb, s)] for kind in kinds]
            assert order == sorted(order), (rank, mb, s)
            if (mb, s) in split and not schedule_spec(name).split_backward:
                assert order[2] == order[1] + 1, (rank, mb, s)   # the cooldown's Wg: at once
        assert len(actions) == 2 * m * v + len(split)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_deadlock_free_and_in_flight_bound(case):
    name, p, v, m = case
    simulate(name, p, v, m)  # raises DeadlockError if any rank gets stuck
    for rank, actions in enumerate(build_all(name, p, v, m)):
        assert max_in_flight(actions) == _in_flight_bound(name, p, v, m, rank), rank


def _in_flight_bound(name, p, v, m, rank):
    """The documented activation-stash bound, counted in (mb, stage) pairs."""
    if name == "gpipe":
        return m * v  # everything is stashed before the first backward
    if name == "zb-h1":  # 1F1B's p - rank until B, plus rank weight gradients pending
        return min(p, m)
    if v == 1:  # 1f1b, and interleaved with one chunk (which is 1f1b)
        return min(p - rank, m)
    warmup = 2 * (p - rank - 1) + (v - 1) * p  # Megatron's interleaved warm-up
    return min(warmup + 1, m * v)


def test_1f1b_never_exceeds_pipeline_depth():
    for p in range(1, 9):
        for m in (1, p, 4 * p + 3):
            assert max(max_in_flight(a) for a in build_all("1f1b", p, 1, m)) <= p


def test_gpipe_stashes_all_micro_batches():
    assert max_in_flight(build_schedule("gpipe", 4, 1, 8, rank=3)) == 8


# ---------------------------------------------------------------------------- exact orders


def test_1f1b_known_order():
    # p=2: rank 0 warms up with p-0-1 = 1 forward, then F/B pairs, then drains; rank 1's
    # backward after its last forward sends its input gradient before its weight gradients.
    assert format_schedule("1f1b", 2, 1, 4) == (
        "rank 0: F0  F1  B0  F2  B1  F3  B2  B3\n"
        "rank 1: F0  B0  F1  B1  F2  B2  F3  B3  Wg3"
    )


def test_gpipe_known_order():
    assert [str(a) for a in build_schedule("gpipe", 2, 1, 3, rank=0)] == [
        "F0@s0", "F1@s0", "F2@s0", "B0@s0", "B1@s0", "B2@s0",
    ]
    # chunk-major forwards, then backwards from the last chunk back
    assert [str(a) for a in build_schedule("gpipe", 2, 2, 2, rank=1)] == [
        "F0@s1", "F1@s1", "F0@s3", "F1@s3", "B0@s3", "B1@s3", "B0@s1", "B1@s1",
    ]


def test_interleaved_known_order():
    # p=2, v=2, m=4: (mb, chunk) order (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1);
    # rank 0 warms up with 2*(2-0-1) + (2-1)*2 = 4 forwards, backwards visit chunk 1 first.
    # The cooldown (after a rank's last forward) splits every backward but stage 0's.
    assert format_schedule("interleaved", 2, 2, 4).replace("  ", " ").replace("  ", " ") == (
        "rank 0: F0@s0 F1@s0 F0@s2 F1@s2 F2@s0 B0@s2 F3@s0 B1@s2 "
        "F2@s2 B0@s0 F3@s2 B1@s0 B2@s2 Wg2@s2 B3@s2 Wg3@s2 B2@s0 B3@s0\n"
        "rank 1: F0@s1 F1@s1 F0@s3 B0@s3 F1@s3 B1@s3 F2@s1 B0@s1 "
        "F3@s1 B1@s1 F2@s3 B2@s3 F3@s3 B3@s3 Wg3@s3 B2@s1 Wg2@s1 B3@s1 Wg3@s1"
    )


@pytest.mark.parametrize("p", range(1, 9))
def test_interleaved_with_one_chunk_is_1f1b(p):
    for m in (1, p, 2 * p + 1):
        assert build_all("interleaved", p, 1, m) == build_all("1f1b", p, 1, m)


# ---------------------------------------------------------------------------- placement, errors


def test_stage_placement_round_robin_by_chunk():
    stages = StageMap(4, 2)
    assert stages.stages_of(0) == (0, 4)
    assert stages.stages_of(3) == (3, 7)
    assert [stages.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [stages.chunk_of(s) for s in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    # the dissertation's example: 16 layers, p=4, v=2 -> device 1 holds layers 1, 2, 9, 10
    assert [list(layer_ranges(16, 8)[s]) for s in stages.stages_of(0)] == [[0, 1], [8, 9]]
    with pytest.raises(ValueError, match="divisible"):
        layer_ranges(12, 8)


def test_dependencies():
    assert dependencies(Action("F", 3, 0), p=2, v=2) == []
    assert dependencies(Action("F", 3, 2), p=2, v=2) == [Action("F", 3, 1)]
    assert dependencies(Action("B", 3, 3), p=2, v=2) == [Action("F", 3, 3)]
    assert dependencies(Action("B", 3, 1), p=2, v=2) == [Action("F", 3, 1), Action("B", 3, 2)]


def test_action_str():
    assert str(Action("F", 3, 5)) == "F3@s5"


def test_interleaved_requires_m_multiple_of_p():
    with pytest.raises(ValueError, match=r"multiple of the pipeline size p \(got m=6, p=4\)"):
        build_schedule("interleaved", p=4, v=2, m=6, rank=0)


@pytest.mark.parametrize(
    "args, message",
    [
        (("pipedream-x", 2, 1, 4, 0), "unknown schedule"),
        (("1f1b", 2, 2, 4, 0), "use 'interleaved'"),
        (("gpipe", 2, 1, 0, 0), "m must be >= 1"),
        (("gpipe", 2, 1, 4, 2), r"rank must be in \[0, 2\)"),
    ],
)
def test_bad_arguments_raise_clear_errors(args, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(*args)

FLUSHING = names_where(lambda spec: spec.flushing)


def test_format_schedule_aligns_columns():
    lines = format_schedule("gpipe", 2, 1, 11).splitlines()
    assert lines[0].startswith("rank 0: F0  F1  F2 ")
    assert len({line.index("F10") for line in lines}) == 1
