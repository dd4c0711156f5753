"""The cost model against the source's formulas and its reported results."""

import dataclasses

import pytest

from tests.planner.planner_cases import GPT3_175B, GPT_145B, GPT_1T, GPT_530B, gpt, run
from ptdp.config.catalogue import schedule_spec
from ptdp.planner import comm
from ptdp.planner.compute import layer_times
from ptdp.planner.cost_model import Layout
from ptdp.planner.formulas import model_flops_per_iteration, tensor_parallel_elements_per_layer
from ptdp.planner.memory import gpu_memory, in_flight_layer_stashes, layer_activation_bytes

SMALL = gpt(8, 1024, 16, seq=1024)


def test_tensor_parallel_volume_is_8bsh_per_layer(ideal):
    b, s, h, t = 2, 1024, 1024, 4
    link = comm.tensor_link(ideal, t, 8)
    per_layer = 4 * comm.all_reduce_time(t, b * s * h * 2, link)   # 2 fwd + 2 bwd, bf16
    expected = tensor_parallel_elements_per_layer(b, s, h, t) * 2 / link.bandwidth
    assert per_layer == pytest.approx(expected)
    # A full recompute repeats the 2 forward all-reduces of every layer.
    none = run(ideal, SMALL, 64, Layout(1, t, 2, micro_batch=b, recompute="none"))
    full = run(ideal, SMALL, 64, Layout(1, t, 2, micro_batch=b, recompute="full"))
    m = 64 // (b * 2)
    extra = full.time["tensor_comm"] - none.time["tensor_comm"]
    assert extra == pytest.approx(m * SMALL.layers * expected / 2)


def test_tensor_parallelism_leaves_the_node_at_t_above_gpus_per_node(a100):
    assert comm.tensor_link(a100, 8, 8).intra_node
    inside, outside = comm.tensor_link(a100, 8, 8), comm.tensor_link(a100, 16, 8)
    assert not outside.intra_node and outside.bandwidth < inside.bandwidth


def test_pipeline_exchange_bsh_scatter_gather_and_interleaving(ideal):
    shape, B = gpt(16, 4096, 32), 64
    base = Layout(pipeline=4, tensor=8, data=2, micro_batch=1)   # 4 nodes: p2p on the network
    plain = run(ideal, shape, B, base)
    m = plain.layout.micro_batches(B)
    link = comm.pipeline_link(ideal, 8, 2, 4, 8)
    bsh_bytes = 1 * 2048 * 4096 * 2
    # The source's blocking exchange: both transfers of every micro-batch on the critical path.
    assert plain.time["pipeline_p2p"] == pytest.approx(m * 2 * bsh_bytes / link.bandwidth)
    inter = run(ideal, shape, B, Layout(4, 8, 2, chunks=2, micro_batch=1, schedule="interleaved"))
    assert inter.time["pipeline_p2p"] == pytest.approx(2 * plain.time["pipeline_p2p"])  # x v
    sg = run(ideal, shape, B, Layout(4, 8, 2, micro_batch=1, scatter_gather=True))
    gather = comm.all_gather_time(8, bsh_bytes, comm.intra_link(ideal))
    assert sg.time["pipeline_p2p"] == pytest.approx(m * 2 * (bsh_bytes / 8 / link.bandwidth + gather))
    assert sg.step_time_s < plain.step_time_s
    # ptdp's asynchronous exchange (overlap_pipeline): 2(p-1)/p per micro-batch, not x v.
    overlap = dataclasses.replace(ideal, overlap_pipeline=True)
    assert run(overlap, shape, B, base).time["pipeline_p2p"] == pytest.approx(
        0.75 * plain.time["pipeline_p2p"])
    assert run(overlap, shape, B, inter.layout).time["pipeline_p2p"] == pytest.approx(
        0.75 * plain.time["pipeline_p2p"])


def _simulated_makespan(schedule: str, p: int, m: int, forward: float, backward: float,
                        transfer: float) -> float:
    """A schedule of ptdp/pipeline/schedules.py played out: each rank runs its actions in order, an
    action starts when its rank is free and its inputs have arrived (`transfer` seconds after
    they were produced on another rank). A backward split into B and Wg (1F1B's cooldown)
    takes half of `backward` in each, the planner's t_B = t_W."""
    from ptdp.pipeline.schedules import build_all
    from ptdp.pipeline.actions import dependencies, split_units
    schedule, end, free, nxt = build_all(schedule, p, 1, m), {}, [0.0] * p, [0] * p
    split = split_units(a for row in schedule for a in row)

    def duration(action):
        if action.kind == "F":
            return forward
        halved = action.kind == "Wg" or (action.mb, action.stage) in split
        return backward / 2 if halved else backward

    while any(nxt[r] < len(schedule[r]) for r in range(p)):
        for r in range(p):
            while nxt[r] < len(schedule[r]):
                action = schedule[r][nxt[r]]
                deps = dependencies(action, p, 1)
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] + (transfer if d.stage != action.stage else 0.0)
                                         for d in deps])
                end[action] = free[r] = start + duration(action)
                nxt[r] += 1
    return max(free)


