"""The CPU side of the cost model: what `ptdp profile` measured on a busy node (several ranks
computing and communicating at once) is what the planner charges."""

import dataclasses

import pytest

from ptdp.hardware import load_hardware
from ptdp.planner import comm
from ptdp.planner.compute import ModelShape
from ptdp.planner.cost_model import Layout, Workload, predict
from ptdp.planner.memory import GB, layer_activation_bytes
from ptdp.profiler.calibration import reserve_and_retention

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


def test_the_fill_and_drain_share_the_cores_with_the_stages_at_work(cpu):
    # 8 ranks as p = 4 stages of 2. With a of 4 stages at work their ranks are time-sliced
    # max(1, TS * a / 4) (TS at full occupancy); the contention stays. The fill and drain cost
    # what a wave of m + p - 1 steps (a = 1, 2, 3, 4, 3, 2, 1 for m = 4) adds to m steps at TS.
    work, lay = Workload(SHAPE, 8, "fp32", 8), Layout(4, 1, 2, micro_batch=1)
    fast_p2p = [{**row, "p2p": {"bandwidth_GBps": 1e9, "latency_us": 0.0}} for row in BUSY]

    def bubble(slowdown, contention, schedule="1f1b"):
        rows = [{**row, "slowdown": slowdown, "contention": contention} if row["ranks"] == 8
                else row for row in fast_p2p]
        hw = dataclasses.replace(cpu, measured={"threads": 1, "busy": rows})
        return predict(hw, work, dataclasses.replace(lay, schedule=schedule)).time["bubble"]

    def wave(ts, m=4, p=4):
        return sum(max(1.0, ts * min(k, p, m, m + p - k) / p) for k in range(1, m + p)) - m * ts

    # No time slicing (contention = slowdown): 3 steps at the full slowdown, as on GPUs.
    assert wave(1.0) == 3.0
    # TS = 2: the steps with one or two stages at work run unsliced: a third of a step is left.
    assert wave(2.0) == pytest.approx(1.0)
    assert bubble(2.2, 2.2) / bubble(2.2, 1.1) == pytest.approx(3 * 2.2 / (1.0 * 1.1), rel=1e-6)
    # TS = 4: one stage's ranks alone fill the 2 cores; the cores never idle, nor does the bubble
    # cost compute time.
    assert wave(4.0) == 0.0 and bubble(4.4, 1.1) < 1e-6 * bubble(4.4, 4.4)
    # zb-h1's smaller bubble (its forward and input-gradient passes) shares the cores alike.
    assert bubble(2.2, 2.2, "zb-h1") / bubble(2.2, 1.1, "zb-h1") == pytest.approx(6.0, rel=1e-6)
    assert bubble(4.4, 1.1, "zb-h1") < 1e-6 * bubble(4.4, 4.4, "zb-h1")


def _tensor_rows(comm_s_by_b: dict, world: int, sequence_parallel: bool = False) -> list[dict]:
    return [dict(hidden=SHAPE.hidden, heads=SHAPE.heads, ffn=SHAPE.ffn, seq=SHAPE.seq,
                 precision="fp32", tensor=2, micro_batch=b, world=world,
                 sequence_parallel=sequence_parallel, layer_s=1.0, comm_s=c)
            for b, c in comm_s_by_b.items()]


