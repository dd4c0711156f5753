"""BERT samples: layout, sentence-order prediction and 15 % masking with 80/10/10."""

from __future__ import annotations

import numpy as np
import pytest

from ptdp.data.bert_dataset import BertDataset, _truncate_pair, build_bert_index
from ptdp.data.indexed import IndexedDataError, IndexedDataset

S = 64


@pytest.fixture(scope="module")
def bert(bert_prefix):
    indexed = IndexedDataset(bert_prefix)
    return BertDataset(indexed, 0, indexed.num_documents, S, seed=5)


@pytest.fixture(scope="module")
def samples(bert):
    return [bert[i] for i in range(len(bert))]


def original_tokens(sample):
    return np.where(sample["loss_mask"] == 1, sample["labels"], sample["tokens"])


def test_layout(bert, samples, tokenizer):
    assert len(bert) > 200
    for s in samples:
        assert {k: (v.dtype, v.shape) for k, v in s.items()} == {
            "tokens": (np.int64, (S,)), "types": (np.int64, (S,)), "labels": (np.int64, (S,)),
            "loss_mask": (np.float32, (S,)), "padding_mask": (np.int64, (S,)),
            "sop_label": (np.int64, ())}
        tok = original_tokens(s)
        n = int(s["padding_mask"].sum())
        assert (s["padding_mask"][:n] == 1).all() and (tok[n:] == tokenizer.pad_id).all()
        seps = np.flatnonzero(tok == tokenizer.sep_id)
        assert tok[0] == tokenizer.cls_id and len(seps) == 2 and seps[1] == n - 1
        assert 1 < seps[0] < n - 2  # both segments non-empty
        assert (s["types"][:seps[0] + 1] == 0).all() and (s["types"][seps[0] + 1:n] == 1).all()
        assert (s["types"][n:] == 0).all() and tokenizer.eod_id not in tok


def test_labels_and_loss_mask_agree(samples, tokenizer):
    special = set(tokenizer.special_ids().values())
    for s in samples:
        masked = s["loss_mask"] == 1
        assert masked.any() and (s["labels"][~masked] == 0).all()
        assert not set(s["labels"][masked].tolist()) & special  # only real tokens are predicted
        assert (s["padding_mask"][masked] == 1).all()


def test_masking_statistics(samples, tokenizer):
    special = set(tokenizer.special_ids().values())
    candidates = masked = as_mask = as_random = kept = 0
    for s in samples:
        tok = original_tokens(s)
        candidates += sum(1 for t in tok[s["padding_mask"] == 1] if t not in special)
        m = s["loss_mask"] == 1
        masked += m.sum()
        as_mask += (s["tokens"][m] == tokenizer.mask_id).sum()
        kept += (s["tokens"][m] == s["labels"][m]).sum()
        as_random += ((s["tokens"][m] != tokenizer.mask_id) & (s["tokens"][m] != s["labels"][m])).sum()
    assert masked > 1500
    assert abs(masked / candidates - 0.15) < 0.01
    assert abs(as_mask / masked - 0.8) < 0.03
    assert abs(as_random / masked - 0.1) < 0.02
    assert abs(kept / masked - 0.1) < 0.02


def find(needle: np.ndarray, haystack: np.ndarray) -> int:
    """Offset of the first occurrence of `needle` in `haystack`, or -1."""
    windows = np.lib.stride_tricks.sliding_window_view(haystack, needle.size)
    hits = np.flatnonzero((windows == needle).all(axis=1))
    return int(hits[0]) if hits.size else -1


def test_sentence_order_prediction(bert, samples):
    """In document order, unswapped samples read A then B and swapped ones B then A; each
    segment is a contiguous (possibly truncated) piece of its sentences."""
    assert abs(np.mean([int(s["sop_label"]) for s in samples]) - 0.5) < 0.08
    for i, s in enumerate(samples[:200]):
        start, end = (int(x) for x in bert.samples[i])
        doc = np.concatenate([bert.indexed[k] for k in range(start, end)])
        doc = doc[doc != bert.eod_id]
        tok = original_tokens(s)
        sep1, sep2 = np.flatnonzero(tok == bert.sep_id)
        a, b = tok[1:sep1], tok[sep1 + 1:sep2]
        first, second = (b, a) if s["sop_label"] else (a, b)
        at_first, at_second = find(first, doc), find(second, doc)
        assert at_first >= 0 and at_second >= at_first + first.size, f"sample {i}"


def test_deterministic_per_seed_and_different_across_seeds(bert_prefix):
    indexed = IndexedDataset(bert_prefix)
    a = BertDataset(indexed, 0, indexed.num_documents, S, seed=5)
    b = BertDataset(indexed, 0, indexed.num_documents, S, seed=6)
    for i in (0, 3, 17):
        again = BertDataset(indexed, 0, indexed.num_documents, S, seed=5)[i]
        assert all(np.array_equal(a[i][k], again[k]) for k in again)
    assert any(not np.array_equal(a[i]["tokens"], b[i]["tokens"]) for i in range(5))


def test_grouping_uses_two_or_more_sentences_of_one_document():
    sizes = np.array([5, 5, 5, 5, 5, 3, 40, 40, 2], dtype=np.int32)
    doc_idx = np.array([0, 5, 6, 9])  # docs of 5, 1 and 3 sentences
    rows = build_bert_index(sizes, doc_idx, max_tokens=12, seed=0)["samples"]
    for start, end in rows:
        assert end - start >= 2
        assert np.searchsorted(doc_idx, start, "right") == np.searchsorted(doc_idx, end - 1, "right")
    covered = sorted(k for start, end in rows for k in range(start, end))
    assert 5 not in covered  # the one-sentence document cannot form a pair


def test_truncation_keeps_both_segments_and_the_budget():
    rng = np.random.default_rng(0)
    for la, lb, budget in [(3, 100, 20), (100, 3, 20), (50, 60, 21), (5, 5, 20), (1, 30, 2)]:
        a, b = _truncate_pair(np.arange(la), np.arange(100, 100 + lb), budget, rng)
        assert len(a) + len(b) == min(la + lb, budget) and len(a) >= 1 and len(b) >= 1
        assert min(len(a), len(b)) == min(la, lb, budget // 2)  # the longer one is cut first
        assert np.all(np.diff(a) == 1) and np.all(np.diff(b) == 1)  # contiguous slices


def test_needs_sentence_boundaries_and_room(gpt_prefix, bert_prefix):
    gpt = IndexedDataset(gpt_prefix)
    with pytest.raises(IndexedDataError, match=r"gpt\.idx: BERT needs sentence boundaries.*--split-sentences"):
        BertDataset(gpt, 0, gpt.num_documents, S, seed=1)
    bert = IndexedDataset(bert_prefix)
    with pytest.raises(ValueError, match="seq_length=4 is too short"):
        BertDataset(bert, 0, bert.num_documents, 4, seed=1)