@pytest.mark.parametrize("p,m", [(2, 8), (2, 16), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("share", [0.1, 0.3])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_transfers_overlap_compute_as_the_schedule_played_out(ideal, p, m, share,
                                                                        schedule):
    # A slow pipeline link: one transfer takes `share` of a micro-batch's compute. The planner's
    # compute + transfers + flush equals the schedule played out with asynchronous transfers
    # (within 2 %: the first and last stage's extra work; with every transfer on the critical
    # path it was 10-60 % over).
    shape = gpt(32, 1024, 16, seq=1024, vocab=1024)
    lay = Layout(pipeline=p, micro_batch=1, schedule=schedule)
    ideal = dataclasses.replace(ideal, overlap_pipeline=True)
    act = 1024 * 1024 * 2
    fast = dataclasses.replace(ideal, intra_node_bandwidth_GBps=1e9)
    per_mb = run(fast, shape, m, lay).time["compute"] / m
    slow = dataclasses.replace(ideal, intra_node_bandwidth_GBps=act / (share * per_mb) / 1e9
                               / ideal.efficiency.collective)
    transfer = comm.p2p_time(act, comm.pipeline_link(slow, 1, 1, p, 8))
    assert transfer == pytest.approx(share * per_mb)
    pred = run(slow, shape, m, lay)
    pipeline = pred.time["compute"] + pred.time["pipeline_p2p"] + pred.time["bubble"]
    simulated = _simulated_makespan(schedule, p, m, per_mb / 3, per_mb * 2 / 3, transfer)
    assert pipeline == pytest.approx(simulated, rel=0.02)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2),
                                        ("interleaved", 4), ("2bw", 1)])
def test_bubble(a100, schedule, v):
    """(p-1)/(v m) with whole backwards; 1F1B's and interleaved's cooldown sends input
    gradients first, which takes up to a weight-gradient pass (a third of a micro-batch's
    time at t_b = 2 t_f) off each of the drain's steps."""
    lay = Layout(8, 2, 1, chunks=v, micro_batch=1, schedule=schedule)
    pred = run(a100, gpt(32, 2048, 16, vocab=256), 32, lay)   # tiny vocab: balanced stages
    whole = 0.0 if schedule == "2bw" else 7 / (v * 32)
    if schedule_spec(schedule).split_cooldown:
        assert whole * 2 / 3 <= pred.bubble_fraction < whole * 0.8
    else:
        assert pred.bubble_fraction == pytest.approx(whole)
    # Balanced middle stages: the flush costs (p-1)/v stage-times (L3548, L3633).
    if schedule != "2bw":
        assert pred.time["bubble"] / (pred.time["compute"] + pred.time["tensor_comm"]
                                      + pred.time["pipeline_p2p"]) == pytest.approx(
            pred.bubble_fraction, rel=0.1)


def test_2bw_has_no_flush_and_two_weight_versions(a100):
    flush = run(a100, GPT_145B, 128, Layout(16, 8, 1, micro_batch=1, schedule="1f1b", recompute="full"))
    tbw = run(a100, GPT_145B, 128, Layout(16, 8, 1, micro_batch=1, schedule="2bw", recompute="full"))
    assert tbw.step_time_s < flush.step_time_s
    assert flush.step_time_s - tbw.step_time_s == pytest.approx(flush.time["bubble"])
    kwargs = dict(p=16, t=8, v=1, m=128, b=1, d=1, recompute="full", precision="bf16",
                  attention="flash", vocab_padded=51200, reserved_gb=0.0)
    for rank in (0, 7, 15):
        one, two = (gpu_memory(GPT_145B, schedule=s, rank=rank, **kwargs) for s in ("1f1b", "2bw"))
        assert two.weights == 2 * one.weights                    # two versions (L2314)
        assert two.activations == one.activations                # the same p in flight
        # the batch waiting for its update holds its gradients on all but the first rank
        assert two.gradients == (one.gradients if rank == 0 else 2 * one.gradients)