def test_tensor_comm_is_what_a_layer_measured_on_as_many_busy_ranks(cpu):
    rows = (_tensor_rows({1: 0.010, 2: 0.012, 4: 0.016}, world=2)
            + _tensor_rows({1: 0.030, 2: 0.034}, world=8)
            + _tensor_rows({1: 0.050, 2: 0.050}, world=2, sequence_parallel=True))
    hw = dataclasses.replace(cpu, measured={"threads": 1, "busy": BUSY, "tensor_layers": rows})
    silent = dataclasses.replace(cpu, measured={"threads": 1, "busy": BUSY, "tensor_layers": [
        {**row, "comm_s": 0.0} for row in rows]})
    work = Workload(SHAPE, 8, "fp32", 8)

    def per_layer(lay):   # beyond the embedding's and head's all-reduces, which stay formulas
        extra = predict(hw, work, lay).time["tensor_comm"] - predict(silent, work, lay).time[
            "tensor_comm"]
        return extra / (SHAPE.layers // lay.pipeline * lay.micro_batches(8))

    # 2 ranks busy: world 2's line through b = 1, 2, 4 (exact here), per layer and micro-batch.
    assert per_layer(Layout(1, 2, 1, micro_batch=2)) == pytest.approx(0.012)
    # 8 ranks busy: world 8's rows; recomputing a layer repeats its forward half.
    assert per_layer(Layout(1, 2, 4, micro_batch=1)) == pytest.approx(0.030)
    assert per_layer(Layout(1, 2, 4, micro_batch=1, recompute="full")) == pytest.approx(0.045)
    # Sequence parallelism has its own rows; t = 4 has none and falls back to ring formulas.
    assert per_layer(Layout(2, 2, 1, micro_batch=1, sequence_parallel=True)) == pytest.approx(0.050)
    # A group across nodes runs at the network's rate, not what a layer measured inside one.
    crossing = Workload(SHAPE, 8, "fp32", 1)
    assert predict(hw, crossing, Layout(1, 2, 1, micro_batch=2)).time["tensor_comm"] == \
        predict(silent, crossing, Layout(1, 2, 1, micro_batch=2)).time["tensor_comm"]
    lay = Layout(1, 4, 1, micro_batch=1)
    ring = 4 * comm.all_reduce_time(4, SHAPE.seq * SHAPE.hidden * 4, comm.tensor_link(hw, 4, 8, 4))
    assert per_layer(lay) == 0.0 and predict(hw, work, lay).time["tensor_comm"] > SHAPE.layers * 8 * ring


def test_the_distributed_optimizer_pays_the_measured_reduce_scatter_and_all_gather(cpu):
    def with_rates(reduce_scatter_GBps, all_gather_GBps):
        rows = [{**row, "reduce_scatter": [{"group": 2, "bandwidth_GBps": reduce_scatter_GBps,
                                            "latency_us": 0.0}],
                 "all_gather": [{"group": 2, "bandwidth_GBps": all_gather_GBps, "latency_us": 0.0}]}
                for row in BUSY]
        hw = dataclasses.replace(cpu, measured={"threads": 1, "busy": rows})
        return predict(hw, Workload(SHAPE, 8, "fp32", 8),
                       Layout(1, 1, 2, micro_batch=1, distributed_optimizer=True)).time["dp_allreduce"]

    # On gloo a reduce-scatter runs slower than an all-reduce of the same bytes: the time
    # follows the reduce-scatter's own rate (half the bytes of an all-reduce at a quarter of
    # the rate: twice the time), not the all-reduce's.
    assert with_rates(0.5, 2.0) - with_rates(2.0, 2.0) == pytest.approx(
        3 * (with_rates(2.0, 1e9) - with_rates(1e9, 1e9)), rel=1e-6)


def test_zero_bubble_charges_the_measured_split_backward(cpu):
    layers = [dict(hidden=SHAPE.hidden, heads=SHAPE.heads, ffn=SHAPE.ffn, seq=SHAPE.seq, tensor=1,
                   precision="fp32", micro_batch=1, forward_s=0.01, backward_s=0.02,
                   attention_forward_s=0.001, backward_split_s=split)
              for split in (0.025,)]
    work = Workload(SHAPE, 8, "fp32", 8)
    hw = dataclasses.replace(cpu, measured={"threads": 1, "busy": BUSY, "layers": layers})
    zb = predict(hw, work, Layout(2, 1, 1, micro_batch=1, schedule="zb-h1")).time["compute"]
    plain = predict(hw, work, Layout(2, 1, 1, micro_batch=1)).time["compute"]
    # 2 layers per stage, 8 micro-batches, 5 ms more per layer backward (compute x1.1 busy).
    assert zb - plain == pytest.approx(8 * 2 * 0.005 * 1.1)
    # The trainer's split measured on one rank costs more than the layer's: that is charged.
    hw = dataclasses.replace(hw, measured={**hw.measured, "split_backward_overhead_s": 0.008})
    zb = predict(hw, work, Layout(2, 1, 1, micro_batch=1, schedule="zb-h1")).time["compute"]
    assert zb - plain == pytest.approx(8 * 2 * 0.008 * 1.1)


def test_heap_retention_grows_with_what_a_micro_batch_allocates(cpu):
    work = Workload(SHAPE, 8, "fp32", 8)
    retained = dataclasses.replace(cpu, measured={**cpu.measured, "heap_retention": 1.5})

    def extra(lay):
        return (predict(retained, work, lay).memory_gb_per_gpu
                - predict(cpu, work, lay).memory_gb_per_gpu) * GB

    # 1.5 x one micro-batch's activations of the rank's layers, with or without recompute.
    for b, recompute in ((1, "none"), (4, "none"), (2, "full")):
        lay = Layout(2, 1, 1, micro_batch=b, recompute=recompute)
        per_layer = layer_activation_bytes(SHAPE, b, 1, "fp32", "none", cpu.attention, retained)
        assert extra(lay) == pytest.approx(1.5 * 2 * per_layer)
    # Without a pipeline too: 4 layers on the one rank.
    per_layer = layer_activation_bytes(SHAPE, 4, 1, "fp32", "none", cpu.attention, retained)
    assert extra(Layout(1, 1, 1, micro_batch=4)) == pytest.approx(1.5 * 4 * per_layer)
    # GPUs: their caching allocator is the datasheet reserve's, no term.
    gpu = dataclasses.replace(retained, device="cuda")
    assert predict(gpu, work, Layout(2, 1, 1, micro_batch=4)).memory_gb_per_gpu == pytest.approx(
        predict(dataclasses.replace(gpu, measured=cpu.measured), work,
                Layout(2, 1, 1, micro_batch=4)).memory_gb_per_gpu)


def test_reserve_and_retention_from_the_calibration_runs():
    runs = {"d2": {"excess_gb": 0.36, "activations_gb": 0.016},
            "p2v2": {"excess_gb": 0.37, "activations_gb": 0.008},
            "p2-2bw": {"excess_gb": 0.362, "activations_gb": 0.008},
            "p2-2bw-b4": {"excess_gb": 0.386, "activations_gb": 0.032}}
    fit = reserve_and_retention(runs)
    # 24 MB more excess for 24 MB more activations; the reserve is what p2v2 leaves (0.362;
    # d2 leaves 0.344, the 2BW runs 0.354).
    assert fit["heap_retention"] == pytest.approx(1.0)
    assert fit["reserve_gb"] == pytest.approx(0.362)
    # A pair that shrinks gives no negative retention; without the pair, none.
    shrinking = {**runs, "p2-2bw-b4": {"excess_gb": 0.35, "activations_gb": 0.032}}
    assert reserve_and_retention(shrinking)["heap_retention"] == 0.0
    assert reserve_and_retention({"d2": runs["d2"]}) == {"reserve_gb": 0.36, "heap_retention": 0.0}
