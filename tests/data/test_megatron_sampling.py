"""data.sampling=megatron against megatron-core itself: the same document, sample, shuffle and
blending indices and the same sample tokens as megatron-core's GPTDataset / BlendedDataset
built by its BlendedMegatronDatasetBuilder over the same .bin/.idx (written by megatron-core's
IndexedDatasetBuilder). Skipped where megatron-core cannot be imported.

The comparisons go through `_MegatronFiles`, a view of megatron-core's own reader with the
attributes ptdp's datasets use, so they test ptdp's index building and sample assembly
without depending on ptdp's reader of Megatron's .idx; `test_end_to_end_with_ptdp_reader`
uses that reader.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from ptdp.data import megatron_sampling as ms
from ptdp.data.build import _build_megatron, num_samples_needed

from .conftest import make_config

mcore = pytest.importorskip("megatron.core.datasets.gpt_dataset")
from megatron.core.datasets.blended_dataset import BlendedDataset  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder)
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402

EOD, VOCAB, L, SEED = 0, 1000, 16, 4321


def documents(num_docs: int, seed: int) -> list[np.ndarray]:
    """Documents of 1..40 random tokens ending with <eod>."""
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(1, VOCAB, int(rng.integers(0, 40))), EOD)
            for _ in range(num_docs)]


def write_megatron_dataset(prefix: str, num_docs: int, seed: int) -> None:
    """By megatron-core's own writer."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in documents(num_docs, seed):
        builder.add_document(doc, [doc.size])
    builder.finalize(f"{prefix}.idx")


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    out = [str(root / "a_text_document"), str(root / "b_text_document")]
    write_megatron_dataset(out[0], 60, 1)
    write_megatron_dataset(out[1], 25, 2)
    return out


class _MegatronFiles:
    """megatron-core's reader, seen through the attributes ptdp's datasets read."""

    def __init__(self, prefix: str, cache: str):
        self.reader = IndexedDataset(prefix)
        self.sizes = self.reader.sequence_lengths
        self.prefix, self.idx_path = cache, f"{prefix}.idx"
        self.meta = {"special_ids": {"<eod>": EOD}}

    def __len__(self):
        return self.sizes.size

    def __getitem__(self, i):
        return self.reader.get(i)


def megatron_core_datasets(cfg, prefixes: list[str], weights: list[float] | None) -> list:
    tokenizer = types.SimpleNamespace(vocab_size=VOCAB, eod=EOD,
                                      unique_identifiers={"class": "test", "eod": EOD})
    config = mcore.GPTDatasetConfig(
        random_seed=cfg.train.seed, sequence_length=cfg.model.seq_length,
        blend=(prefixes, weights), split=cfg.data.split, tokenizer=tokenizer,
        reset_position_ids=cfg.data.reset_position_ids,
        reset_attention_mask=cfg.data.reset_attention_mask, eod_mask_loss=cfg.data.eod_mask_loss)
    sizes = [num_samples_needed(cfg)[name] for name in ("train", "valid", "test")]
    return BlendedMegatronDatasetBuilder(mcore.GPTDataset, sizes, lambda: True, config).build()


def ptdp_datasets(cfg, prefixes: list[str], tmp_path) -> dict:
    pairs = [(1.0, p) for p in prefixes] if len(prefixes) == 1 else \
        list(zip(cfg.data.paths[::2], prefixes))
    views = [_MegatronFiles(p, str(tmp_path / f"cache{k}")) for k, p in enumerate(prefixes)]
    return _build_megatron(cfg, pairs, views)


def same_gpt_dataset(ours, theirs, eod_options: bool = False) -> None:
    assert np.array_equal(ours.document_index, theirs.document_index)
    assert ours.document_index.dtype == theirs.document_index.dtype
    assert np.array_equal(ours.sample_index, theirs.sample_index)
    assert ours.sample_index.dtype == theirs.sample_index.dtype
    assert np.array_equal(ours.shuffle_index, theirs.shuffle_index)
    assert len(ours) == len(theirs)
    for i in range(len(ours)):
        same_sample(ours[i], theirs[i], eod_options)


