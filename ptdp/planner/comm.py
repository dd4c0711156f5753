"""Where each communication runs (NVLink or network) and how long a collective takes.

Rank placement follows ptdp.parallel.grid: the rank array is reshaped to (p, d, t), so
tensor-parallel groups are t consecutive ranks, data-parallel peers are t apart and pipeline
neighbours are t*d apart. Nodes hold G consecutive ranks. A group is on NVLink only when it
lies inside one node: a span that fits is not enough (with t = 6 on 8-GPU nodes the second
tensor group is ranks 6-11, two on node 0 and four on node 1), so the groups are placed
explicitly and one that crosses a node boundary makes the collective run at network speed
(every group waits for the slowest in the next pipeline step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ptdp.config import padded_vocab_size
from ptdp.hardware import HardwareProfile
from ptdp.planner.compute import BYTES, measured_tensor_comm, recompute_collectives
from ptdp.planner.formulas import context_shape


@dataclass(frozen=True)
class Link:
    bandwidth: float   # bytes/s achievable by one GPU
    latency: float     # seconds per message / ring step
    intra_node: bool


def intra_link(hw: HardwareProfile) -> Link:
    return Link(hw.intra_node_bandwidth_GBps * 1e9 * hw.efficiency.collective,
                hw.intra_node_latency_us * 1e-6, True)


def inter_link(hw: HardwareProfile, members_per_node: int = 1) -> Link:
    """A group that leaves the node. Its k members on one node share the node's NICs with
    the node's other G/k groups, which run the same collective at the same time. A ring
    crosses the node boundary once per channel, so the group's bus bandwidth is the NIC
    share k/G of the node's aggregate (e.g. t=8 on DGX A100: 1 NIC, 25 GB/s; t=1: all 8)."""
    share = min(hw.nics_per_node, hw.gpus_per_node) * members_per_node / hw.gpus_per_node
    bandwidth = min(hw.inter_node_bandwidth_GBps * share, hw.intra_node_bandwidth_GBps)
    return Link(bandwidth * 1e9 * hw.efficiency.collective, hw.inter_node_latency_us * 1e-6, False)


def group_link(hw: HardwareProfile, span: int, gpus_per_node: int, members_per_node: int = 1) -> Link:
    """A group whose ranks lie within `span` consecutive ranks starting at a node boundary."""
    return intra_link(hw) if span <= gpus_per_node else inter_link(hw, members_per_node)


