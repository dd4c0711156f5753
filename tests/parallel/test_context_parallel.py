"""Context parallelism (parallel.context = c) equals the single-process run.

The layouts of the issue, (p, t, c, d) = (1, 1, 2, 1), (1, 2, 2, 1), (2, 1, 2, 1), (2, 2, 2, 1),
(1, 1, 4, 2), for GPT and the Llama-style decoder (grouped-query attention: 2 K/V heads), every
run with both the pipeline's and the ring's exchanges under NCCL's rules (the in-order
transport of tests/pipeline/nccl_rules.py); plus the pure pieces (grid order, chunk placement,
the ring's exchange lists) and ring attention alone against whole-sequence attention (with
document masks and sliding windows too; the trainer with both under context parallelism is
tests/data/test_eod_layouts.py's).
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
from tests.deadline import within
from tests.equivalence import (ITERS, MODELS, RTOL, TINY, assert_equivalent, reference,
                               relative_error)

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
    assert _errors(["parallel.context=2"], 8) == []
    assert load_config(None, TINY + ["parallel.context=2"], world_size=8).parallel.data == 4
    (line,) = _errors(["parallel.context=3"], 3)
    assert "parallel.context=3 needs model.seq_length (16) divisible by 2 * parallel.context" in line
    (line,) = _errors(["parallel.context=2", "parallel.tensor=2",
                       "parallel.sequence_parallel=true", "model.seq_length=20"], 4)
    assert "parallel.context=2 needs model.seq_length (20) divisible by 2 * parallel.context * " \
           "parallel.tensor = 2 * 2 * 2 = 8" in line
    (line,) = _errors(["parallel.context=2", "model.arch=bert"], 2)
    assert line.startswith("parallel.context=2 supports model.arch=gpt only")
    attention, hidden = _errors(["parallel.context=2", "model.dropout=0.1"], 2)   # both rates
    assert attention.startswith("parallel.context=2 needs model.attention_dropout=0 (got 0.1; ")
    assert hidden.startswith("parallel.context=2 needs model.dropout=0 (got 0.1): context")
    (line,) = _errors(["parallel.context=2", "model.attention_dropout=0.1"], 2)
    assert line.startswith("parallel.context=2 needs model.attention_dropout=0 (got 0.1; ")
    (line,) = _errors(["parallel.context=2", "parallel.tensor=2"], 2)
    assert "parallel.pipeline * parallel.tensor * parallel.context = 1 * 2 * 2" in line
    assert _errors(["parallel.context=0"], 2) == ["parallel.context must be >= 1, got 0"]


# ---------------------------------------------------------------------------- the ring alone


def _ring_job() -> dict:
    """Ring attention on context groups of 2 and 4 (of 4 ranks), fused CPU blocks and the
    math path, under the in-order transport and the real batched one; relative errors against
    whole-sequence SDPA."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from ptdp.models.attention import keep_mask
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
    docs = torch.tensor([[0] * 3 + [1] * 6 + [2] * 7, [0] * 10 + [1] * 6])
    cases = ((4, 4, True, None, None), (4, 2, True, None, None), (4, 1, False, None, None))
    masked = ((4, 2, True, docs, None), (4, 2, True, None, 3), (4, 2, True, docs, 5))
    for fused, in_order in ((True, True), (False, True), (True, False)):
        ring.FUSED_CPU = fused
        for c, (group, ranks) in groups.items():
            for heads, kv_heads, causal, documents, window in cases + (masked if in_order else ()):
                torch.manual_seed(0)
                q = torch.randn(2, heads, 16, 8, requires_grad=True)
                k, v = (torch.randn(2, kv_heads, 16, 8, requires_grad=True) for _ in range(2))
                keep = None if documents is None and window is None else keep_mask(
                    torch.zeros_like(docs) if documents is None else documents, window)[:, None]
                whole = F.scaled_dot_product_attention(q, k, v, attn_mask=keep,
                                                       is_causal=causal and keep is None,
                                                       enable_gqa=kv_heads != heads)
                dout = torch.randn_like(whole)
                whole.backward(dout)
                cp = ContextParallel(group, ranks.index(rank), c, ranks,   # None: batched
                                     transport=InOrderTransport(group) if in_order else None)
                mine = lambda x: context_shard(x.detach(), 2, cp.rank, c)  # noqa: E731
                ql, kl, vl = (mine(x).requires_grad_() for x in (q, k, v))
                local = ring.ring_attention(ql, kl, vl, cp, causal, documents=documents,
                                            window=window)
                local.backward(mine(dout))
                out[(fused, in_order, c, kv_heads, causal, documents is not None, window)] = max(
                    ((got - mine(want)).norm() / mine(want).norm()).item()
                    for got, want in ((local, whole), (ql.grad, q.grad), (kl.grad, k.grad),
                                      (vl.grad, v.grad)))
    ring.FUSED_CPU = True
    return out


