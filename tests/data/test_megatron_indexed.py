"""Megatron's indexed format both ways, against megatron-core itself: what ptdp writes opens in
megatron-core's `IndexedDataset` with the same documents, and what megatron-core's
`IndexedDatasetBuilder` writes (every dtype, sentence-split, multimodal, merged) loads in ptdp
with the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

from ptdp.data.build import build_datasets
from ptdp.data.indexed import IndexedDataError, IndexedDataset, IndexedDatasetWriter

from .conftest import make_config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # megatron-core's numpy use
mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                            reason="megatron-core is a test-time dependency")
torch = pytest.importorskip("torch")


def documents(seed: int, n_docs: int, vocab: int, max_sentences: int = 3):
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, vocab, rng.integers(1, 12)) for _ in range(rng.integers(1, max_sentences + 1))]
            for _ in range(n_docs)]


def megatron_build(prefix, docs, dtype, modes=None) -> None:
    """Write docs the way Megatron's tools/preprocess_data.py does (add_document per doc)."""
    builder = mcore.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype, multimodal=modes is not None)
    for d, doc in enumerate(docs):
        flat = np.concatenate(doc) if doc else np.zeros(0, np.int64)
        builder.add_document(torch.from_numpy(flat.astype(np.int64)), [len(s) for s in doc],
                             modes=None if modes is None else [modes[d]] * len(doc))
    builder.finalize(f"{prefix}.idx")


def assert_same(ptdp_ds: IndexedDataset, mcore_ds, docs) -> None:
    flat = [s for doc in docs for s in doc]
    assert len(ptdp_ds) == len(mcore_ds) == len(flat)
    np.testing.assert_array_equal(ptdp_ds.doc_idx, mcore_ds.document_indices)
    np.testing.assert_array_equal(ptdp_ds.sizes, mcore_ds.sequence_lengths)
    for i, seq in enumerate(flat):
        np.testing.assert_array_equal(mcore_ds[i], seq)
        np.testing.assert_array_equal(ptdp_ds[i], seq)


@pytest.mark.parametrize("vocab, dtype", [(1000, np.uint16), (70_000, np.int32)])
def test_ptdp_writes_what_megatron_core_reads(tmp_path, vocab, dtype):
    docs = documents(0, 30, vocab)
    with IndexedDatasetWriter(tmp_path / "p", vocab, {"sentences": True}) as writer:
        for doc in docs:
            writer.add_document(doc)
    theirs = mcore.IndexedDataset(str(tmp_path / "p"))
    assert theirs.index.dtype == dtype == mcore.DType.optimal_dtype(vocab)
    assert_same(IndexedDataset(tmp_path / "p"), theirs, docs)


def test_ptdp_preprocess_output_opens_in_megatron_core(gpt_prefix, bert_prefix):
    for prefix in (gpt_prefix, bert_prefix):
        ours, theirs = IndexedDataset(prefix), mcore.IndexedDataset(prefix)
        np.testing.assert_array_equal(theirs.document_indices, ours.doc_idx)
        for d in (0, ours.num_documents // 2, ours.num_documents - 1):
            first, end = ours.doc_idx[d], ours.doc_idx[d + 1]
            got = np.concatenate([theirs[int(i)] for i in range(first, end)])
            np.testing.assert_array_equal(got, ours.document(d))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float32,
                                   np.float64, np.uint16])
def test_megatron_core_writes_what_ptdp_reads(tmp_path, dtype):
    docs = documents(1, 25, 100) + [[]]   # Megatron keeps empty documents (no sequence)
    megatron_build(tmp_path / "m_text_sentence", docs, dtype)
    ours = IndexedDataset(tmp_path / "m_text_sentence")
    assert ours.format == "megatron" and ours.dtype == dtype and ours.vocab_size is None
    assert ours.meta == {"sentences": True} and ours.num_documents == 26
    assert_same(ours, mcore.IndexedDataset(str(tmp_path / "m_text_sentence")), docs)
    for d, doc in enumerate(docs):
        np.testing.assert_array_equal(ours.document(d), np.concatenate(doc) if doc else [])


def test_multimodal_and_merged_megatron_datasets(tmp_path):
    docs = documents(2, 10, 500)
    megatron_build(tmp_path / "mm", docs, np.uint16, modes=[d % 3 for d in range(10)])
    ours, theirs = IndexedDataset(tmp_path / "mm"), mcore.IndexedDataset(str(tmp_path / "mm"),
                                                                          multimodal=True)
    np.testing.assert_array_equal(ours.modes, theirs.index.sequence_modes)
    np.testing.assert_array_equal(ours.modes, [d % 3 for d, doc in enumerate(docs) for _ in doc])
    for i in range(len(ours)):
        np.testing.assert_array_equal(ours[i], theirs[i][0])   # (tokens, mode) when multimodal
    # Megatron's tools/merge_datasets.py: IndexedDatasetBuilder.add_index over shards.
    more = documents(3, 7, 500)
    megatron_build(tmp_path / "a", docs, np.uint16)
    megatron_build(tmp_path / "b", more, np.uint16)
    builder = mcore.IndexedDatasetBuilder(str(tmp_path / "ab.bin"), dtype=np.uint16)
    for shard in ("a", "b"):
        builder.add_index(str(tmp_path / shard))
    builder.finalize(str(tmp_path / "ab.idx"))
    assert_same(IndexedDataset(tmp_path / "ab"), mcore.IndexedDataset(str(tmp_path / "ab")),
                docs + more)


