"""The timeline simulator: exact bubbles, per-chunk durations, communication, deadlocks."""

from fractions import Fraction

import pytest

from ptdp.pipeline.actions import Action
from ptdp.pipeline.schedules import build_all
from ptdp.pipeline.simulation import DeadlockError, exact_times, simulate_lists
from ptdp.pipeline.timeline import render_ascii, simulate

ONE = Fraction(1)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("t_b", [2 * ONE, ONE])
@pytest.mark.parametrize("p", range(1, 9))
def test_bubble_is_p_minus_1_over_m(name, t_b, p):
    """The dissertation's (p-1)/m, for backwards that are one pass (1F1B's cooldown split
    into B and a Wg of no time is that)."""
    for m in sorted({1, max(p - 1, 1), p, 2 * p, 3 * p + 1}):
        tl = simulate(name, p, 1, m, t_f=ONE, t_b=t_b, t_w=0 * ONE)
        assert tl.bubble_fraction == Fraction(p - 1, m), m


@pytest.mark.parametrize("t_b", [2 * ONE, ONE])
@pytest.mark.parametrize("p", range(1, 9))
def test_1f1b_cooldown_split_takes_a_weight_gradient_pass_off_each_drain_step(t_b, p):
    """ptdp's 1F1B sends a cooldown backward's input gradient before its weight gradients:
    each of the drain's p - 1 hops is shorter by t_w (here t_b / 2 <= t_f), so the bubble is
    (p-1)(t_f + t_b - t_w) / (m (t_f + t_b)) instead of (p-1)/m."""
    for m in sorted({1, max(p - 1, 1), p, 2 * p, 3 * p + 1}):
        tl = simulate("1f1b", p, 1, m, t_f=ONE, t_b=t_b)
        assert tl.bubble_fraction == (p - 1) * (1 + t_b / 2) / (m * (1 + t_b)), m


@pytest.mark.parametrize("t_b", [2 * ONE, ONE])
@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("v", range(2, 5))
def test_interleaved_bubble_is_divided_by_v(t_b, p, v):
    """(p-1)/(v m) with whole backwards; the cooldown split shortens each hop by t_w / v."""
    for m in (p, 2 * p, 3 * p):
        tl = simulate("interleaved", p, v, m, t_f=ONE, t_b=t_b, t_w=0 * ONE)
        assert tl.bubble_fraction == Fraction(p - 1, v * m), m
        tl = simulate("interleaved", p, v, m, t_f=ONE, t_b=t_b)
        assert tl.bubble_fraction == (p - 1) * (1 + t_b / 2) / (v * m * (1 + t_b)), m


@pytest.mark.parametrize("v", range(2, 5))
def test_gpipe_with_chunks_also_divides_the_bubble_by_v_once_m_reaches_p(v):
    for p in range(1, 9):
        for m in (p, p + 1, 2 * p):
            tl = simulate("gpipe", p, v, m, t_f=ONE, t_b=2 * ONE)
            assert tl.bubble_fraction == Fraction(p - 1, v * m), (p, m)


def test_unknown_action_kind_is_rejected():
    with pytest.raises(ValueError, match="cannot simulate action kind 'X'"):
        simulate_lists([[Action("X", 0, 0)]], p=1, v=1, m=1)


def test_every_rank_is_busy_for_exactly_the_ideal_time():
    tl = simulate("interleaved", 4, 2, 8, t_f=ONE, t_b=2 * ONE)
    for row in tl.ranks:
        assert sum(s.end - s.start for s in row) == tl.ideal == 24
        assert all(a.end <= b.start for a, b in zip(row, row[1:]))  # no overlap, in order


def test_chunk_durations_are_a_vth_of_the_rank_share():
    tl = simulate("interleaved", 2, 2, 2, t_f=ONE, t_b=2 * ONE, t_w=ONE / 2)
    slots = [s for row in tl.ranks for s in row]
    split = {(s.action.mb, s.action.stage) for s in slots if s.action.kind == "Wg"}
    spans = {(s.action.kind, (s.action.mb, s.action.stage) in split): s.end - s.start
             for s in slots}
    assert spans == {("F", False): ONE / 2, ("F", True): ONE / 2, ("B", False): ONE,
                     ("B", True): ONE * 3 / 4, ("Wg", True): ONE / 4}