def same_sample(ours: dict, theirs: dict, eod_options: bool) -> None:
    assert np.array_equal(ours["tokens"], theirs["tokens"].numpy())
    assert np.array_equal(ours["labels"], theirs["labels"].numpy())
    assert np.array_equal(ours["loss_mask"], theirs["loss_mask"].numpy())
    if eod_options:
        assert np.array_equal(ours["position_ids"], theirs["position_ids"].numpy())
        keep = ~theirs["attention_mask"][0].numpy()          # Megatron's True = masked out
        doc = ours["document_ids"]
        assert np.array_equal(keep, (doc[:, None] == doc[None, :]) & np.tri(doc.size, dtype=bool))


def separates_last_epoch(tokens: int, num_samples: int) -> bool:
    epochs = ms.num_epochs(tokens, num_samples, L)
    before = ((epochs - 1) * tokens - 1) // L
    return epochs > 1 and num_samples - before < int(0.8 * ((tokens - 1) // L))


@pytest.mark.parametrize("iters", [37, 40])
def test_one_prefix_matches_megatron_core(prefixes, tmp_path, iters):
    """Several epochs (with and without the separately shuffled last one), all three splits."""
    cfg = make_config(f"data.paths=[{prefixes[0]}]", "data.sampling=megatron",
                      "data.split=80,15,5", f"model.seq_length={L}", f"train.seed={SEED}",
                      f"train.iters={iters}", "train.eval_interval=20", "train.eval_iters=1")
    ours, theirs = ptdp_datasets(cfg, prefixes[:1], tmp_path), megatron_core_datasets(
        cfg, prefixes[:1], None)
    train = theirs[0]
    epochs = ms.num_epochs(train._get_num_tokens_per_epoch(), train.num_samples, L)
    assert epochs > 2
    assert separates_last_epoch(train._get_num_tokens_per_epoch(), train.num_samples) == \
        (iters == 37)   # 37 iterations leave a short last epoch (shuffled apart), 40 do not
    for name, megatron_split in zip(("train", "valid", "test"), theirs):
        same_gpt_dataset(ours[name], megatron_split)


def test_blend_matches_megatron_core(prefixes, tmp_path):
    """Weighted prefixes: ceil(ceil(N w) * 1.005) samples each, the largest-error interleaving."""
    cfg = make_config(f"data.paths=[0.3,{prefixes[0]},0.7,{prefixes[1]}]", "data.sampling=megatron",
                      "data.split=90,10,0", f"model.seq_length={L}", f"train.seed={SEED}",
                      "train.iters=25", "train.eval_interval=10", "train.eval_iters=1")
    ours, theirs = ptdp_datasets(cfg, prefixes, tmp_path), megatron_core_datasets(
        cfg, prefixes, [0.3, 0.7])
    assert ours["test"] is None and theirs[2] is None    # a zero ratio builds no split
    for name, blend in zip(("train", "valid"), theirs):
        assert isinstance(blend, BlendedDataset)
        mine = ours[name]
        assert np.array_equal(mine.dataset_index, blend.dataset_index)
        assert np.array_equal(mine.dataset_sample_index, blend.dataset_sample_index)
        for part, megatron_part in zip(mine.datasets, blend.datasets):
            assert np.array_equal(part.shuffle_index, megatron_part.shuffle_index)
        for i in range(len(mine)):
            same_sample(mine[i], blend[i], False)


def test_end_of_document_options_match_megatron_core(prefixes, tmp_path):
    cfg = make_config(f"data.paths=[{prefixes[0]}]", "data.sampling=megatron", "data.split=1",
                      f"model.seq_length={L}", "train.iters=6", "data.reset_position_ids=true",
                      "data.reset_attention_mask=true", "data.eod_mask_loss=true")
    ours, theirs = ptdp_datasets(cfg, prefixes[:1], tmp_path), megatron_core_datasets(
        cfg, prefixes[:1], None)
    same_gpt_dataset(ours["train"], theirs[0], eod_options=True)


def test_blending_indices_match_megatron_helper():
    """The greedy rule over many weights and sizes, including exact ties."""
    from megatron.core.datasets import helpers

    rng = np.random.default_rng(0)
    cases = [([0.5, 0.5], 101), ([0.25, 0.25, 0.5], 64), ([1.0], 5), ([0.3, 0.7], 0)]
    cases += [(ms.normalize(rng.random(int(rng.integers(2, 6)))), 777) for _ in range(10)]
    for weights, size in cases:
        dataset_index, sample_index = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers.build_blending_indices(dataset_index, sample_index, np.array(weights),
                                       len(weights), size, False)
        ours = ms.blending_indices(weights, size)
        assert np.array_equal(ours[0], dataset_index) and np.array_equal(ours[1], sample_index)


def test_sample_index_matches_megatron_helper():
    """Empty documents, samples ending exactly at a document's end, lengths from 2 up."""
    from megatron.core.datasets import helpers

    rng = np.random.default_rng(1)
    for _ in range(200):
        sizes = rng.integers(0, 30, int(rng.integers(1, 20))).astype(np.int32)
        sizes[int(rng.integers(0, sizes.size))] = 0
        if sizes.sum() < 2:
            continue
        seq_length = int(rng.integers(2, 12))
        num_samples = int(rng.integers(1, 100))
        ours = ms.build_gpt_indices(sizes, np.arange(sizes.size, dtype=np.int32), seq_length,
                                    num_samples, 7)
        tokens = int(sizes.sum())
        theirs = helpers.build_sample_idx(sizes, ours["document_index"], seq_length,
                                          ms.num_epochs(tokens, num_samples, seq_length),
                                          tokens, True, True)
        assert np.array_equal(ours["sample_index"], theirs)


def test_split_ranges_are_megatrons():
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    for split in ("98,1,1", "969,30,1", "1,1,1", "80,20,0", "1", "0.7,0.2,0.1"):
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        for n in (1, 7, 100, 12345):
            expected = [None if m is None else (int(round(m[0] * n)), int(round(m[1] * n)))
                        for m in matrix]
            ratios = [float(x) for x in split.split(",")]
            assert ms.split_ranges(ratios, n) == expected, (split, n)


def blend_config(paths: list[str]):
    return make_config(f"data.paths=[0.4,{paths[0]},0.6,{paths[1]}]", "data.sampling=megatron",
                       "data.split=90,10,0", f"model.seq_length={L}", "train.iters=12",
                       "train.eval_interval=5", "train.eval_iters=1", f"model.vocab_size={VOCAB}",
                       "data.eod_mask_loss=true")


def test_end_to_end_on_ptdp_files(prefixes, tmp_path):
    """ptdp's build_datasets over the same documents written by `IndexedDatasetWriter` (ptdp's
    own format, its <eod> id in the metadata) gives megatron-core's samples."""
    from ptdp.data import build_datasets
    from ptdp.data.indexed import IndexedDatasetWriter

    ours_paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for path, (num_docs, seed) in zip(ours_paths, [(60, 1), (25, 2)]):
        with IndexedDatasetWriter(path, VOCAB, {"special_ids": {"<eod>": EOD}}) as writer:
            for doc in documents(num_docs, seed):
                writer.add_document([doc])
    ours = build_datasets(blend_config(ours_paths))
    theirs = megatron_core_datasets(blend_config(prefixes), prefixes, [0.4, 0.6])
    for name, blend in zip(("train", "valid"), theirs):
        assert len(ours[name]) == len(blend)
        for i in range(len(blend)):
            same_sample(ours[name][i], blend[i], False)


def test_end_to_end_with_ptdp_reader(prefixes):
    """ptdp's own build_datasets over the files megatron-core wrote, read by ptdp's Megatron
    .idx reader; the end-of-document id comes from the sidecar `ptdp preprocess --describe`
    writes (megatron-core ignores it)."""
    from ptdp.data import build_datasets
    from ptdp.data.indexed import describe

    for prefix in prefixes:
        describe(prefix, VOCAB, {"special_ids": {"<eod>": EOD}})
    ours = build_datasets(blend_config(prefixes))
    theirs = megatron_core_datasets(blend_config(prefixes), prefixes, [0.4, 0.6])
    for name, blend in zip(("train", "valid"), theirs):
        assert len(ours[name]) == len(blend)
        for i in range(len(blend)):
            same_sample(ours[name][i], blend[i], False)
