"""Stage placement is the schedule's trait (ptdp/config/stages.py): the catalogue's round-robin,
and a V placement (rank r holds stages r and 2p-1-r) registered for these tests only, which the
builders, the simulator, the communication plan, the timeline pictures and the embedding group
all follow from the spec alone (no torch, no processes)."""

from collections import Counter

import pytest

from ptdp.config import catalogue
from ptdp.config.catalogue import Chunks, ScheduleSpec, embedding_pipeline_ranks, schedule_spec
from ptdp.config.stages import Placement, StageMap
from ptdp.pipeline import gantt, schedules
from ptdp.pipeline.actions import Action, BACKWARD, FORWARD
from ptdp.pipeline.comm_plan import ACTIVATION, check_plans, plan_exchanges
from ptdp.pipeline.flushing import _gpipe
from ptdp.pipeline.simulation import simulate_lists
from ptdp.pipeline.timeline import render_ascii, simulate

V_SCHEDULE = "v-shaped-gpipe"   # GPipe's order over a V placement: a schedule for tests only


@pytest.fixture
def v_spec(monkeypatch):
    """A catalogue entry with the V placement, built by GPipe's (placement-agnostic) builder."""
    spec = ScheduleSpec(V_SCHEDULE, chunks=Chunks.REQUIRED, placement=Placement.V)
    monkeypatch.setitem(catalogue.SCHEDULES, V_SCHEDULE, spec)
    monkeypatch.setitem(schedules._BUILDERS, V_SCHEDULE, schedules._repeat(_gpipe))
    yield spec
    schedules._build_all_cached.cache_clear()


@pytest.mark.parametrize("placement", list(Placement))
@pytest.mark.parametrize("p,v", [(1, 1), (1, 3), (2, 2), (3, 1), (4, 2), (4, 3), (5, 4)])
def test_every_stage_has_one_home_and_the_questions_agree(placement, p, v):
    stages = StageMap(p, v, placement)
    held = [s for rank in range(p) for s in stages.stages_of(rank)]
    assert sorted(held) == list(range(p * v))
    for rank in range(p):
        for chunk, stage in enumerate(stages.stages_of(rank)):
            assert (stages.rank_of(stage), stages.chunk_of(stage)) == (rank, chunk)


def test_looped_and_v_placements():
    assert [StageMap(4, 2).stages_of(r) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    v = StageMap(4, 2, Placement.V)
    assert [v.stages_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [v.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert StageMap(3, 1, Placement.V) == StageMap(3, 1, Placement.V)
    assert StageMap(3, 1, Placement.V).stages_of(2) == StageMap(3, 1).stages_of(2) == (2,)
    with pytest.raises(ValueError, match="no chunk 2 on rank 0"):
        v.stage(0, 2)
    with pytest.raises(ValueError, match="no stage -1 with p=4, v=2"):
        v.rank_of(-1)


def test_every_catalogued_schedule_keeps_round_robin_and_the_first_and_last_rank():
    for name in catalogue.NAMES:
        spec = schedule_spec(name)
        assert spec.placement is Placement.LOOPED, name
        for p in range(1, 9):
            # RankGrid's embedding group today: pipeline ranks 0 and p-1 (0 alone for p = 1)
            assert embedding_pipeline_ranks(spec, p, 2) == ((0, p - 1) if p > 1 else (0,))


def test_v_placement_puts_rank_0_alone_in_the_embedding_group(v_spec):
    for p in range(1, 9):
        assert embedding_pipeline_ranks(v_spec, p, 2) == (0,)
    assert embedding_pipeline_ranks(v_spec, 4, 3) == (0, 3)   # an odd count of chunks ends low


@pytest.mark.parametrize("p", [2, 3, 4])
def test_a_v_schedule_builds_simulates_and_plans_from_its_spec(v_spec, p):
    m = 2 * p
    rows = schedules.build_all(V_SCHEDULE, p, 2, m)
    for rank, row in enumerate(rows):
        assert {a.stage for a in row} == {rank, 2 * p - 1 - rank}
        assert Counter(a.kind for a in row) == {FORWARD: 2 * m, BACKWARD: 2 * m}
    timeline = simulate(V_SCHEDULE, p, 2, m)   # raises DeadlockError if a rank gets stuck
    assert timeline.stages == StageMap(p, 2, Placement.V)
    assert [len(row) for row in timeline.ranks] == [4 * m] * p
    # the round-robin placement refuses the same lists: stage 2p-1 is not rank 0's there
    with pytest.raises(ValueError, match=f"rank 0: F0@s{2 * p - 1} belongs to rank {p - 1}"):
        simulate_lists(rows, p, 2, m)

    plans = plan_exchanges(rows, p, 2, placement=v_spec.placement)
    check_plans(plans)
    sent = [t.message for steps in plans for step in steps for t in step.exchange if t.send]
    # 2p-1 stage boundaries, each crossed by an activation and a gradient per micro-batch,
    # except the turn of the V (stage p-1 to p), which stays on rank p-1
    assert len(sent) == len(set(sent)) == 2 * m * (2 * p - 2)
    assert not any({t.src, t.dst} == {p - 1, p} for t in sent)
    assert (sum(t.kind == ACTIVATION for t in sent), sum(t.kind != ACTIVATION for t in sent)) == (
        m * (2 * p - 2), m * (2 * p - 2))


def test_the_pictures_label_a_v_schedules_chunks(v_spec):
    timeline = simulate(V_SCHEDULE, 2, 2, 2)
    art = render_ascii(timeline).splitlines()
    # rank 0 holds stages 0 (chunk 0) and 3 (chunk 1): its forwards of chunk 1 are stage 3's
    assert art[1].startswith("rank 0 |F0.0|F1.0|") and "F0.1|F1.1|B0.1" in art[1]
    lanes = gantt.lanes_from_simulation(timeline)
    chunk_of_box = {(lane.label, box.name): box.chunk for lane in lanes for box in lane.boxes}
    assert chunk_of_box[("rank 0", str(Action(FORWARD, 0, 3)))] == 1
    assert chunk_of_box[("rank 1", str(Action(FORWARD, 0, 2)))] == 1
    assert chunk_of_box[("rank 1", str(Action(BACKWARD, 1, 1)))] == 0
