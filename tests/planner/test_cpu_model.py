"""The CPU side of the cost model: what `ptdp profile` measured on a busy node (several ranks
computing and communicating at once) is what the planner charges."""

import dataclasses

import pytest

from ptdp.hardware import load_hardware
from ptdp.planner import comm
from ptdp.planner.compute import ModelShape
from ptdp.planner.cost_model import Layout, Workload, predict

BUSY = [{"ranks": 2, "slowdown": 1.1, "contention": 1.1,
         "all_reduce": [{"group": 2, "bandwidth_GBps": 2.0, "latency_us": 50.0}],
         "p2p": {"bandwidth_GBps": 4.0, "latency_us": 20.0}},
        {"ranks": 8, "slowdown": 4.4, "contention": 1.1,
         "all_reduce": [{"group": 2, "bandwidth_GBps": 0.5, "latency_us": 400.0},
                        {"group": 8, "bandwidth_GBps": 0.25, "latency_us": 900.0}],
         "p2p": {"bandwidth_GBps": 0.4, "latency_us": 300.0}}]
SHAPE = ModelShape("gpt", 4, 64, 4, 256, 32, 100, False)


@pytest.fixture
def cpu():
    hw = load_hardware("h100-80gb")   # any complete profile, turned into 2 cores
    return dataclasses.replace(hw, device="cpu", compute_units=2, overlap_communication=False,
                               measured={"threads": 1, "busy": BUSY})


def test_collectives_take_the_rate_measured_with_as_many_ranks_busy(cpu):
    link = comm.tensor_link(cpu, 2, 8, busy=8)
    assert link.bandwidth == 0.5e9 and link.latency == pytest.approx(400e-6)
    assert comm.tensor_link(cpu, 2, 8, busy=2).bandwidth == 2.0e9
    assert comm.data_link(cpu, 1, 8, 8, busy=8).bandwidth == 0.25e9
    assert comm.pipeline_link(cpu, 1, 2, 4, 8, busy=8).bandwidth == 0.4e9
    # 4 ranks: the nearest measured world on a log scale is equidistant; the larger is taken.
    assert comm.busy_node(cpu, 4)["ranks"] == 8 and comm.busy_node(cpu, 1) is None


def test_compute_slows_down_by_the_measured_factor(cpu):
    work = Workload(SHAPE, 8, "fp32", 8)
    one = predict(cpu, work, Layout(1, 1, 1, micro_batch=1))
    eight = predict(cpu, work, Layout(1, 1, 8, micro_batch=1))
    # d = 8 does 1/8 of the micro-batches per rank, each 4.4x slower.
    assert eight.time["compute"] == pytest.approx(one.time["compute"] / 8 * 4.4)


def test_the_bubble_is_paid_without_time_slicing(cpu):
    # Ranks idle in fill and drain leave their cores to the others: the flush runs at the
    # contention slowdown (1.1), not at 4.4 = 4 (8 ranks on 2 cores) x 1.1.
    work, lay = Workload(SHAPE, 8, "fp32", 8), Layout(4, 1, 2, micro_batch=1)
    fast_p2p = [{**row, "p2p": {"bandwidth_GBps": 1e9, "latency_us": 0.0}} for row in BUSY]

    def bubble(contention):
        rows = [{**row, "contention": contention if row["ranks"] == 8 else row["contention"]}
                for row in fast_p2p]
        hw = dataclasses.replace(cpu, measured={"threads": 1, "busy": rows})
        return predict(hw, work, lay).time["bubble"]

    # contention = slowdown: no time slicing to remove, the bubble keeps the full slowdown.
    assert bubble(4.4) / bubble(1.1) == pytest.approx(4.0, rel=1e-3)
