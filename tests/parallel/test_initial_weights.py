"""A rank's initial weights are its slice of the full tensor a single process draws, bit for bit,
though only the slice is drawn (ptdp/parallel/initial_weights.py), with or without threads."""

import pytest
import torch

import ptdp.parallel.initial_weights as iw
from ptdp.parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                  full_normal, stable_seed)
from ptdp.parallel.mappings import TensorParallel


@pytest.fixture
def skip_small(monkeypatch):
    """Skip ahead even on tiny tensors (normally drawn whole), so these shapes exercise it."""
    monkeypatch.setattr(iw, "SMALL", 0)


def full(shape, seed=11, std=0.02):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


def test_torch_draws_as_the_skipping_assumes():
    assert iw.streams_can_be_skipped()


@pytest.mark.parametrize("shape", [(64, 48), (40, 24), (3, 7), (128, 80), (4, 6, 32), (17, 16),
                                   (72,), (48, 17)])
def test_every_slice_equals_the_full_tensors(shape, skip_small):
    drawn_apart = 0
    for dim, size in enumerate(shape):
        for parts in (1, 2, 3, 4, 8):
            if size % parts:
                continue
            for index in range(parts):
                want = full(shape).chunk(parts, dim=dim)[index]
                assert torch.equal(iw.normal_slice(shape, 0.02, 11, dim, parts, index), want)
                drawn_apart += iw._segments(shape, dim, parts, index) is not None
    assert iw.normal_slice(shape, 0.02, 11, None, 4, 1).equal(full(shape))
    if shape in ((64, 48), (128, 80)):   # aligned shapes really draw only their slice
        assert drawn_apart > 0


@pytest.mark.parametrize("start,stop", [(0, 50), (50, 100), (32, 64), (96, 100), (64, 65)])
def test_rows_equal_the_full_tensors(start, stop, skip_small):
    assert torch.equal(iw.normal_rows((100, 32), 0.5, 3, start, stop), full((100, 32), 3, 0.5)[start:stop])


def test_the_linears_and_the_embedding_keep_their_slice_of_one_process(skip_small):
    key, seed = "layers.0.mlp.fc1", 5
    for size in (1, 2, 4):
        for rank in range(size):
            tp = TensorParallel(None, rank, size)
            with iw.drawing_in_threads(2):
                col = ColumnParallelLinear(64, 96, tp, seed=seed, key=key, std=0.1)
                row = RowParallelLinear(96, 64, tp, seed=seed, key=key, std=0.1)
                emb = VocabParallelEmbedding(300, 512, 32, tp, seed=seed, key="emb", std=0.1)
            weight = full_normal((96, 64), 0.1, seed, f"{key}.weight")
            assert torch.equal(col.weight, weight.chunk(size, 0)[rank])
            weight = full_normal((64, 96), 0.1, seed, f"{key}.weight")
            assert torch.equal(row.weight, weight.chunk(size, 1)[rank])
            table = torch.zeros(512, 32)
            table[:300] = full_normal((300, 32), 0.1, seed, "emb.weight")
            assert torch.equal(emb.weight, table.chunk(size, 0)[rank])
    assert stable_seed(seed, key) != stable_seed(seed + 1, key)


def test_a_failed_draw_raises_at_the_end_of_the_block(monkeypatch):
    monkeypatch.setattr(iw, "_fill", lambda *a: (_ for _ in ()).throw(ValueError("no memory")))
    with pytest.raises(ValueError, match="no memory"):
        with iw.drawing_in_threads(2):
            iw.normal_slice((4, 4), 1.0, 1, None, 1, 0)
