"""Core attention (models/attention.py) and ring attention's blocks (ptdp/parallel/
ring_attention.py) in one process: the window's definition against Hugging Face's, the CUDA
choices that run on CPU too (expanded grouped K/V with a mask, FlexAttention's mask_mod) against
today's path, the ring's per-block masks and log-sum-exp merge (a ring of one rank runs every
block of both chunks) against SDPA with a dense mask, generation's window mask, the config keys
and the planner's FLOPs. The multi-rank layouts are tests/data/test_eod_layouts.py's and
tests/parallel/test_context_parallel.py's."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from ptdp.config import ConfigError, ModelConfig, load_config
from ptdp.config.validation import validate
from ptdp.models.attention import (attention, attention_mask, decoding_mask,
                                   document_mask, flex_block_mask, keep_mask, mask_mod)
from ptdp.parallel import ring_attention as ring
from ptdp.parallel.context import ContextParallel
from ptdp.planner.formulas import ModelShape, iteration_flops
from tests.optional import needs

DOCS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3],
                     [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2]])


def test_window_is_hugging_face_sliding_window_causal():
    """Key j visible to query i iff j <= i and i - j < window, as transformers' mask function."""
    masking = needs("transformers.masking_utils")
    s, window = 12, 4
    hf = masking.sliding_window_causal_mask_function(window)
    idx = torch.arange(s)
    want = hf(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :])
    got = keep_mask(torch.zeros(1, s, dtype=torch.long), window)[0]
    assert torch.equal(got, want) and got.sum(1).max() == window
    # documents: causal and block-diagonal (Megatron's reset attention mask)
    docs = document_mask(DOCS)
    assert torch.equal(docs[0, 4], torch.tensor([0, 0, 0, 1, 1] + [0] * 11, dtype=torch.bool))


def test_flex_mask_mod_equals_the_dense_mask():
    """What FlexAttention's block mask keeps on CUDA is the CPU path's dense mask."""
    b, s = DOCS.shape
    idx = torch.arange(s)
    for documents, window in ((DOCS, None), (DOCS, 3), (None, 5)):
        keep = mask_mod(documents, window)(torch.arange(b)[:, None, None], 0,
                                           idx[None, :, None], idx[None, None, :])
        want = keep_mask(DOCS if documents is not None else torch.zeros_like(DOCS), window)
        assert torch.equal(keep.expand(b, s, s), want), (documents is not None, window)


def test_flex_block_mask_forward_equals_sdpa():
    """The CUDA path's BlockMask and FlexAttention with grouped-query heads (forward only: the
    CPU build has no FlexAttention backward) against SDPA with the dense mask."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = (x.detach() for x in _qkv())
    for documents, window in ((DOCS, None), (DOCS, 3), (None, 5)):
        block_mask = flex_block_mask(documents, window, DOCS.shape[1], "cpu")
        dense = keep_mask(DOCS if documents is not None else torch.zeros_like(DOCS), window)
        with warnings.catch_warnings():   # eager FlexAttention warns that it is unfused
            warnings.simplefilter("ignore")
            got = flex.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None], enable_gqa=True)
        assert (got - want).abs().max() < 1e-6, (documents is not None, window)


def _qkv(heads=4, groups=2, s=16, b=2, d=8):
    torch.manual_seed(0)
    return (torch.randn(b, heads, s, d, requires_grad=True),
            *(torch.randn(b, groups, s, d, requires_grad=True) for _ in range(2)))


def test_grouped_query_attention_with_a_mask_expanded_equals_enable_gqa():
    """CUDA's choice (K/V expanded to the query heads so a fused kernel takes the mask) gives
    the CPU path's (enable_gqa) outputs and gradients bit for bit."""
    q, k, v = _qkv()
    mask = document_mask(DOCS)[:, None]
    results = []
    for expand in (False, True):
        out = attention(q, k, v, mask, causal=True, expand=expand)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_masks_are_built_once_per_micro_batch_and_only_when_needed():
    assert attention_mask(True, 16, "cpu", windows=(None, 32)) is None   # window >= s: none
    mask = attention_mask(True, 16, "cpu", documents=DOCS, windows=(None, 4, 4))
    assert set(mask.prepared) == {None, 4}
    assert torch.equal(mask.prepared[4][:, 0], keep_mask(DOCS, 4))
    only = attention_mask(True, 16, "cpu", windows=(4,))
    assert torch.equal(only.prepared[4][0, 0], keep_mask(torch.zeros(1, 16, dtype=torch.long),
                                                         4)[0])


