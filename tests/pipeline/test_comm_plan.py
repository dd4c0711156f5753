"""The exchange plan holds under NCCL's rules for every schedule (plans are torch-free).

For every schedule, p <= 8, v <= 4 and m from p to 4p, with and without scatter/gather, the
sends and receives of every pair of ranks match message for message, shapes included, and
replaying every rank's exchanges with in-order, unbuffered completion finishes. The sweep is
one core's pure Python: `on_both_cores` splits its cases over two local processes.
"""

from collections import Counter

import pytest

from ptdp.pipeline.comm_plan import (ACTIVATION, GRADIENT, Message, PlanError, Step, Transfer,
                                     check_plans, needed_message, plan_exchanges,
                                     produced_message)
from ptdp.config.catalogue import names_where
from ptdp.pipeline.schedules import build_all
from ptdp.config.stages import StageMap
from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within

FLUSHING = names_where(lambda spec: spec.flushing)

ACT_SHAPE = (16, 2, 32)


def _wire_shapes(t: int, scatter_gather: bool):
    numel = 16 * 2 * 32
    return (lambda message: (numel // t,)) if scatter_gather else (lambda message: ACT_SHAPE)


def _cases():
    for name in FLUSHING:
        for p in range(2, 9):
            for v in ([1] if name in ("1f1b", "zb-h1") else range(1, 5)):
                for m in range(p, 4 * p + 1):
                    if name == "interleaved" and v > 1 and m % p:
                        continue
                    yield name, p, v, m


def on_both_cores(check, cases: list, *args) -> int:
    """`check(case, *args)` for every case, the cases dealt out over 2 local processes (each
    takes every other one); how many were checked. A failed check fails the call with its
    rank's traceback (RankFailure)."""
    return sum(run_on_ranks(2, _check_share, check, cases, args, timeout_s=within(240)))


def _check_share(check, cases: list, args: tuple) -> int:
    import gc

    import torch.distributed as dist
    # The rank holds torch's ~300,000 objects (the fork server imported it): frozen, the
    # collections that the plans' millions of small objects trigger do not walk them again.
    gc.freeze()
    share = cases[dist.get_rank()::dist.get_world_size()]
    for case in share:
        check(case, *args)
    return len(share)


def _check_flushing(case: tuple, scatter_gather: bool) -> None:
    """Both wire shapes must pair up send for receive (check_plans compares shapes). Which
    messages go where does not depend on the shapes (plan_exchanges only records
    `shape_of(message)` in each transfer), so the boundary coverage is checked once, with
    the full activation shape."""
    name, p, v, m = case
    schedule = build_all(name, p, v, m)
    plans = plan_exchanges(schedule, p, v, _wire_shapes(2, scatter_gather))
    check_plans(plans)
    if not scatter_gather:
        _assert_covers_every_boundary(plans, schedule, p, v)


@pytest.mark.parametrize("scatter_gather", [False, True])
@pytest.mark.parametrize("name", FLUSHING)
def test_every_schedule_matches_and_completes_under_nccl_rules(name, scatter_gather):
    cases = [case for case in _cases() if case[0] == name]
    assert on_both_cores(_check_flushing, cases, scatter_gather) == len(cases) > 100


def _assert_covers_every_boundary(plans, schedule, p, v):
    """Each rank's steps are its actions in order; every message crossing ranks is sent
    after it is produced and received before it is needed, exactly once each."""
    for rank, (steps, actions) in enumerate(zip(plans, schedule)):
        assert [s.action for s in steps] == actions + [None]
        produced, needed = {}, {}   # message crossing ranks -> position of its action
        rank_of = StageMap(p, v).rank_of   # every flushing schedule's: round-robin
        for i, a in enumerate(actions):
            out, need = produced_message(a, p * v), needed_message(a, p * v)
            if out and rank_of(out.dst) != rank:
                produced[out] = i
            if need and rank_of(need.src) != rank:
                needed[need] = i
        sends = Counter(t.message for s in steps for t in s.exchange if t.send)
        receives = Counter(t.message for s in steps for t in s.exchange if not t.send)
        assert sends == Counter(list(produced)) and receives == Counter(list(needed)), rank
        for k, step in enumerate(steps):
            for t in step.exchange:
                assert produced[t.message] < k if t.send else k <= needed[t.message], (rank, t)


def test_one_f_one_b_pairs_each_send_with_the_next_receive():
    """1F1B p=2 steady state: rank 0 sends activation k+1 and receives gradient k together."""
    plans = plan_exchanges(build_all("1f1b", 2, 1, 4), 2, 1)
    exchanges = [{(t.send, t.message) for t in s.exchange} for s in plans[0]]
    assert {(True, Message(ACTIVATION, 2, 0, 1)), (False, Message(GRADIENT, 1, 1, 0))} in exchanges


def _plan(*rows):
    return [[Step(tuple(ops), None) for ops in row] for row in rows]


def _t(send, peer, mb, shape=(4,)):
    return Transfer(send, peer, Message(ACTIVATION, mb, 0, 1), shape)


def test_checker_names_a_message_order_mismatch():
    plans = _plan([[_t(True, 1, 0), _t(True, 1, 1)]], [[_t(False, 0, 1), _t(False, 0, 0)]])
    with pytest.raises(PlanError, match="ranks 0->1, message 0: rank 0 sends act mb0"):
        check_plans(plans)


def test_checker_names_a_shape_mismatch():
    plans = _plan([[_t(True, 1, 0, (4,))]], [[_t(False, 0, 0, (8,))]])
    with pytest.raises(PlanError, match=r"\[4\] but rank 1 receives act mb0 s0->s1 \[8\]"):
        check_plans(plans)


def test_checker_names_a_missing_receive():
    with pytest.raises(PlanError, match="1 sends but 0 receives"):
        check_plans(_plan([[_t(True, 1, 0)]], [[]]))


def test_checker_finds_the_receive_posted_too_early():
    """Each rank receives, then sends: fine on gloo (buffered sends), a hang under NCCL.
    Posting each rank's send and receive in one exchange completes."""
    grad = Message(GRADIENT, 0, 1, 0)
    recv_grad, send_grad = Transfer(False, 1, grad, (4,)), Transfer(True, 0, grad, (4,))
    with pytest.raises(PlanError, match="rank 0 at exchange 0 .*recv grad mb0 s1->s0 from 1"):
        check_plans(_plan([[recv_grad], [_t(True, 1, 0)]], [[_t(False, 0, 0)], [send_grad]]))
    check_plans(_plan([[recv_grad, _t(True, 1, 0)]], [[_t(False, 0, 0), send_grad]]))
