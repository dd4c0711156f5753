"""GPT samples: L + 1 consecutive tokens of a shuffled document stream, cached, per seed."""

from __future__ import annotations

import numpy as np
import pytest

import ptdp.data.gpt_dataset as gpt_module
from ptdp.data.gpt_dataset import GPTDataset
from ptdp.data.indexed import IndexedDataset

from .conftest import write_counting_dataset

L = 16


@pytest.fixture
def counting(tmp_path):
    sizes = np.random.default_rng(0).integers(1, 40, size=60)  # many shorter than L
    bounds = write_counting_dataset(tmp_path / "c", sizes)
    return IndexedDataset(tmp_path / "c"), bounds


def test_samples_are_consecutive_stream_tokens_across_documents(counting):
    indexed, bounds = counting
    ds = GPTDataset(indexed, 0, 60, L, seed=1)
    total = int(bounds[-1])
    assert len(ds) == (total - 1) // L
    # Rebuild the stream the dataset claims to use: documents in its shuffled order.
    stream = np.concatenate([np.arange(bounds[d], bounds[d + 1]) for d in ds.doc_order])
    assert sorted(ds.doc_order.tolist()) == list(range(60))
    starts = []
    crossing = 0
    for i in range(len(ds)):
        s = ds[i]
        assert s["tokens"].dtype == np.int64 and s["tokens"].shape == (L,)
        assert s["loss_mask"].dtype == np.float32 and (s["loss_mask"] == 1).all()
        np.testing.assert_array_equal(s["labels"][:-1], s["tokens"][1:])
        full = np.append(s["tokens"], s["labels"][-1])
        start = int(np.flatnonzero(stream == full[0])[0])
        np.testing.assert_array_equal(full, stream[start:start + L + 1])
        starts.append(start)
        doc_of = np.searchsorted(bounds, full, side="right")
        crossing += doc_of[0] != doc_of[-1]
    assert sorted(starts) == [j * L for j in range(len(ds))]  # every sample exactly once
    assert starts != sorted(starts)  # and in shuffled order
    assert crossing > len(ds) // 2


def test_deterministic_per_seed_and_different_across_seeds(counting, tmp_path):
    indexed, _ = counting
    a = [GPTDataset(indexed, 0, 60, L, seed=7)[i]["tokens"] for i in range(10)]
    for p in tmp_path.glob("*.npz"):
        p.unlink()  # rebuilt from scratch, not read back from the cache
    b = [GPTDataset(indexed, 0, 60, L, seed=7)[i]["tokens"] for i in range(10)]
    c = [GPTDataset(indexed, 0, 60, L, seed=8)[i]["tokens"] for i in range(10)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_index_is_cached_next_to_the_data(counting, tmp_path, monkeypatch):
    indexed, _ = counting
    first = GPTDataset(indexed, 0, 60, L, seed=3, name="train")
    cached = list(tmp_path.glob("c.train-gpt-*.npz"))
    assert len(cached) == 1

    def no_rebuild(*args):
        raise AssertionError("index rebuilt although it was cached")

    monkeypatch.setattr(gpt_module, "build_gpt_index", no_rebuild)
    again = GPTDataset(indexed, 0, 60, L, seed=3, name="train")
    np.testing.assert_array_equal(first[5]["tokens"], again[5]["tokens"])
    with pytest.raises(AssertionError, match="rebuilt"):
        GPTDataset(indexed, 0, 60, L, seed=4, name="train")  # other seed, other cache file
    assert not list(tmp_path.glob("*.tmp-*"))


def test_document_range_is_respected(counting):
    indexed, bounds = counting
    ds = GPTDataset(indexed, 10, 20, L, seed=1, name="valid")
    tokens = np.concatenate([ds[i]["tokens"] for i in range(len(ds))])
    assert tokens.min() >= bounds[10] and tokens.max() < bounds[20]
    assert len(ds) == (int(bounds[20] - bounds[10]) - 1) // L


def test_too_little_data_gives_an_empty_dataset_with_a_clear_error(counting):
    indexed, _ = counting
    ds = GPTDataset(indexed, 0, 0, L, seed=1, name="test")
    assert len(ds) == 0
    with pytest.raises(IndexError, match=r"test split of .*c has 0 samples.*data\.split"):
        ds[0]