@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu", "math"])
def test_ring_blocks_with_documents_and_windows_equal_dense_attention(fused, monkeypatch):
    """A ring of one rank runs both chunks' blocks (full, diagonal, masked) and merges them by
    their log-sum-exp: outputs and gradients equal SDPA with the dense mask to round-off,
    with grouped-query heads, documents, a window, both, and a window past the sequence."""
    monkeypatch.setattr(ring, "FUSED_CPU", fused)
    cases = ((None, None), (DOCS, None), (None, 5), (DOCS, 3), (None, 99))
    for documents, window in cases if fused else cases[2:4]:
        q, k, v = _qkv()
        dense = keep_mask(DOCS if documents is not None else torch.zeros_like(DOCS), window)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None],
                                              enable_gqa=True)
        got = ring.ring_attention(q, k, v, ContextParallel(), True, documents=documents,
                                  window=window)
        dout = torch.randn_like(want)
        pairs = zip((got, *torch.autograd.grad(got, (q, k, v), dout)),
                    (want, *torch.autograd.grad(want, (q, k, v), dout)))
        for a, b in pairs:
            assert (a - b).abs().max() < 2e-6, (documents is not None, window)


def test_ring_skips_blocks_outside_the_window():
    """8 chunks of 2 tokens, window 3: chunk pairs two apart are out of reach (skipped), the
    neighbours masked, the diagonal the kernel's own triangle; with documents all masked."""
    q_chunks, k_chunks = (0, 7), (2, 5)
    assert ring.visible_blocks((4, 7), (2, 5), True, window=3, length=2) == []
    assert ring.visible_blocks((3, 4), (2, 3), True, window=3, length=2) == [
        (0, 0, ring.MASKED), (0, 1, ring.DIAGONAL), (1, 1, ring.MASKED)]
    assert ring.visible_blocks(q_chunks, k_chunks, True, window=99, length=2) == [
        (1, 0, ring.FULL), (1, 1, ring.FULL)]
    assert {kind for *_, kind in ring.visible_blocks((3, 4), (2, 3), True, None, 2, True)} == {
        ring.MASKED}