def test_1f1b_p2_m4_exact_slots():
    tl = simulate("1f1b", 2, 1, 4, t_f=1.0, t_b=2.0)
    rank1 = [(str(s.action), s.start, s.end) for s in tl.ranks[1]]
    assert rank1[:3] == [("F0@s1", 1, 2), ("B0@s1", 2, 4), ("F1@s1", 4, 5)]
    # the last backward is split: its input gradient reaches rank 0 one t_w = 1 sooner
    assert rank1[-2:] == [("B3@s1", 11, 12), ("Wg3@s1", 12, 13)]
    assert [(str(s.action), s.start, s.end) for s in tl.ranks[0]][-1] == ("B3@s0", 12, 14)
    assert tl.makespan == 14 and tl.ideal == 12 and tl.bubble_fraction == 2 / 12


def test_communication_latency_is_paid_per_rank_crossing():
    # p=2, m=1: F on rank 0 [0,1], hop, F on rank 1 [1.5,2.5], B [2.5,4.5], hop, B [5,7]
    tl = simulate("gpipe", 2, 1, 1, t_f=1.0, t_b=2.0, t_comm=0.5)
    assert [(s.start, s.end) for s in tl.ranks[0]] == [(0, 1), (5, 7)]
    assert tl.makespan == 7
    assert simulate("1f1b", 4, 1, 8, t_comm=0.1).bubble_fraction > 3 * 2 / (8 * 3)


def test_deadlock_names_rank_and_action():
    # rank 1 wants the backward before it has run the forward it depends on
    broken = [
        [Action("F", 0, 0), Action("B", 0, 0)],
        [Action("B", 0, 1), Action("F", 0, 1)],
    ]
    with pytest.raises(DeadlockError) as err:
        simulate_lists(broken, p=2, v=1, m=1)
    message = str(err.value)
    assert "rank 1 blocked at B0@s1" in message and "waiting for F0@s1" in message
    assert "rank 0 blocked at B0@s0" in message


def test_missing_action_is_reported():
    with pytest.raises(DeadlockError, match="scheduled on no rank"):
        simulate_lists([[Action("F", 0, 0)], [Action("B", 0, 1)]], p=2, v=1, m=1)


def test_render_ascii_small_case():
    art = render_ascii(simulate("1f1b", 2, 1, 4))
    assert art.splitlines() == [
        "1f1b: p=2 v=1 m=4  makespan=14  bubble=0.167",
        "rank 0 |F0 |F1 |........B0     |F2 |B1     |F3 |B2     |B3     |",
        "rank 1 |....F0 |B0     |F1 |B1     |F2 |B2     |F3 |B3 |Wg3|....",
    ]


def test_render_ascii_fixed_width_has_one_row_per_rank():
    art = render_ascii(simulate("interleaved", 4, 2, 8), width=60)
    rows = art.splitlines()[1:]
    assert len(rows) == 4 and all(len(r) == len("rank 0 |") + 60 for r in rows)


@pytest.mark.parametrize("name, v", [("gpipe", 3), ("interleaved", 3), ("zb-h1", 1),
                                     ("2bw", 2), ("pipedream", 1)])
def test_exact_times_order_events_as_exact_fractions(name, v):
    """Plans and iteration ends are simulated in whole-number times (simulation.exact_times):
    every slot starts and ends at 2v times its Fraction time with t_f = 1, t_b = 2."""
    p, m = 4, 8
    rows = build_all(name, p, v, m, 2)
    exact = simulate_lists(rows, p, v, 2 * m, **exact_times(v))
    fractions = simulate_lists(rows, p, v, 2 * m, t_f=Fraction(1), t_b=Fraction(2))
    for a, b in zip(exact.ranks, fractions.ranks):
        assert [(s.action, s.start, s.end) for s in a] == \
            [(s.action, b_s.start * 2 * v, b_s.end * 2 * v) for s, b_s in zip(a, b)]
        assert all(float(s.start).is_integer() for s in a)