def test_ring_attention_equals_whole_sequence_attention(four_ranks):
    """Outputs and dQ, dK, dV of c = 2 and 4 rings (fused and math blocks; 4, 2 and 1 K/V
    heads; causal and bidirectional; packed documents, sliding windows of 3 and 5 tokens, so
    with c = 4's 2-token chunks some blocks are skipped and some masked) equal attention over
    the whole sequence to fp32 round-off (in the job of 4 ranks below)."""
    for rank, errors in enumerate(four_ranks["ring"]):
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
P2C2, T2C2 = LAYOUTS[(2, 1, 2, 1)], LAYOUTS[(1, 2, 2, 1)]
# With everything else (4 ranks): name -> (arch, overrides)
FEATURES = {
    "interleaved": ("gpt", [*P2C2, "parallel.chunks=2", "schedule.name=interleaved"]),
    "zb-h1": ("llama", [*P2C2, "schedule.name=zb-h1"]),
    "gpipe recompute=full": ("gpt", [*P2C2, "schedule.name=gpipe", "train.recompute=full",
                                     "train.recompute_num_layers=2"]),
    "sp distopt selective": ("llama", [*T2C2, "parallel.sequence_parallel=true",
                                       "train.distributed_optimizer=true",
                                       "train.recompute=selective"]),
    "sp distopt gpt": ("gpt", [*T2C2, "parallel.sequence_parallel=true",
                               "train.distributed_optimizer=true"]),
    # the block options (tests/equivalence.py "blocks") with c, t, sequence parallelism, and
    # with zero bubble's deferred weight gradients (the gains 1 + w, the QK-norms)
    "blocks sp": ("blocks", [*T2C2, "parallel.sequence_parallel=true"]),
    "blocks zb-h1": ("blocks", [*P2C2, "schedule.name=zb-h1"]),
}
# PipeDream-2BW changes the update rule: (p, c, d) = (2, 2, 1) must follow it as (2, 1, 2) does
# (which tests/pipeline/test_no_flush.py holds to the single-process simulation of the rule)
TWO_BW = {"2bw c2": [*P2C2, "schedule.name=2bw"],
          "2bw d2": ["parallel.pipeline=2", "parallel.data=2", "schedule.name=2bw"]}
# PipeDream async updates after every micro-batch: (p, c) = (2, 2) must equal (p, c) = (2, 1)
# with the same micro-batches (context parallelism only splits each sequence)
PIPEDREAM = ["schedule.name=pipedream", "train.clip_grad=0"]
NO_FLUSH = {4: {**TWO_BW, "pipedream c2": [*P2C2, *PIPEDREAM]},
            2: {"pipedream c1": ["parallel.pipeline=2", *PIPEDREAM]}}
# Resume across a change of c (Llama-style, 4 ranks): (c, d) = (2, 2) saves; itself, (4, 1),
# (1, 4) and (t, c) = (2, 2) continue from its iteration 2
RESUME = {"c2 d2": ["parallel.context=2", "parallel.data=2"], "c4": ["parallel.context=4"],
          "d4": ["parallel.data=4"], "t2 c2": T2C2}


def _world(layout: tuple) -> int:
    p, t, c, d = layout
    return p * t * c * d


def _job(runs: list, no_flush: dict, resume_root: str | None) -> dict:
    """Every rank: the equivalence runs (tests/equivalence.py), the no-flush runs, and in the
    job of 4 ranks the resumes and the ring alone."""
    from tests.equivalence import train_and_collect
    out = {"runs": train_and_collect(runs, ITERS, nccl_rules=True)}
    for name, overrides in no_flush.items():
        out[name] = _no_flush(overrides)
    if resume_root is not None:
        out["resume"] = _resume(resume_root)
        out["ring"] = _ring_job()
    return out


def _trainer(overrides: list[str]):
    import torch.distributed as dist

    from ptdp.training import Trainer
    from tests.pipeline.nccl_rules import InOrderTransport
    trainer = Trainer(load_config(None, TINY + overrides, world_size=dist.get_world_size()))
    grid = trainer.state.grid
    trainer.pipeline.p2p.transport = InOrderTransport(grid.group("pipeline"))
    if grid.c > 1:
        trainer.state.ctx.cp.transport = InOrderTransport(grid.group("context"))
    return trainer


def _no_flush(overrides: list[str], iters: int = 4) -> dict:
    trainer = _trainer([*MODELS["gpt"], *overrides, f"train.iters={iters}"])
    losses = [trainer.train_step(it).loss for it in range(iters)]
    return {"losses": losses, "weights": trainer.full_state()}


def _resume(root: str) -> dict:
    """(c, d) = (2, 2) for 3 iterations, saving at 2; each RESUME layout continues from 2 for
    the one iteration that shows the loaded weights, data position and Adam moments right
    (its loss, then its update)."""
    save = [f"checkpoint.dir={root}/saved", "checkpoint.save_interval=2", "train.iters=3"]
    load = [f"checkpoint.load={root}/saved/iter_0000002", "train.iters=3"]
    out = {}
    straight = _trainer([*MODELS["llama"], *RESUME["c2 d2"], *save])
    out["straight"] = ([r["loss"] for r in straight.train()], straight.full_state())
    for name, overrides in RESUME.items():
        extra = save if name == "c2 d2" else []   # itself: saving again at 3, as straight did
        trainer = _trainer([*MODELS["llama"], *overrides, *load, *extra])
        out[name] = ([r["loss"] for r in trainer.train()], trainer.full_state())
    return out