def test_ring_block_kinds_follow_the_elementwise_rule():
    """Every (query chunk, key chunk) pair of 6 chunks, for chunk lengths 1-4, causal or not,
    windows from 1 past the sequence: `visible_blocks` skips a block iff `visible` hides every
    key in it, and what each kept block computes (every key, the kernel's lower triangle, or
    `block_keep`) equals the whole sequence's keep-mask there (and `block_keep` with documents
    too), so the block-level skipping is the elementwise rule decided per block."""
    chunks = tuple(range(6))
    for length in (1, 2, 3, 4):
        s = 6 * length
        i = torch.arange(s)[None]
        documents = (i > s // 3).long() + (i > 2 * s // 3)   # three documents, mid-chunk edges
        tril = torch.ones(length, length, dtype=torch.bool).tril()
        for causal in (True, False):
            for window in (None, 1, 2, 3, length + 1, 2 * length + 1, s, s + 5):
                full = keep_mask(torch.zeros(1, s, dtype=torch.long), window, causal)[0]
                kinds = {(a, j): kind for a, j, kind in ring.visible_blocks(
                    chunks, chunks, causal, window, length)}
                for qc in chunks:
                    for kc in chunks:
                        rows, cols = slice(qc * length, (qc + 1) * length), slice(
                            kc * length, (kc + 1) * length)
                        want = full[rows, cols]
                        case = (length, causal, window, qc, kc)
                        kind = kinds.get((qc, kc))
                        assert (kind is None) == (not want.any()), case
                        if kind is not None:   # what the block computes is the rule's mask
                            keep = ring.block_keep(qc, kc, length, causal, window, None, "cpu")
                            computed = {ring.FULL: torch.ones_like(tril), ring.DIAGONAL: tril,
                                        ring.MASKED: keep[0, 0]}[kind]
                            assert torch.equal(computed, want), case
                            assert kind != ring.MASKED or not want.all(), case
                        with_docs = ring.block_keep(qc, kc, length, causal, window, documents,
                                                    "cpu")
                        assert torch.equal(with_docs[:, 0], keep_mask(
                            documents, window, causal)[:, rows, cols]), case


def test_generation_mask_keeps_the_window():
    """Cached decoding: the rows of the whole sequence's window mask for the new queries."""
    full = keep_mask(torch.zeros(1, 10, dtype=torch.long), 4)[0]
    assert torch.equal(decoding_mask(6, 4, 4), full[6:10])
    assert torch.equal(decoding_mask(9, 1, 4), full[9:10])
    assert decoding_mask(0, 5, None) is None and decoding_mask(3, 1, 8) is None
    assert torch.equal(decoding_mask(3, 2, None), torch.ones(2, 5, dtype=torch.bool).tril(3))


def _errors(overrides: list[str], world: int = 1) -> list[str]:
    try:
        load_config(None, overrides, world_size=world)
    except ConfigError as err:
        return err.errors
    return []


def test_window_keys_are_checked_and_parsed():
    cfg = load_config(None, ["model.num_layers=4", "model.sliding_window=8",
                             "model.sliding_window_layers=[0,2]"])
    assert [cfg.model.attention_window(i) for i in range(4)] == [8, None, 8, None]
    assert ModelConfig(sliding_window=8).attention_window(3) == 8   # null: every layer
    assert _errors(["model.sliding_window=0"]) == [
        "model.sliding_window must be >= 1 or null (no window), got 0"]
    assert _errors(["model.sliding_window_layers=[1]"]) == [
        "model.sliding_window_layers=[1] needs model.sliding_window (the window those layers use)"]
    (line,) = _errors(["model.sliding_window=4", "model.sliding_window_layers=[0,5]"])
    assert line.startswith("model.sliding_window_layers: [5] not among the 2 layers")
    (line,) = _errors(["model.sliding_window=4", "model.sliding_window_layers=[]"])
    assert line.startswith("model.sliding_window_layers=[] makes no layer local")
    (line,) = _errors(["model.sliding_window=4", "model.arch=bert"])
    assert line.startswith("model.sliding_window applies to model.arch=gpt only")
    # documents and windows with context parallelism: accepted (exact through the ring)
    assert _errors(["model.sliding_window=4", "parallel.context=2", "model.seq_length=16",
                    "data.reset_attention_mask=true", "data.source=indexed",
                    "data.paths=[x]"], 2) == []
    long = load_config(None, ["model.sliding_window=64", "model.seq_length=32"])
    (note,) = validate(long, 1)
    assert note.startswith("model.sliding_window=64 >= model.seq_length=32: every query")


def test_planner_counts_the_window():
    """A local layer attends each query to `window` keys, not s: 4*B*s*h*(s - window) FLOPs
    fewer forward, times the passes; a window >= s changes nothing."""
    base = dict(arch="gpt", layers=4, hidden=64, heads=4, ffn=256, seq=32, vocab=100,
                dropout=False)
    full = iteration_flops(ModelShape(**base), 8)
    local = iteration_flops(ModelShape(**base, window=8, local_layers=2), 8)
    assert full - local == 4 * 2 * (4.0 * 8 * 32 * 64 * (32 - 8))
    assert iteration_flops(ModelShape(**base, window=32, local_layers=4), 8) == full
    m = ModelConfig(num_layers=4, sliding_window=8, sliding_window_layers=[1])
    assert ModelShape.from_config(m).local_layers == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_ring_kernels_take_their_arguments(dtype):
    """The CUDA block calls (flash for bf16 without a mask, memory-efficient otherwise) against
    torch's schemas and shape rules, on meta tensors (no GPU here): the log-sum-exp comes back
    [b, h, L] (the efficient kernel's padded rows sliced off) and the backward takes it; the
    bias has q's batch and heads, not only shapes that broadcast to them."""
    keep = torch.ones(2, 1, 12, 12, dtype=torch.bool, device="meta")
    for mask in (None, keep, keep[:1]):   # keep[:1]: one mask for the batch (a window alone)
        q, k, v = (torch.empty(2, 4, 12, 64, dtype=dtype, device="meta") for _ in range(3))
        out, lse = ring._cuda_forward(q, k, v, mask is None, 0.125, mask)
        assert out.shape == q.shape and lse.shape == (2, 4, 12) and lse.dtype == torch.float32
        grads = ring._cuda_backward(out, q, k, v, out, lse, mask is None, 0.125, mask)
        assert [g.shape for g in grads] == [q.shape] * 3
        if mask is not None:   # the CUDA kernel refuses a bias that only broadcasts (H200 run)
            assert ring._bias(mask, q, align=16).shape == q.shape[:3] + (12,)
    assert ring._flash_on_cuda(q, None) == (dtype == torch.bfloat16)
