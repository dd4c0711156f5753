"""Context parallelism (parallel.context = c) equals the single-process run.

The layouts of the issue, (p, t, c, d) = (1, 1, 2, 1), (1, 2, 2, 1), (2, 1, 2, 1), (2, 2, 2, 1),
(1, 1, 4, 2), for GPT and the Llama-style decoder (grouped-query attention: 2 K/V heads), every
run with both the pipeline's and the ring's exchanges under NCCL's rules (the in-order
transport of tests/pipeline/nccl_rules.py); plus the pure pieces (grid order, chunk placement,
the ring's exchange lists) and ring attention alone against whole-sequence attention.
Runs of one world size share one spawned job.
"""

import functools

import pytest
import torch

from ptdp.config import ConfigError, load_config
from ptdp.parallel.context import (chunk_ids, context_shard, context_unshard, local_positions,
                                   ring_exchange)
from ptdp.parallel.grid import Coordinates, coordinates_of, group_rows
from ptdp.parallel.ring_attention import DIAGONAL, visible_blocks
from ptdp.runtime.local_ranks import run_on_ranks
from tests.equivalence import MODELS, TINY, assert_equivalent, reference, run_layouts

ARCHS = ("gpt", "llama")


# ---------------------------------------------------------------------------- pure pieces


def test_rank_order_is_tensor_then_context_then_data_then_pipeline():
    p, d, c, t = 2, 2, 2, 2
    coords = [coordinates_of(r, p, d, t, c) for r in range(16)]
    assert coords[:5] == [Coordinates(0, 0, 0, 0), Coordinates(0, 0, 1, 0), Coordinates(0, 0, 0, 1),
                          Coordinates(0, 0, 1, 1), Coordinates(0, 1, 0, 0)]
    assert coords[8] == Coordinates(1, 0, 0, 0)
    rows = group_rows(p, d, t, c)
    assert rows["tensor"][0] == [0, 1] and rows["context"][0] == [0, 2]
    assert rows["data"][0] == [0, 4] and rows["pipeline"][0] == [0, 8]
    assert rows["replica"][0] == [0, 2, 4, 6]   # same (p, t): data x context
    assert group_rows(2, 2, 2) == group_rows(2, 2, 2, 1)   # c = 1: the (p, d, t) grid
    assert str(coords[3]) == "(p=0, d=0, c=1, t=1)" and str(coordinates_of(3, 2, 2, 2)) == \
        "(p=0, d=1, t=1)"


