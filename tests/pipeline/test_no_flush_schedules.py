"""The no-flush schedules as data: 2BW and PipeDream windows, their rank actions, the bubble,
and the per-iteration plan that repeats a checked window (torch-free; the exchange-plan sweep
is dealt out over two local processes, tests/pipeline/test_comm_plan.py's on_both_cores)."""

from collections import Counter
from fractions import Fraction

import pytest

from ptdp.pipeline.comm_plan import PlanError, check_plans, plan_exchanges
from ptdp.pipeline.actions import (BACKWARD, END, FORWARD, REDUCE, TIED, UPDATE, WEIGHTS,
                                   Action)
from ptdp.pipeline.schedules import build_all, build_schedule, format_schedule, max_in_flight
from ptdp.pipeline.no_flush import noam, weight_updates_before_forwards
from ptdp.config.catalogue import TWO_BW as TWO_BW_SPEC, two_bw_min_micro_batches
from ptdp.pipeline.timeline import simulate
from ptdp.pipeline.window import NoFlushPlan, shift_steps, split_iterations
from tests.pipeline.test_comm_plan import on_both_cores

ONE = Fraction(1)
BATCHES = 4


def two_bw_cases():
    for p in range(1, 9):
        for v in range(1, 5):
            if v > 1 and p == 1:
                continue
            least = two_bw_min_micro_batches(p, v)
            for m in sorted({least, least + p, 2 * least}):
                yield p, v, m


TWO_BW = list(two_bw_cases())
PIPEDREAM = [(p, m) for p in range(1, 9) for m in sorted({1, 2, p, 2 * p + 1})]


def _position(actions):
    return {a: i for i, a in enumerate(actions)}