def test_recomputation_costs_a_third_more_compute(a100):
    # c_extra = 4/3 (L2740): the extra forward is 1/3 of forward + backward.
    pred = run(a100, GPT_145B, 64, Layout(16, 8, 1, micro_batch=1, recompute="full"))
    assert pred.time["recompute"] / pred.time["compute"] == pytest.approx(1 / 3, abs=0.03)
    none = run(a100, GPT_145B, 64, Layout(16, 8, 1, micro_batch=1, recompute="none"))
    # Fig. 4.17: "up to 33% lower throughput" at small batch sizes.
    assert 0.67 <= none.step_time_s / pred.step_time_s <= 0.85


def test_small_gemms_from_large_t_run_less_efficiently(a100):
    shape = gpt(1, 4096, 64)
    one = layer_times(a100, "bf16", shape, 1, 1, "flash")
    per_gpu_work = [layer_times(a100, "bf16", shape, 1, t, "flash").forward * t for t in (1, 2, 4, 8, 16, 32)]
    assert per_gpu_work == sorted(per_gpu_work)
    assert per_gpu_work[-1] > 1.3 * one.forward


def test_eq42_conventions_and_mfu(a100):
    lay = Layout(8, 8, 16, chunks=2, micro_batch=1, schedule="interleaved", recompute="full",
                 scatter_gather=True)
    pred = run(a100, GPT3_175B, 1536, lay)
    flops = model_flops_per_iteration(1536, 2048, 96, 12288, 51200)
    assert pred.tflops_per_gpu * 1e12 * pred.step_time_s * 1024 == pytest.approx(flops)
    assert pred.mfu == pytest.approx(pred.tflops_per_gpu / 312)


@pytest.mark.parametrize("shape,batch,t,p,d,v,reported", [
    (GPT3_175B, 1536, 8, 8, 16, 2, 140),     # Eq. 4.4 example, L4310
    (GPT3_175B, 1536, 8, 12, 4, 2, 153),     # Table 4.2, 384 GPUs
    (GPT3_175B, 1536, 8, 12, 8, 2, 149),     # Table 4.2, 768 GPUs
    (GPT3_175B, 1536, 8, 12, 16, 2, 141),    # Table 4.2, 1536 GPUs
    (GPT_530B, 2240, 8, 35, 2, 3, 171),      # Table 4.2, 560 GPUs
    (GPT_530B, 2240, 8, 35, 8, 3, 159),      # Table 4.2, 2240 GPUs
    (GPT_1T, 3072, 8, 64, 6, 2, 163),        # Eq. 4.4 example, L4316
])
def test_predictions_match_the_source_within_15_percent(a100, shape, batch, t, p, d, v, reported):
    # The source's runs: interleaved + scatter/gather, b = 1, full recomputation, and 2021
    # Megatron kernels that keep the attention scores ("materialized").
    lay = Layout(p, t, d, chunks=v, micro_batch=1, schedule="interleaved", recompute="full",
                 scatter_gather=True)
    pred = run(a100, shape, batch, lay, attention="materialized")
    assert pred.fits
    assert pred.tflops_per_gpu == pytest.approx(reported, rel=0.15)


def test_korthikanti_activation_formula():
    # sbh(10 + 24/t + 5as/(ht)) bytes per layer for f = 4h, 16-bit, dropout, kept scores.
    s, b, h, a = 2048, 1, 12288, 96
    shape = gpt(1, h, a)
    for t in (1, 2, 8):
        got = layer_activation_bytes(shape, b, t, "bf16", "none", "materialized")
        assert got == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    # the paper's selective recomputation: the core attention alone
    sel = layer_activation_bytes(shape, b, 8, "bf16", "selective", "materialized",
                                 modules=("core_attn",))
    assert sel == pytest.approx(s * b * h * (10 + 24 / 8))
    # ptdp's default adds the norms' outputs (4 bytes: the QKV and fc1 inputs) and fc2's
    # input (8/t bytes), ptdp/config/recompute.py
    sel = layer_activation_bytes(shape, b, 8, "bf16", "selective", "materialized")
    assert sel == pytest.approx(s * b * h * (6 + 16 / 8))
    assert layer_activation_bytes(shape, b, 8, "bf16", "full", "materialized") == s * b * h * 2