@pytest.mark.parametrize("c", [1, 2, 4])
def test_chunks_split_the_sequence_and_balance_causal_work(c):
    s = 8 * c
    tokens = torch.arange(s)[None].expand(3, s)
    parts = [context_shard(tokens, 1, r, c) for r in range(c)]
    assert torch.equal(context_unshard(parts, 1), tokens)
    for r in range(c):   # positions follow the chunks
        assert torch.equal(local_positions(s // c, r, c), parts[r][0])
    # causal attention over 2c chunks is (2c)^2 / 2 chunk-sized blocks of work (a diagonal
    # block counts half); over the whole ring every rank does the same share, 2c
    work = []
    for r in range(c):
        blocks = [b for src in range(c)
                  for b in visible_blocks(chunk_ids(r, c), chunk_ids(src, c), causal=True)]
        work.append(sum(0.5 if kind == DIAGONAL else 1 for _, _, kind in blocks))
    assert work == [2 * c] * c and sum(work) == (2 * c) ** 2 / 2


@pytest.mark.parametrize("c", [2, 3, 4])
def test_ring_exchanges_pair_up_in_order(c):
    """What rank i sends to i+1 at each step is, in order, what rank i+1 receives from i."""
    for step in range(c + 1):
        kinds = {0: None, 1: None} if 0 < step < c - 1 else {1 if step else 0: None}
        for rank in range(c):
            sent = [t.message for t in ring_exchange(step, rank, c, kinds) if t.send]
            nxt = (rank + 1) % c
            received = [t.message for t in ring_exchange(step, nxt, c, kinds) if not t.send]
            assert sent == received and all(m.src == rank and m.dst == nxt for m in sent)


def _errors(overrides: list[str], world: int = 4) -> list[str]:
    try:
        load_config(None, TINY + overrides, world_size=world)
    except ConfigError as err:
        return err.errors
    return []


def test_config_errors_name_the_keys():
    assert _errors(["parallel.context=2"], 2) == []
    assert _errors(["parallel.context=2"], 8)[0:0] == [] and \
        load_config(None, TINY + ["parallel.context=2"], world_size=8).parallel.data == 4
    (line,) = _errors(["parallel.context=3"], 3)
    assert "parallel.context=3 needs model.seq_length (16) divisible by 2 * parallel.context" in line
    (line,) = _errors(["parallel.context=2", "parallel.tensor=2",
                       "parallel.sequence_parallel=true", "model.seq_length=20"], 4)
    assert "parallel.context=2 needs model.seq_length (20) divisible by 2 * parallel.context * " \
           "parallel.tensor = 2 * 2 * 2 = 8" in line
    (line,) = _errors(["parallel.context=2", "model.arch=bert"], 2)
    assert line.startswith("parallel.context=2 supports model.arch=gpt only")
    (line,) = _errors(["parallel.context=2", "model.dropout=0.1"], 2)
    assert line.startswith("parallel.context=2 needs model.dropout=0")
    (line,) = _errors(["parallel.context=2", "parallel.tensor=2"], 2)
    assert "parallel.pipeline * parallel.tensor * parallel.context = 1 * 2 * 2" in line
    assert _errors(["parallel.context=0"], 2) == ["parallel.context must be >= 1, got 0"]


# ---------------------------------------------------------------------------- the ring alone


def _ring_job() -> dict:
    """Ring attention on context groups of 2 and 4 (of 4 ranks), fused CPU blocks and the
    math path, under the in-order transport; relative errors against whole-sequence SDPA."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from ptdp.parallel import ring_attention as ring
    from ptdp.parallel.context import ContextParallel
    from tests.pipeline.nccl_rules import InOrderTransport
    rank, out = dist.get_rank(), {}
    groups = {}
    for c in (2, 4):
        for start in range(0, 4, c):
            ranks = list(range(start, start + c))
            group = dist.new_group(ranks)
            if rank in ranks:
                groups[c] = (group, ranks)
    for fused in (True, False):
        ring.FUSED_CPU = fused
        for c, (group, ranks) in groups.items():
            for heads, kv_heads, causal in ((4, 4, True), (4, 2, True), (4, 1, False)):
                torch.manual_seed(0)
                q = torch.randn(2, heads, 16, 8, requires_grad=True)
                k, v = (torch.randn(2, kv_heads, 16, 8, requires_grad=True) for _ in range(2))
                whole = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                       enable_gqa=kv_heads != heads)
                dout = torch.randn_like(whole)
                whole.backward(dout)
                cp = ContextParallel(group, ranks.index(rank), c, ranks,
                                     transport=InOrderTransport(group))
                mine = lambda x: context_shard(x.detach(), 2, cp.rank, c)  # noqa: E731
                ql, kl, vl = (mine(x).requires_grad_() for x in (q, k, v))
                local = ring.ring_attention(ql, kl, vl, cp, causal)
                local.backward(mine(dout))
                out[(fused, c, kv_heads, causal)] = max(
                    ((got - mine(want)).norm() / mine(want).norm()).item()
                    for got, want in ((local, whole), (ql.grad, q.grad), (kl.grad, k.grad),
                                      (vl.grad, v.grad)))
    ring.FUSED_CPU = True
    return out


def test_ring_attention_equals_whole_sequence_attention():
    """Outputs and dQ, dK, dV of c = 2 and 4 rings (fused and math blocks; 4, 2 and 1 K/V
    heads; causal and bidirectional) equal attention over the whole sequence to fp32 round-off."""
    for rank, errors in enumerate(run_on_ranks(4, _ring_job, timeout_s=120)):
        worst = max(errors, key=errors.get)
        assert errors[worst] < 2e-6, (rank, worst, errors[worst])


# ---------------------------------------------------------------------------- the trainer

# (p, t, c, d) -> overrides; the five layouts
LAYOUTS = {
    (1, 1, 2, 1): ["parallel.context=2"],
    (1, 2, 2, 1): ["parallel.tensor=2", "parallel.context=2"],
    (2, 1, 2, 1): ["parallel.pipeline=2", "parallel.context=2"],
    (2, 2, 2, 1): ["parallel.pipeline=2", "parallel.tensor=2", "parallel.context=2"],
    (1, 1, 4, 2): ["parallel.context=4", "parallel.data=2"],
}


def _world(layout: tuple) -> int:
    p, t, c, d = layout
    return p * t * c * d


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    keys = [(layout, arch) for layout in LAYOUTS if _world(layout) == world for arch in ARCHS]
    results = run_layouts(world, [[*MODELS[arch], *LAYOUTS[layout]] for layout, arch in keys],
                          timeout_s=400, nccl_rules=True)
    return dict(zip(keys, results))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda l: "p{}-t{}-c{}-d{}".format(*l))
def test_context_layouts_match_single_process(layout, arch):
    ranks = _results(_world(layout))[(layout, arch)]
    for rank in ranks:
        assert_equivalent(rank, reference(arch), f"{arch} {layout}")
        assert rank["ring_batches"] > 0   # the ring ran under the in-order transport


@pytest.mark.parametrize("layout", [(1, 1, 2, 1), (1, 2, 2, 1), (1, 1, 4, 2)],
                         ids=lambda l: "p{}-t{}-c{}-d{}".format(*l))
def test_ring_bytes_per_layer(layout):
    """Per layer and micro-batch a rank sends c-1 K/V blocks forward, and c-1 K/V blocks plus
    c dK/dV blocks backward; a block is 2 * b * (s/c) * (kv_heads/t) * head_dim fp32 values."""
    p, t, c, d = layout
    b, s, layers, iters, head_dim = 2, 16, 8, 3, 8
    m = 8 // (b * d)
    for arch, kv_heads in (("gpt", 4), ("llama", 2)):
        block = 2 * b * (s // c) * (kv_heads // t) * head_dim * 4
        for rank in _results(_world(layout))[(layout, arch)]:
            assert rank["ring_bytes"] == iters * m * layers * (3 * c - 2) * block, (arch, rank)