@pytest.mark.parametrize("p,v,m", TWO_BW)
def test_two_bw_window_runs_everything_once_and_updates_between_batches(p, v, m):
    for rank, actions in enumerate(build_all("2bw", p, v, m, BATCHES)):
        at = _position(actions)
        assert len(at) == len(actions)                       # nothing twice
        for kind in (FORWARD, BACKWARD):
            pairs = Counter((a.mb, a.stage) for a in actions if a.kind == kind)
            assert set(pairs) == {(mb, s) for mb in range(BATCHES * m)
                                  for s in TWO_BW_SPEC.stage_map(p, v).stages_of(rank)}
        for t in range(BATCHES):
            last = t * m + m - 1
            reduce, weights, end = (at[Action(k, last, rank)] for k in (REDUCE, WEIGHTS, END))
            backwards = [at[a] for a in actions if a.kind == BACKWARD and a.mb // m == t]
            assert max(backwards) < reduce < weights == end - 1       # R after the batch, W E
            later = [at[a] for a in actions if a.kind == FORWARD and a.mb // m == t + 2]
            assert all(weights < i for i in later)   # batch t+2 runs with W's version


@pytest.mark.parametrize("p,v,m", TWO_BW)
def test_two_bw_has_no_bubble_in_steady_state(p, v, m):
    """Iterations end every m*(t_f+t_b) time units: no flush; the window's only bubble is one
    fill and drain, (p-1)/(v*n*m) for n batches."""
    tl = simulate("2bw", p, v, m, ONE, 2 * ONE, batches=BATCHES)
    for row in tl.ranks:
        ends = [s.end for s in row if s.action.kind == END]
        assert all(b - a == 3 * m for a, b in zip(ends[:2], ends[1:3]))
    if p > 1:
        assert tl.bubble_fraction == Fraction(p - 1, v * BATCHES * m)
        assert tl.bubble_fraction < simulate("1f1b" if v == 1 else "interleaved", p, v, m, ONE,
                                             2 * ONE, batches=BATCHES).bubble_fraction


@pytest.mark.parametrize("p,v,m", TWO_BW)
def test_two_bw_keeps_the_flushing_in_flight_bound(p, v, m):
    """Activations: 1F1B's p - rank (Megatron's interleaved warm-up + 1 chunk stashes when
    v > 1), never the m of GPipe: at most p micro-batches in flight."""
    for rank, actions in enumerate(build_all("2bw", p, v, m, BATCHES)):
        bound = p - rank if v == 1 else 2 * (p - rank - 1) + (v - 1) * p + 1
        assert max_in_flight(actions) == min(bound, BATCHES * m * v)


def test_two_bw_needs_enough_micro_batches():
    assert [two_bw_min_micro_batches(p, 1) for p in (1, 2, 8)] == [1, 2, 8]
    assert two_bw_min_micro_batches(2, 2) == 2      # 2(p-1)+(v-1)p = 4 <= m*v
    assert two_bw_min_micro_batches(4, 2) == 8      # warm-up 10 > 4*2: next multiple of p
    with pytest.raises(ValueError, match="at least 2 micro-batches per batch with p=2"):
        build_schedule("2bw", 2, 1, 1, 0)
    with pytest.raises(ValueError, match="warm-up 2\\(p-1\\)\\+\\(v-1\\)p = 10"):
        build_schedule("2bw", 4, 2, 4, 0)


def test_two_bw_known_order():
    """p=2, m=2: rank 1 finishes batch 0 first, runs a pair of batch 1 while rank 0 finishes,
    then both update (W) and end the iteration (E) at the same simulated moment."""
    assert format_schedule("2bw", 2, 1, 2, batches=2) == (
        "rank 0: F0 F1 B0 F2 B1 R1 W1 E1 F3 B2 B3 R3 W3 E3\n"
        "rank 1: F0 B0 F1 B1 R1 F2 B2 W1 E1 F3 B3 R3 W3 E3")


def test_noam_is_workers_over_input_replicas():
    assert noam(8, 1) == 8 and noam(4 * 2, 2) == 4 and noam(5, 2) == 3   # "2-1-1"-like: ceil


@pytest.mark.parametrize("p,m", PIPEDREAM)
def test_pipedream_admits_noam_inputs_and_updates_after_every_backward(p, m):
    rows = build_all("pipedream", p, 1, m, BATCHES)
    for rank, actions in enumerate(rows):
        at = _position(actions)
        first_backward = next(i for i, a in enumerate(actions) if a.kind == BACKWARD)
        admitted = sum(a.kind == FORWARD for a in actions[:first_backward])
        assert admitted == min(noam(p, 1) - rank, BATCHES * m)
        assert max_in_flight(actions) == min(p - rank, BATCHES * m)
        for mb in range(BATCHES * m):
            assert at[Action(UPDATE, mb, rank)] == at[Action(BACKWARD, mb, rank)] + 1
        for t in range(BATCHES):
            last = t * m + m - 1
            assert at[Action(UPDATE, last, rank)] < at[Action(REDUCE, last, rank)] \
                < at[Action(END, last, rank)]


@pytest.mark.parametrize("p,m", [c for c in PIPEDREAM if c[0] > 1])
def test_pipedream_tied_copy_is_updated_right_before_it_is_needed(p, m):
    """The last rank applies input j's tied-embedding update just before F(j+p): the version
    rank 0 ran input j+p with."""
    last = build_all("pipedream", p, 1, m, BATCHES)[p - 1]
    at = _position(last)
    n = BATCHES * m
    for j in range(n):
        assert Action(TIED, j, p - 1) in at
        if j + p < n:
            assert at[Action(TIED, j, p - 1)] == at[Action(FORWARD, j + p, p - 1)] - 1
    assert all(a.kind != TIED for row in build_all("pipedream", p, 1, m, 2)[:-1] for a in row)


@pytest.mark.parametrize("p,m", PIPEDREAM)
def test_pipedream_input_stage_tags_are_k_minus_p_plus_1(p, m):
    """Vertical sync's version of input k: the updates rank 0 made before F(k)."""
    tags = weight_updates_before_forwards(build_all("pipedream", p, 1, m, BATCHES)[0])
    assert tags == {k: max(k - p + 1, 0) for k in range(BATCHES * m)}


def test_pipedream_refuses_interleaving():
    with pytest.raises(ValueError, match="'pipedream' needs v=1"):
        build_schedule("pipedream", 2, 2, 4, 0)


# ---------------------------------------------------------------------------- the comm plan


def comm_cases():
    for p in range(2, 9):
        for v in range(1, 5):
            for m in range(p, 4 * p + 1):
                if m >= two_bw_min_micro_batches(p, v) and (v == 1 or m % p == 0):
                    yield "2bw", p, v, m
        for m in range(p, 4 * p + 1):
            yield "pipedream", p, 1, m


@pytest.mark.parametrize("scatter_gather", [False, True])
@pytest.mark.parametrize("name", ["2bw", "pipedream"])
def test_no_flush_plans_match_and_complete_under_nccl_rules(name, scatter_gather):
    """p <= 8, v <= 4 (2bw), m from p to 4p: order-matched, deadlock-free with an iteration
    barrier at every E and without, and no exchange crosses an iteration boundary. Which
    messages go where does not depend on the wire shape (plan_exchanges only records
    `shape(message)` in each transfer): with the scatter/gather shape, only the pairing (shapes
    included) and the replay with barriers are checked again."""
    cases = [case for case in comm_cases() if case[0] == name]
    assert on_both_cores(_check_no_flush, cases, scatter_gather) == len(cases) > 100


def _check_no_flush(case: tuple, scatter_gather: bool) -> None:
    name, p, v, m = case
    shape = (lambda msg: (16 * 2 * 32 // 2,)) if scatter_gather else (lambda msg: (16, 2, 32))
    plans = plan_exchanges(build_all(name, p, v, m, 3), p, v, shape)
    check_plans(plans)
    if not scatter_gather:
        check_plans(plans, barriers=False)
        _assert_iterations_are_closed(plans)


def _assert_iterations_are_closed(plans):
    """Every message is sent and received in the same iteration (between the same E's)."""
    sent, received = {}, {}
    for rank, steps in enumerate(plans):
        for iteration, segment in enumerate(split_iterations(steps)):
            for step in segment:
                for t in step.exchange:
                    (sent if t.send else received)[t.message] = iteration
    assert sent == received


def test_receives_left_in_the_next_iteration_deadlock_at_a_boundary():
    """Placing receives by time alone (ignoring the E's) is fine without barriers but hangs
    once an iteration boundary holds every rank, as a checkpoint or validation does."""
    import ptdp.pipeline.comm_plan as comm_plan
    schedule = build_all("2bw", 2, 1, 2, 3)
    original = comm_plan._iteration_bounds
    try:
        comm_plan._iteration_bounds = lambda row: {k: (0, len(row)) for k in original(row)}
        naive = plan_exchanges(schedule, 2, 1)
    finally:
        comm_plan._iteration_bounds = original
    check_plans(naive, barriers=False)
    with pytest.raises(PlanError, match="deadlock"):
        check_plans(naive)


# ---------------------------------------------------------------------------- the window


@pytest.mark.parametrize("name,p,v,m", [("2bw", 2, 1, 2), ("2bw", 3, 1, 4), ("2bw", 2, 2, 4),
                                        ("2bw", 4, 2, 8), ("pipedream", 3, 1, 2),
                                        ("pipedream", 4, 1, 5)])
def test_repeated_window_equals_planning_every_iteration(name, p, v, m):
    """A resumed job of 15 iterations from iteration 3: the steps of each iteration stitched
    together are the plan of all 15 batches at once, micro-batches numbered from 3*m."""
    plan = NoFlushPlan(name, p, v, m, first=3, iterations=15)
    direct = plan_exchanges(build_all(name, p, v, m, 15), p, v)
    for rank in range(p):
        stitched = [step for it in range(3, 18) for step in plan.steps(rank, it)]
        assert stitched == shift_steps(direct[rank], 3 * m)
    with pytest.raises(ValueError, match="outside the planned 3..17"):
        plan.steps(0, 18)


def test_short_runs_are_planned_whole():
    plan = NoFlushPlan("2bw", 2, 1, 2, first=0, iterations=2)
    assert plan.window == 2
    assert [s.action for s in plan.steps(0, 1)][-2:] == [Action(END, 3, 0), None]
