"""build_datasets: splits by ratio, blending by weight, vocabulary checks with clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from ptdp.config import ConfigError
from ptdp.data import build_datasets
from ptdp.data.blend import BlendedDataset, blend_index
from ptdp.data.build import parse_paths, split_bounds
from ptdp.data.indexed import IndexedDataError
from ptdp.data.tokenizer import train_tokenizer

from .conftest import VOCAB, make_config, write_counting_dataset


def test_split_bounds():
    assert split_bounds("98,1,1", 1000) == [(0, 980), (980, 990), (990, 1000)]
    assert split_bounds("8,2", 10) == [(0, 8), (8, 10), (10, 10)]
    assert split_bounds("1", 7) == [(0, 7), (7, 7), (7, 7)]
    assert split_bounds("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]  # rounding covers every doc
    for bad in ("a,b", "1,-1,0", "0,0,0", "1,1,1,1"):
        with pytest.raises(ConfigError, match="data.split"):
            split_bounds(bad, 10)


def test_parse_paths():
    assert parse_paths(["a"]) == [(1.0, "a")]
    assert parse_paths([0.3, "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    for bad, msg in [([0.3, "a", "b"], "weight, prefix"), (["x", "a", 1, "b"], "weight before 'a'"),
                     ([-1, "a", 1, "b"], "negative"), ([0, "a", 0, "b"], "not all be zero")]:
        with pytest.raises(ConfigError, match=msg):
            parse_paths(bad)


def test_gpt_splits_are_disjoint_and_in_ratio(tmp_path):
    bounds = write_counting_dataset(tmp_path / "c", [20] * 100)
    cfg = make_config(f"data.paths=[{tmp_path / 'c'}]", "data.split=80,10,10",
                      "model.seq_length=8", f"model.vocab_size={1 << 20}")
    out = build_datasets(cfg)
    docs = {}
    for name, ds in out.items():
        tokens = np.concatenate([ds[i]["tokens"] for i in range(len(ds))])
        docs[name] = set(np.searchsorted(bounds, tokens, side="right").tolist())
    from ptdp.data.build import split_documents
    dealt = [set((ids + 1).tolist()) for ids in split_documents("80,10,10", 100, cfg.train.seed)]
    assert docs["train"] == dealt[0] and len(docs["train"]) == 80
    assert docs["valid"] <= dealt[1] and docs["test"] <= dealt[2]
    assert not (docs["train"] & docs["valid"]) and not (docs["valid"] & docs["test"])
    assert min(docs["valid"]) <= 80   # shuffled: not the corpus' last tenth
    assert [len(out[n]) for n in ("train", "valid", "test")] == [(1600 - 1) // 8, (200 - 1) // 8, (200 - 1) // 8]


def test_blend_index_tracks_weights():
    which, nth = blend_index([0.5, 0.3, 0.2], 1000)
    for prefix in (10, 97, 500, 1000):
        counts = np.bincount(which[:prefix], minlength=3)
        assert np.all(np.abs(counts - np.array([0.5, 0.3, 0.2]) * prefix) <= 1), prefix
    for k in range(3):
        assert nth[which == k].tolist() == list(range((which == k).sum()))  # in order, no gaps
    assert blend_index([1, 0], 5)[0].tolist() == [0] * 5
    with pytest.raises(ValueError, match="weights"):
        blend_index([0, 0], 5)


def test_blended_gpt_datasets(tmp_path):
    write_counting_dataset(tmp_path / "a", [50] * 20)
    write_counting_dataset(tmp_path / "b", [50] * 4)
    cfg = make_config(f"data.paths=[3, {tmp_path / 'a'}, 1, {tmp_path / 'b'}]", "data.split=1",
                      "model.seq_length=10", f"model.vocab_size={1 << 20}")
    train = build_datasets(cfg)["train"]
    alone = {name: build_datasets(make_config(f"data.paths=[{tmp_path / name}]", "data.split=1",
                                              "model.seq_length=10", f"model.vocab_size={1 << 20}"))["train"]
             for name in ("a", "b")}
    assert isinstance(train, BlendedDataset) and len(train) == 99 + 19
    assert np.bincount(train.dataset_index).tolist() == [89, 29]  # 3 : 1 (within one sample)
    # Each part's samples appear in its own order; b's 19 samples wrap around after the 19th.
    for k, name in enumerate(("a", "b")):
        taken = [train[i]["tokens"] for i in np.flatnonzero(train.dataset_index == k)]
        for n, tokens in enumerate(taken):
            np.testing.assert_array_equal(tokens, alone[name][n % len(alone[name])]["tokens"])


def test_blending_different_vocabularies_fails(tmp_path):
    write_counting_dataset(tmp_path / "a", [50] * 4, vocab_size=1000)
    write_counting_dataset(tmp_path / "b", [50] * 4, vocab_size=2000)
    cfg = make_config(f"data.paths=[1, {tmp_path / 'a'}, 1, {tmp_path / 'b'}]", "model.vocab_size=2000")
    with pytest.raises(IndexedDataError, match=r"b\.idx and .*a\.idx were tokenised with different"):
        build_datasets(cfg)


def test_model_vocab_smaller_than_data(gpt_prefix):
    cfg = make_config(f"data.paths=[{gpt_prefix}]", "model.vocab_size=256")
    with pytest.raises(ConfigError, match=rf"model.vocab_size=256 is smaller .*gpt\.idx \({VOCAB}\); "
                                          rf"set model.vocab_size={VOCAB}"):
        build_datasets(cfg)


def test_tokenizer_with_another_vocabulary(tmp_path, corpus, gpt_prefix):
    small = train_tokenizer(corpus, tmp_path / "small", 400, "bpe")
    same_size = train_tokenizer(corpus, tmp_path / "uni", VOCAB, "unigram")
    for tok, size in ((small, 400), (same_size, VOCAB)):
        cfg = make_config(f"data.paths=[{gpt_prefix}]", f"model.vocab_size={VOCAB}",
                          f"data.tokenizer={tok.path}")
        with pytest.raises(IndexedDataError, match=rf"tokenizer .*{tok.path.split('/')[-1]} "
                                                   rf"\(vocab_size {size}.*does not match .*gpt\.idx"):
            build_datasets(cfg)


def test_real_gpt_and_bert_datasets(gpt_prefix, bert_prefix, tokenizer):
    common = [f"model.vocab_size={VOCAB}", "model.seq_length=32", f"data.tokenizer={tokenizer.path}",
              "data.split=90,5,5"]
    gpt = build_datasets(make_config(f"data.paths=[{gpt_prefix}]", *common))
    assert len(gpt["train"]) > 10 * len(gpt["valid"]) > 0 and len(gpt["test"]) > 0
    assert gpt["train"][0]["tokens"].max() < VOCAB
    bert = build_datasets(make_config(f"data.paths=[{bert_prefix}]", "model.arch=bert", *common))
    assert len(bert["train"]) > 10 * len(bert["valid"]) > 0
    assert bert["valid"][0]["tokens"][0] == tokenizer.cls_id


def test_empty_train_split_fails_clearly(tmp_path):
    write_counting_dataset(tmp_path / "tiny", [5, 5])
    cfg = make_config(f"data.paths=[{tmp_path / 'tiny'}]", "model.seq_length=64",
                      f"model.vocab_size={1 << 20}")
    with pytest.raises(IndexedDataError, match=r"train split of .*tiny has no samples.*seq_length=64"):
        build_datasets(cfg)


def test_split_documents_draws_every_split_from_the_whole_corpus():
    from ptdp.data.build import split_documents
    splits = split_documents("8,1,1", 1000, seed=3)
    assert [len(s) for s in splits] == [800, 100, 100]
    assert sorted(np.concatenate(splits).tolist()) == list(range(1000))   # a partition
    valid = splits[1]
    assert valid.min() < 100 and valid.max() > 900          # not the corpus' tail
    assert (np.diff(valid) > 0).all()                       # sorted ids
    assert all((a == b).all() for a, b in zip(splits, split_documents("8,1,1", 1000, seed=3)))
    assert not (split_documents("8,1,1", 1000, seed=4)[1] == valid).all()