def test_in_flight_counts_match_the_schedules_module():
    schedules = pytest.importorskip("ptdp.pipeline.schedules")
    for name, p, v, m in [("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 4, 1, 2),
                          ("interleaved", 4, 2, 8), ("interleaved", 2, 4, 4)]:
        for rank in range(p):
            actions = schedules.build_schedule(name, p, v, m, rank)
            stashes = schedules.max_in_flight(actions)  # (micro-batch, chunk) pairs
            assert in_flight_layer_stashes(name, p, v, m, layers_per_rank=v, rank=rank) == stashes


def test_memory_by_schedule_and_recompute(a100):
    shape, B = GPT_145B, 128
    mem = lambda **kw: run(a100, shape, B, Layout(16, 8, 1, micro_batch=1, **kw)).memory  # noqa: E731
    assert mem(schedule="gpipe")["activations"] > 7 * mem(schedule="1f1b")["activations"]
    none, sel, full = (mem(recompute=r)["activations"] for r in ("none", "selective", "full"))
    assert full < sel <= none
    mixed = run(a100, shape, B, Layout(16, 8, 1))
    # 2 bytes of bf16 weights, 4 of fp32 gradients, 12 of fp32 master weights + Adam moments.
    assert mixed.memory["gradients"] == pytest.approx(2 * mixed.memory["weights"], rel=1e-3)
    assert mixed.memory["optimizer"] == pytest.approx(6 * mixed.memory["weights"], rel=1e-3)


def test_tflops_count_the_extra_forward_only_when_it_runs(a100):
    # As the trainer reports it: Eq. 4.2's 4 passes with recompute=full, 3 otherwise.
    for recompute, passes in (("full", True), ("selective", False), ("none", False)):
        lay = Layout(16, 8, 8, micro_batch=1, recompute=recompute)
        pred = run(a100, GPT3_175B, 1536, lay)
        flops = model_flops_per_iteration(1536, 2048, 96, 12288, 51200, recompute_forward=passes)
        assert pred.tflops_per_gpu * 1e12 * pred.step_time_s * 1024 == pytest.approx(flops)


def test_headroom_keeps_a_margin_below_device_memory(a100):
    assert a100.usable_memory_bytes == pytest.approx(0.95 * 80 * 2**30)
    pred = run(a100, GPT3_175B, 1536, Layout(12, 8, 16, chunks=2, micro_batch=1,
                                             schedule="interleaved", scatter_gather=True))
    assert 76 < pred.memory_gb_per_gpu < 80 and not pred.fits


def test_tensor_groups_that_straddle_nodes_pay_the_network(a100):
    # t = 6 on 8-GPU nodes: ranks 6-11 form a group with 2 ranks on node 0 and 4 on node 1,
    # so the collectives of that group (and every group waits for it) cross the network.
    assert comm.crossing_members(6, 1, 8, True) == 2
    assert comm.crossing_members(4, 1, 8, True) is None and comm.crossing_members(8, 1, 8, True) is None
    six, four = comm.tensor_link(a100, 6, 8), comm.tensor_link(a100, 4, 8)
    assert four.intra_node and not six.intra_node
    # Two of the node's 8 NICs' worth of bandwidth: 2/8 of the node's aggregate.
    assert six.bandwidth == pytest.approx(8 * 25e9 * 2 / 8 * a100.efficiency.collective)
    # Data-parallel peers t apart: with t = 6, d = 2 the pair (2, 8) crosses from node 0 to 1.
    assert comm.crossing_members(6, 2, 8, False) == 1
    assert not comm.data_link(a100, 6, 2, 8).intra_node
    assert comm.data_link(a100, 4, 2, 8).intra_node


def test_a_straddling_tensor_group_slows_the_prediction(a100):
    shape = gpt(24, 3072, 24, seq=2048)    # 24 heads: t = 4, 6 and 8 all divide them
    preds = {t: run(a100, shape, 96, Layout(1, t, 48 // t, micro_batch=1), gpus_per_node=8)
                 for t in (4, 6)}
    comm_share = {t: p.time["tensor_comm"] / p.step_time_s for t, p in preds.items()}
    assert comm_share[6] > 3 * comm_share[4]


@pytest.mark.parametrize("p,d,t,gpus_per_node", [(2, 2, 6, 8), (1, 4, 6, 8), (4, 2, 4, 8),
                                                 (2, 3, 2, 4), (3, 2, 8, 8), (2, 8, 1, 8)])
def test_node_crossing_agrees_with_the_trainers_rank_grid(p, d, t, gpus_per_node):
    # The planner's placement against ptdp.parallel.grid's tensor and data groups.
    from ptdp.parallel.grid import axis_rows, grid_layout
    layout = grid_layout(p, d, t)

    def fewest_on_a_node(groups):
        fewest = None
        for ranks in groups:
            nodes = [r // gpus_per_node for r in ranks]
            if len(set(nodes)) > 1:
                fewest = min(min(nodes.count(n) for n in set(nodes)), fewest or gpus_per_node)
        return fewest

    tensor_groups = axis_rows(layout, ["tensor"])
    data_groups = axis_rows(layout, ["data"])
    assert comm.crossing_members(t, 1, gpus_per_node, True) == fewest_on_a_node(tensor_groups)
    assert comm.crossing_members(t, d, gpus_per_node, False) == fewest_on_a_node(data_groups)
