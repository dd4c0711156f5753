"""The .bin/.idx format (Megatron's index plus ptdp's sidecar): round trip, atomic writes, a
clear error for each kind of damage, and datasets of older ptdp versions (PTDPIDX)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ptdp.data.indexed import (IndexedDataError, IndexedDataset, IndexedDatasetWriter, describe,
                               read_index_header)

FIXTURES = Path(__file__).parent / "fixtures"


def random_docs(rng, n_docs, vocab):
    return [[rng.integers(0, vocab, rng.integers(1, 20)) for _ in range(rng.integers(1, 4))]
            for _ in range(n_docs)]


@pytest.mark.parametrize("vocab, dtype", [(500, np.uint16), (65499, np.uint16), (65500, np.int32),
                                          (100_000, np.int32)])
def test_round_trip(tmp_path, vocab, dtype):
    docs = random_docs(np.random.default_rng(0), 50, vocab)
    meta = {"sentences": True, "special_ids": {"<eod>": 1}}
    with IndexedDatasetWriter(tmp_path / "d", vocab, meta) as writer:
        for doc in docs:
            writer.add_document(doc)
    ds = IndexedDataset(tmp_path / "d")
    flat = [seq for doc in docs for seq in doc]
    assert ds.dtype == dtype and ds.vocab_size == vocab and ds.meta == meta  # Megatron's dtype rule
    assert ds.format == "megatron" and ds.vocab_size is not None
    assert ds.num_documents == 50 and len(ds) == len(flat)
    assert ds.num_tokens == sum(len(s) for s in flat)
    for i, seq in enumerate(flat):
        np.testing.assert_array_equal(ds[i], seq)
    for d, doc in enumerate(docs):
        np.testing.assert_array_equal(ds.document(d), np.concatenate(doc))
    assert list(np.diff(ds.doc_idx)) == [len(doc) for doc in docs]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx", "d.ptdp.json"]  # no temp


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "d", 100) as writer:
            writer.add_document([[1, 2, 3]])
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_token_out_of_range_is_rejected(tmp_path):
    with pytest.raises(IndexedDataError, match=r"out of range \[0, 100\)"):
        with IndexedDatasetWriter(tmp_path / "d", 100) as writer:
            writer.add_document([[1, 100]])
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def pair(tmp_path):
    with IndexedDatasetWriter(tmp_path / "d", 1000) as writer:
        for doc in random_docs(np.random.default_rng(1), 20, 1000):
            writer.add_document(doc)
    return tmp_path / "d"


def test_missing_files(tmp_path, pair):
    (tmp_path / "d.bin").unlink()
    with pytest.raises(IndexedDataError, match=r"d\.bin: not found.*ptdp preprocess"):
        IndexedDataset(pair)


def test_bad_magic(pair):
    idx = pair.with_suffix(".idx")
    raw = bytearray(idx.read_bytes())
    raw[:4] = b"JUNK"
    idx.write_bytes(bytes(raw))
    with pytest.raises(IndexedDataError, match=r"d\.idx: bad magic b'JUNKIDX.*neither Megatron's"):
        IndexedDataset(pair)


def test_bad_version_and_dtype_code(pair):
    idx = pair.with_suffix(".idx")
    good = idx.read_bytes()
    idx.write_bytes(good[:9] + (2).to_bytes(8, "little") + good[17:])
    with pytest.raises(IndexedDataError, match=r"d\.idx: Megatron index version 2"):
        IndexedDataset(pair)
    idx.write_bytes(good[:17] + bytes([9]) + good[18:])
    with pytest.raises(IndexedDataError, match=r"d\.idx: unknown dtype code 9"):
        IndexedDataset(pair)


def test_truncated_idx(pair):
    idx = pair.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:-8])
    with pytest.raises(IndexedDataError, match=r"d\.idx: file is \d+ bytes but its header describes"):
        IndexedDataset(pair)


def test_idx_shorter_than_header(pair):
    pair.with_suffix(".idx").write_bytes(b"MMID")
    with pytest.raises(IndexedDataError, match=r"d\.idx: .*shorter than the .*header"):
        IndexedDataset(pair)


def test_truncated_bin(pair):
    bin_path = pair.with_suffix(".bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(IndexedDataError, match=r"d\.bin: \d+ bytes but d\.idx describes .*truncated"):
        IndexedDataset(pair)


def test_mismatched_pair(tmp_path, pair):
    """A .bin from another dataset next to this .idx is caught by the size check."""
    with IndexedDatasetWriter(tmp_path / "other", 1000) as writer:
        writer.add_document([[1, 2, 3]])
    (tmp_path / "other.bin").replace(pair.with_suffix(".bin"))
    with pytest.raises(IndexedDataError, match=r"d\.bin: .*does not belong together"):
        IndexedDataset(pair)


def test_corrupt_lengths(pair):
    """Lengths changed in the index no longer match the header's total, or (total kept) the
    pointers Megatron stores."""
    idx = pair.with_suffix(".idx")
    good = bytes(idx.read_bytes())
    first, second = (int.from_bytes(good[at:at + 4], "little") for at in (34, 38))
    for new_first, new_second, message in [
            (123456, second, r"d\.idx: sequence sizes do not add up to the"),
            (first + 1, second - 1, r"d\.idx: sequence pointers are not the running sum")]:
        raw = bytearray(good)
        raw[34:38], raw[38:42] = new_first.to_bytes(4, "little"), new_second.to_bytes(4, "little")
        idx.write_bytes(bytes(raw))
        with pytest.raises(IndexedDataError, match=message):
            IndexedDataset(pair)


def test_corrupt_document_index(pair):
    idx = pair.with_suffix(".idx")
    raw = bytearray(idx.read_bytes())
    raw[-8:] = (5).to_bytes(8, "little")   # the last entry must be the number of sequences
    idx.write_bytes(bytes(raw))
    with pytest.raises(IndexedDataError, match=r"d\.idx: document index runs from sequence 0 to 5"):
        IndexedDataset(pair)


# The sidecar ----------------------------------------------------------------------------------

def test_without_sidecar_vocab_is_unknown_and_sentences_are_inferred(tmp_path, pair):
    pair.with_suffix(".ptdp.json").unlink()
    ds = IndexedDataset(pair)
    assert ds.vocab_size is None
    assert ds.meta == {"sentences": True}   # random_docs has documents of several sequences
    with IndexedDatasetWriter(tmp_path / "g_text_document", 1000) as writer:
        writer.add_document([[1, 2, 3]])
    (tmp_path / "g_text_document.ptdp.json").unlink()
    assert IndexedDataset(tmp_path / "g_text_document").meta == {"sentences": False}


def test_stale_or_broken_sidecar_is_refused(tmp_path, pair):
    sidecar = pair.with_suffix(".ptdp.json")
    with IndexedDatasetWriter(tmp_path / "other", 1000, {"x": 1}) as writer:
        writer.add_document([[1, 2, 3]])
    (tmp_path / "other.ptdp.json").replace(sidecar)
    with pytest.raises(IndexedDataError, match=r"d\.ptdp\.json: describes .* but d\.idx holds .*"
                                               r"earlier version of the data"):
        read_index_header(pair)
    sidecar.write_text("{not json")
    with pytest.raises(IndexedDataError, match=r"d\.ptdp\.json: not a ptdp sidecar"):
        IndexedDataset(pair)


def test_describe_writes_a_sidecar_after_checking_the_tokens(pair):
    pair.with_suffix(".ptdp.json").unlink()
    with pytest.raises(IndexedDataError, match=r"d\.bin: holds token id 99\d, outside .* of 500"):
        describe(pair, 500, {})
    assert not pair.with_suffix(".ptdp.json").exists()
    describe(pair, 1000, {"sentences": True, "tokenizer_fingerprint": "f"})
    ds = IndexedDataset(pair)
    assert ds.vocab_size == 1000 and ds.meta["tokenizer_fingerprint"] == "f"


# Datasets of older ptdp versions ---------------------------------------------------------------

@pytest.fixture
def legacy(tmp_path):
    """A PTDPIDX pair as ptdp wrote it before it wrote Megatron's format (bytes from that
    writer, checked in): three documents of 1, 2, 3 sentences, token ids 100*d + 10*s + k."""
    for ext in (".bin", ".idx"):
        shutil.copy(FIXTURES / f"ptdpidx_v1{ext}", tmp_path / f"old{ext}")
    return tmp_path / "old"


def test_ptdpidx_datasets_still_load(legacy):
    ds = IndexedDataset(legacy)
    assert ds.format == "ptdpidx" and ds.vocab_size == 1000 and ds.dtype == np.uint16
    assert ds.meta["sentences"] is True and ds.meta["special_ids"]["[MASK]"] == 4
    assert ds.num_documents == 3 and list(ds.doc_idx) == [0, 1, 3, 6]
    expected = [[100 * d + 10 * s + k for k in range(s + 2)] for d in range(3) for s in range(d + 1)]
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert ds.document(2).tolist() == sum(expected[3:], [])
    assert read_index_header(legacy).num_tokens == ds.num_tokens == 16


def test_damaged_ptdpidx_names_the_file(legacy):
    idx = legacy.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:-4])
    with pytest.raises(IndexedDataError, match=r"old\.idx: file is \d+ bytes but its header describes"):
        IndexedDataset(legacy)


def test_bert_on_a_megatron_pair_without_a_sidecar_says_how_to_write_one(tmp_path):
    from ptdp.data.bert_dataset import BertDataset
    from ptdp.data.indexed import sidecar_path
    with IndexedDatasetWriter(tmp_path / "x_text_sentence", 100, {"sentences": True}) as writer:
        for _ in range(3):
            writer.add_document([list(range(1, 9)), list(range(1, 9))])
    sidecar_path(tmp_path / "x_text_sentence").unlink()   # as Megatron's preprocessing leaves it
    with pytest.raises(IndexedDataError, match="ptdp preprocess --describe --output-prefix"):
        BertDataset(IndexedDataset(tmp_path / "x_text_sentence"), 0, 0, seq_length=16, seed=1,
                    mask_prob=0.15, documents=np.arange(3))