@lru_cache(maxsize=4096)
def crossing_members(t: int, d: int, gpus_per_node: int, tensor: bool) -> int | None:
    """None when every tensor (tensor=True) or data-parallel group of a (p, d, t) grid lies
    inside one node; else the fewest members a node-crossing group has on one node (its share
    of that node's NICs). The placement repeats every lcm(t*d, G) ranks, so one period shows
    every case (a job of more than G ranks always holds the group that straddles the first
    node boundary)."""
    g = gpus_per_node
    period = math.lcm(t * d, g)
    if tensor:
        groups = [range(start, start + t) for start in range(0, period, t)]
    else:
        groups = [range(stage + tt, stage + t * d, t)
                  for stage in range(0, period, t * d) for tt in range(t)]
    fewest = None
    for ranks in groups:
        per_node: dict[int, int] = {}
        for rank in ranks:
            per_node[rank // g] = per_node.get(rank // g, 0) + 1
        if len(per_node) > 1:
            fewest = min(min(per_node.values()), fewest or g)
    return fewest


def busy_node(hw: HardwareProfile, ranks: int | None) -> dict | None:
    """The profile's `measured.busy` row (ptdp/profiler/collectives.py) for a node running `ranks`
    ranks at once: the measured world nearest on a log scale. None without measurements."""
    rows = (hw.measured or {}).get("busy") or []
    if not rows or not ranks or ranks < 2:
        return None
    return min(rows, key=lambda r: (abs(math.log2(r["ranks"] / ranks)), -r["ranks"]))


def _measured(row: dict, n: int, kind: str) -> Link:
    """The busy row's fit for a `kind` collective in groups of n (profiles written before
    reduce-scatter and all-gather were measured on their own have all-reduce only)."""
    fits = row.get(kind) or row["all_reduce"]
    fit = min(fits, key=lambda r: abs(math.log2(r["group"] / n)))
    return Link(fit["bandwidth_GBps"] * 1e9, fit["latency_us"] * 1e-6, True)


def tensor_link(hw, t: int, gpus_per_node: int, busy: int | None = None,
                kind: str = "all_reduce") -> Link:
    """Tensor groups are t consecutive ranks: inside a node when t divides G (a one-node job
    passes its own size as G). Inside a node, a profile measured busy (CPU ranks) gives the
    rate its groups of t achieved for a `kind` collective while `busy` ranks ran at once."""
    crossing = crossing_members(t, 1, gpus_per_node, True)
    if crossing is not None:
        return inter_link(hw, crossing)
    row = busy_node(hw, busy)
    return _measured(row, t, kind) if row else intra_link(hw)


def data_link(hw, t: int, d: int, gpus_per_node: int, busy: int | None = None,
              kind: str = "all_reduce") -> Link:
    """Data-parallel peers are t ranks apart; those of a node share its NICs."""
    crossing = crossing_members(t, d, gpus_per_node, False)
    if crossing is not None:
        return inter_link(hw, crossing)
    row = busy_node(hw, busy)
    return _measured(row, d, kind) if row else intra_link(hw)


def pipeline_link(hw, t: int, d: int, p: int, gpus_per_node: int,
                  busy: int | None = None) -> Link:
    """The slowest stage boundary: on the network as soon as the pipeline leaves one node,
    where every GPU of the node sends to its peer at once (one NIC share each)."""
    link = group_link(hw, t * d * p, gpus_per_node)
    if not link.intra_node:
        return link
    # A profile measured on this machine knows its own p2p rate, busy or idle.
    row = busy_node(hw, busy)
    p2p = row["p2p"] if row else (hw.measured or {}).get("p2p")
    if p2p:
        return Link(p2p["bandwidth_GBps"] * 1e9, p2p["latency_us"] * 1e-6, True)
    return link


def context_link(hw, t: int, c: int, gpus_per_node: int, busy: int | None = None) -> Link:
    """A context ring's neighbours are t ranks apart (the grid is (p, d, c, t)): on the network
    when a ring straddles nodes (a node's members share its NICs), else the node's point-to-point
    rate (measured, busy or idle, when the profile has it)."""
    crossing = crossing_members(t, c, gpus_per_node, False)
    if crossing is not None:
        return inter_link(hw, crossing)
    row = busy_node(hw, busy)
    p2p = row["p2p"] if row else (hw.measured or {}).get("p2p")
    if p2p:
        return Link(p2p["bandwidth_GBps"] * 1e9, p2p["latency_us"] * 1e-6, True)
    return intra_link(hw)


def all_reduce_time(n: int, nbytes: float, link: Link) -> float:
    """Ring all-reduce: every rank sends and receives 2(n-1)/n of the buffer."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def all_gather_time(n: int, nbytes_total: float, link: Link) -> float:
    """Ring all-gather of a buffer of `nbytes_total` (each rank holds 1/n of it)."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes_total / link.bandwidth + (n - 1) * link.latency


def reduce_scatter_time(n: int, nbytes_total: float, link: Link) -> float:
    """Ring reduce-scatter of a buffer of `nbytes_total` (each rank keeps 1/n of the sum)."""
    return all_gather_time(n, nbytes_total, link)


def p2p_time(nbytes: float, link: Link) -> float:
    return nbytes / link.bandwidth + link.latency


def expert_link(hw, t: int, e: int, gpus_per_node: int, busy: int | None = None) -> Link:
    """An expert group: e ranks t apart (folded out of data x context, Megatron's order: tensor
    fastest, then context, data, pipeline), so the groups tile blocks of t*e consecutive ranks,
    like data-parallel groups of e: on the network when a block straddles nodes."""
    return data_link(hw, t, e, gpus_per_node, busy, "all_to_all")


def all_to_all_time(n: int, nbytes: float, link: Link) -> float:
    """An all-to-all where each rank sends `nbytes` in all, 1/n of it to each peer (balanced
    routing): (n-1)/n of it leaves the rank, in n-1 messages."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def layer_tensor_comm(hw: HardwareProfile, work, lay, act_bytes: float,
                      all_reduce: float, busy: int) -> float:
    """Seconds of one layer's tensor-parallel communication per micro-batch: measured inside
    a layer on this many busy ranks when the profile has it (CPU ranks, where it is several
    times the collectives' own cost), else 2 all-reduces forward and 2 backward (more to
    recompute: compute.recompute_collectives), or with sequence parallelism an all-gather +
    reduce-scatter for each. `work` and `lay`: cost_model.py's Workload and Layout."""
    t, extra = lay.tensor, recompute_collectives(lay.recompute, lay.recompute_modules)
    if t == 1:
        return 0.0
    inside_node = crossing_members(t, 1, work.gpus_per_node, True) is None
    local = context_shape(work.shape, lay.context)
    measured = measured_tensor_comm(hw, work.precision, local, lay.micro_batch, t,
                                    lay.sequence_parallel, busy) if inside_node else None
    if measured is not None:   # forward and backward each half of it
        return measured * (1 + extra / 4)
    collectives = 4 + extra
    if not lay.sequence_parallel:
        return collectives * all_reduce
    gather = all_gather_time(t, act_bytes, tensor_link(
        hw, t, work.gpus_per_node, busy, "all_gather"))
    scatter = reduce_scatter_time(t, act_bytes, tensor_link(
        hw, t, work.gpus_per_node, busy, "reduce_scatter"))
    return collectives * (gather + scatter)


def distributed_optimizer_comm(hw, work, lay, params: float,
                               busy: int | None = None) -> tuple[float, float]:
    """(reduce-scatter, all-gather) seconds of the distributed optimizer, which splits the
    data-parallel all-reduce in its two halves: the fp32 gradients are reduce-scattered during
    backward (overlapped like the all-reduce; the tied embedding's bucket stays all-reduced),
    the updated weights all-gathered in the model's precision after the step (exposed: the
    trainer waits for them). `work` and `lay`: cost_model.py's Workload and Layout."""
    d, t, p = lay.replicas, lay.tensor, lay.pipeline
    link = lambda kind: data_link(hw, t, d, work.gpus_per_node, busy, kind)  # noqa: E731
    tied = p > 1 and work.shape.word_table_on_last_stage
    table = padded_vocab_size(work.shape.vocab, t) * work.shape.hidden / t if tied else 0.0
    reduce = (reduce_scatter_time(d, (params - table) * 4, link("reduce_scatter"))
              + all_reduce_time(d, table * 4, link("all_reduce")))
    return reduce, all_gather_time(d, params * BYTES[work.precision], link("all_gather"))