@functools.lru_cache(maxsize=None)
def _results(world: int, resume_root: str | None = None) -> dict:
    keys = [(layout, arch) for layout in LAYOUTS if _world(layout) == world for arch in ARCHS]
    runs = [[*MODELS[arch], *LAYOUTS[layout]] for layout, arch in keys]
    if world == 4:
        keys += list(FEATURES)
        runs += [[*MODELS[arch], *overrides] for arch, overrides in FEATURES.values()]
    no_flush = NO_FLUSH.get(world, {})
    per_rank = run_on_ranks(world, _job, runs, no_flush, resume_root if world == 4 else None,
                            timeout_s=within(500))
    out = {key: [rank["runs"][i] for rank in per_rank] for i, key in enumerate(keys)}
    out.update({name: [rank[name] for rank in per_rank] for name in (
        [*no_flush, *(["resume", "ring"] if world == 4 else [])])})
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _results(4, str(tmp_path_factory.mktemp("context-resume")))


def _of(layout: tuple, four: dict) -> dict:
    return four if _world(layout) == 4 else _results(_world(layout))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda l: "p{}-t{}-c{}-d{}".format(*l))
def test_context_layouts_match_single_process(layout, arch, four_ranks):
    for rank in _of(layout, four_ranks)[(layout, arch)]:
        assert_equivalent(rank, reference(arch), f"{arch} {layout}")
        assert rank["ring_batches"] > 0   # the ring ran under the in-order transport


@pytest.mark.parametrize("name", list(FEATURES))
def test_context_with_schedules_sequence_parallelism_distopt_recompute(name, four_ranks):
    """Interleaved 1F1B, ZB-H1, GPipe with full recomputation, sequence parallelism with the
    distributed optimizer (sharded over d*c) and selective recomputation: all exact."""
    arch = FEATURES[name][0]
    for rank in four_ranks[name]:
        assert_equivalent(rank, reference(arch), f"{arch} c=2 {name}")


def test_two_bw_with_context_follows_its_update_rule(four_ranks):
    for got, want in zip(four_ranks["2bw c2"], four_ranks["2bw d2"]):
        assert all(abs(x - y) <= RTOL * abs(y) for x, y in zip(got["losses"], want["losses"]))
        for key, value in want["weights"].items():
            assert relative_error(got["weights"][key], value) <= RTOL, key


def test_pipedream_with_context_equals_it_without(four_ranks):
    want = _results(2)["pipedream c1"][0]
    for got in four_ranks["pipedream c2"]:
        assert all(abs(x - y) <= RTOL * abs(y) for x, y in zip(got["losses"], want["losses"]))
        for key, value in want["weights"].items():
            assert relative_error(got["weights"][key], value) <= RTOL, key


def test_resume_across_a_change_of_context_size(four_ranks):
    """Weights are layout-free and the data position is the iteration: the same layout resumes
    bit for bit, and (c, d) = (4, 1), (1, 4), (t, c) = (2, 2) continue (c, d) = (2, 2)'s run to
    fp32 round-off."""
    for rank in four_ranks["resume"]:
        losses, weights = rank["straight"]
        assert rank["c2 d2"][0] == losses[2:]
        assert all(torch.equal(rank["c2 d2"][1][k], v) for k, v in weights.items())
        for name in ("c4", "d4", "t2 c2"):
            got, got_weights = rank[name]
            assert all(abs(x - y) <= RTOL * abs(y) for x, y in zip(got, losses[2:])), (name, got)
            for key, value in weights.items():
                assert relative_error(got_weights[key], value) <= RTOL, (name, key)


@pytest.mark.parametrize("layout", [(1, 1, 2, 1), (1, 2, 2, 1), (1, 1, 4, 2)],
                         ids=lambda l: "p{}-t{}-c{}-d{}".format(*l))
def test_ring_bytes_per_layer(layout, four_ranks):
    """Per layer and micro-batch a rank sends c-1 K/V blocks forward, and c-1 K/V blocks plus
    c dK/dV blocks backward; a block is 2 * b * (s/c) * (kv_heads/t) * head_dim fp32 values."""
    p, t, c, d = layout
    b, s, layers, iters, head_dim = 2, 16, 8, ITERS, 8
    m = 8 // (b * d)
    for arch, kv_heads in (("gpt", 4), ("llama", 2)):
        block = 2 * b * (s // c) * (kv_heads // t) * head_dim * 4
        for rank in _of(layout, four_ranks)[(layout, arch)]:
            assert rank["ring_bytes"] == iters * m * layers * (3 * c - 2) * block, (arch, rank)