def test_damaged_megatron_pair_fails_in_one_line_naming_the_file(tmp_path):
    megatron_build(tmp_path / "m", documents(4, 10, 100), np.int32)
    bin_path = tmp_path / "m.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-4])
    with pytest.raises(IndexedDataError, match=r"m\.bin: \d+ bytes but m\.idx describes \d+ int32 "
                                               r"tokens .*truncated") as err:
        IndexedDataset(tmp_path / "m")
    assert "\n" not in str(err.value)
    megatron_build(tmp_path / "other", documents(5, 20, 100), np.int32)
    (tmp_path / "other.idx").replace(tmp_path / "m.idx")
    with pytest.raises(IndexedDataError, match=r"m\.bin: .*does not belong together"):
        IndexedDataset(tmp_path / "m")


def test_same_tokens_give_the_same_samples_whichever_tool_wrote_them(tmp_path):
    """GPT samples from a megatron-core pair (no sidecar: the model config gives the
    vocabulary) and from the pair ptdp writes for the same documents are identical: the
    trainer sees the same data."""
    docs = [[np.concatenate(doc)] for doc in documents(6, 40, 300)]
    megatron_build(tmp_path / "theirs", docs, np.uint16)
    with IndexedDatasetWriter(tmp_path / "ours", 300, {"sentences": False}) as writer:
        for doc in docs:
            writer.add_document(doc)
    assert (tmp_path / "theirs.bin").read_bytes() == (tmp_path / "ours.bin").read_bytes()
    assert (tmp_path / "theirs.idx").read_bytes() == (tmp_path / "ours.idx").read_bytes()
    settings = ["model.seq_length=8", "model.vocab_size=300", "data.split=1,0,0"]
    theirs = build_datasets(make_config(f"data.paths=[{tmp_path}/theirs]", *settings))["train"]
    ours = build_datasets(make_config(f"data.paths=[{tmp_path}/ours]", *settings))["train"]
    assert len(theirs) == len(ours) > 10
    for i in range(len(ours)):
        np.testing.assert_array_equal(theirs[i]["tokens"], ours[i]["tokens"])


def test_ptdp_check_on_megatron_pairs_without_a_sidecar(tmp_path):
    """`ptdp check` passes a GPT pair (vocabulary unknown, model.vocab_size trusted) and tells a
    BERT user to write the sidecar that names the special tokens."""
    from ptdp.checks import Findings, check_data

    megatron_build(tmp_path / "m_text_sentence", documents(7, 20, 100), np.uint16)
    settings = [f"data.paths=[{tmp_path}/m_text_sentence]", "model.seq_length=8"]
    found = Findings()
    check_data(make_config(*settings), found)
    assert found.errors == []
    assert len(found.warnings) == 1 and "its token ids are not checked" in found.warnings[0]
    check_data(make_config(*settings, "model.arch=bert"), found)
    assert len(found.errors) == 1 and "m_text_sentence.ptdp.json naming the special tokens" in \
        found.errors[0] and "ptdp preprocess --describe" in found.errors[0]
    # the end-of-document options need the <eod> id, which only a sidecar or data.tokenizer gives
    found = Findings()
    check_data(make_config(*settings, "data.eod_mask_loss=true"), found)
    assert found.errors == [f"data.eod_mask_loss: the end-of-document id of {tmp_path}/"
                            f"m_text_sentence.idx is unknown (no sidecar naming it); set "
                            f"data.tokenizer, or write the sidecar with `ptdp preprocess "
                            f"--describe --output-prefix {tmp_path}/m_text_sentence --tokenizer "
                            f"TOKENIZER`"]


def test_eod_options_on_data_without_eod_tokens_are_warned_about(tmp_path):
    from ptdp.checks import Findings, check_data
    from ptdp.data.indexed import IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "x", 100, {"special_ids": {"<eod>": 0},
                                                     "append_eod": False}) as writer:
        for doc in documents(5, 20, 100):
            writer.add_document(doc)
    found = Findings()
    check_data(make_config(f"data.paths=[{tmp_path}/x]", "model.seq_length=8",
                           "data.reset_position_ids=true"), found)
    assert found.errors == [] and len(found.warnings) == 1
    assert "without end-of-document tokens (--no-append-eod), so these options change nothing" \
        in found.warnings[0]

