"""The .bin/.idx format: round trip, atomic writes and a clear error for each kind of damage."""

from __future__ import annotations

import numpy as np
import pytest

from ptdp.data.indexed import IndexedDataError, IndexedDataset, IndexedDatasetWriter


def random_docs(rng, n_docs, vocab):
    return [[rng.integers(0, vocab, rng.integers(1, 20)) for _ in range(rng.integers(1, 4))]
            for _ in range(n_docs)]


@pytest.mark.parametrize("vocab, dtype", [(500, np.uint16), (65536, np.uint16), (100_000, np.int32)])
def test_round_trip(tmp_path, vocab, dtype):
    docs = random_docs(np.random.default_rng(0), 50, vocab)
    meta = {"sentences": True, "special_ids": {"<eod>": 1}}
    with IndexedDatasetWriter(tmp_path / "d", vocab, meta) as writer:
        for doc in docs:
            writer.add_document(doc)
    ds = IndexedDataset(tmp_path / "d")
    flat = [seq for doc in docs for seq in doc]
    assert ds.dtype == dtype and ds.vocab_size == vocab and ds.meta == meta
    assert ds.num_documents == 50 and len(ds) == len(flat)
    assert ds.num_tokens == sum(len(s) for s in flat)
    for i, seq in enumerate(flat):
        np.testing.assert_array_equal(ds[i], seq)
    for d, doc in enumerate(docs):
        np.testing.assert_array_equal(ds.document(d), np.concatenate(doc))
    assert list(np.diff(ds.doc_idx)) == [len(doc) for doc in docs]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]  # no temp files left


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
    with pytest.raises(IndexedDataError, match=r"d\.idx: bad magic"):
        IndexedDataset(pair)


def test_truncated_idx(pair):
    idx = pair.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:-8])
    with pytest.raises(IndexedDataError, match=r"d\.idx: file is \d+ bytes but its header describes"):
        IndexedDataset(pair)


def test_idx_shorter_than_header(pair):
    pair.with_suffix(".idx").write_bytes(b"PTDP")
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


def test_corrupt_sizes(pair):
    """Flipping bytes in the sizes array breaks the token count recorded in the header."""
    idx = pair.with_suffix(".idx")
    raw = bytearray(idx.read_bytes())
    raw[-4:] = (123456).to_bytes(4, "little")
    idx.write_bytes(bytes(raw))
    with pytest.raises(IndexedDataError, match=r"d\.idx: sequence sizes do not add up"):
        IndexedDataset(pair)
