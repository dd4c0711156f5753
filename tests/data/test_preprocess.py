"""`ptdp preprocess` and the demo corpus builder.

Preprocessing needs Hugging Face `datasets`, GPT-2 and WordPiece vocabularies `tokenizers`
(optional extras): the tests that run them skip without them (tests/optional.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ptdp.cli import main
from ptdp.data.bert_dataset import BertDataset
from ptdp.data.indexed import IndexedDataset
from ptdp.data.preprocess import preprocess, split_sentences
from ptdp.data.tokenizer import load_tokenizer

from tests.optional import needs

from .conftest import load_make_corpus
from .tiny_vocabs import TEXTS, write_gpt2_files, write_wordpiece_vocab


def texts(corpus):
    return [json.loads(line)["text"] for line in corpus.read_text().splitlines()]


@pytest.fixture(scope="module")
def preprocessed(workdir, corpus, tokenizer) -> dict[str, str]:
    """`preprocess` of the corpus, for GPT and (sentences) for BERT."""
    needs("datasets")
    prefixes = {"gpt": str(workdir / "preprocessed_gpt"), "bert": str(workdir / "preprocessed_bert")}
    for name, prefix in prefixes.items():
        preprocess(corpus, tokenizer.path, prefix, workers=1, sentences=name == "bert",
                   progress=False)
    return prefixes


def test_the_shared_datasets_are_what_preprocess_writes(preprocessed, gpt_prefix, bert_prefix):
    """The data fixtures (tests/data/tokenised.py, no `datasets` needed) are preprocess's bytes."""
    for name, prefix in (("gpt", gpt_prefix), ("bert", bert_prefix)):
        for suffix in (".bin", ".idx", ".ptdp.json"):
            with open(preprocessed[name] + suffix, "rb") as ours, open(prefix + suffix, "rb") as f:
                assert ours.read() == f.read(), (name, suffix)


def test_documents_are_tokenised_in_order_and_end_with_eod(corpus, tokenizer, preprocessed):
    ds = IndexedDataset(preprocessed["gpt"])
    docs = texts(corpus)
    assert ds.num_documents == len(docs) == len(ds)  # one sequence per document for GPT
    assert ds.vocab_size == tokenizer.vocab_size
    assert ds.meta["tokenizer_fingerprint"] == tokenizer.fingerprint
    assert ds.meta["special_ids"] == tokenizer.special_ids() and ds.meta["sentences"] is False
    for d in (0, 1, len(docs) // 2, len(docs) - 1):
        assert ds.document(d).tolist() == tokenizer.encode(docs[d]) + [tokenizer.eod_id]
    eods = ds.tokens == tokenizer.eod_id
    assert eods.sum() == ds.num_documents  # exactly one <eod> per document, at its end
    assert eods[ds.document_bounds()[1:] - 1].all()


def test_sentence_split_keeps_documents_together(corpus, tokenizer, preprocessed):
    ds = IndexedDataset(preprocessed["bert"])
    docs = texts(corpus)
    assert ds.meta["sentences"] is True and ds.num_documents == len(docs)
    assert len(ds) > 2 * ds.num_documents  # docstrings average several sentences
    doc = 0
    sentences = split_sentences(docs[doc])
    assert [ds[i].tolist() for i in range(ds.doc_idx[doc], ds.doc_idx[doc + 1])] == \
        [tokenizer.encode(s) for s in sentences[:-1]] + [tokenizer.encode(sentences[-1]) + [tokenizer.eod_id]]


def test_split_sentences():
    text = "First sentence. Second one!\nStill the second? Third (with e.g. an abbr).\n\nNew para"
    assert split_sentences(text) == ["First sentence.", "Second one!", "Still the second?",
                                     "Third (with e.g. an abbr).", "New para"]
    assert split_sentences("") == []


def test_workers_give_identical_output_via_cli(tmp_path, corpus, tokenizer, preprocessed):
    gpt_prefix = preprocessed["gpt"]
    out = tmp_path / "w2"
    rc = main(["preprocess", "--input", str(corpus), "--tokenizer", tokenizer.path,
               "--output-prefix", str(out), "--workers", "2", "--quiet"])
    assert rc == 0
    out = tmp_path / "w2_text_document"   # Megatron's default name (ptdp's --json-key: PREFIX)
    assert out.with_suffix(".bin").read_bytes() == open(f"{gpt_prefix}.bin", "rb").read()
    np.testing.assert_array_equal(IndexedDataset(out).sizes, IndexedDataset(gpt_prefix).sizes)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "w2_text_document.bin", "w2_text_document.idx", "w2_text_document.ptdp.json"]


def test_empty_documents_are_skipped(tmp_path, tokenizer):
    needs("datasets")
    (tmp_path / "c.jsonl").write_text('{"text": "Hello there."}\n{"text": ""}\n{"text": "Bye."}\n')
    summary = preprocess(tmp_path / "c.jsonl", tokenizer.path, tmp_path / "o", progress=False)
    assert summary["documents"] == 2 and summary["skipped"] == 1
    assert IndexedDataset(tmp_path / "o").num_documents == 2


def test_a_missing_field_is_one_error(tmp_path, corpus, tokenizer, capsys):
    needs("datasets")
    rc = main(["preprocess", "--input", str(corpus), "--tokenizer", tokenizer.path,
               "--output-prefix", str(tmp_path / "o"), "--json-key", "body", "--quiet"])
    assert rc == 2 and "no 'body' field" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_missing_tokenizer_is_one_error(tmp_path, corpus, capsys):
    rc = main(["preprocess", "--input", str(corpus), "--tokenizer", str(tmp_path / "no.model"),
               "--output-prefix", str(tmp_path / "o"), "--quiet"])
    assert rc == 2 and "no.model" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_make_corpus_is_deterministic(tmp_path):
    make_corpus = load_make_corpus()
    for name in ("a", "b"):
        assert make_corpus.main(["--output", str(tmp_path / f"{name}.jsonl"), "--max-docs", "60"]) == 0
    a = (tmp_path / "a.jsonl").read_bytes()
    assert a == (tmp_path / "b.jsonl").read_bytes()
    records = [json.loads(line) for line in a.decode().splitlines()]
    assert len(records) == 60 and len({r["text"] for r in records}) == 60
    assert all(len(r["text"]) >= 100 and r["source"] for r in records)


def test_make_corpus_with_nothing_to_read_fails(tmp_path, capsys):
    rc = load_make_corpus().main(["--output", str(tmp_path / "c.jsonl"), "--stdlib-dir", str(tmp_path)])
    assert rc == 2 and list(tmp_path.iterdir()) == []  # neither an empty corpus nor a temp file
    assert capsys.readouterr().err.splitlines() == [
        f"make_corpus: no docstring of at least 100 characters under {tmp_path} (--stdlib-dir, "
        f"--min-chars): nothing to write"]
    rc = load_make_corpus().main(["--output", str(tmp_path / "c.jsonl"),
                                  "--stdlib-dir", str(tmp_path / "missing")])
    assert rc == 2 and list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err.splitlines() == [
        f"make_corpus: --stdlib-dir {tmp_path / 'missing'} is not a directory"]


# Megatron's tools/preprocess_data.py command line ---------------------------------------------

@pytest.fixture(scope="module")
def megatron_jsonl(tmp_path_factory):
    """A JSONL with two fields per document, and a directory for the vocabularies."""
    directory = tmp_path_factory.mktemp("megatron_inputs")
    records = [{"title": f"Title {i}.", "text": TEXTS[i % 3] + f" Number {i}."} for i in range(12)]
    (directory / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory, records


@pytest.fixture(scope="module")
def megatron_inputs(megatron_jsonl):
    """The JSONL, tiny GPT-2 and WordPiece vocabularies beside it, and `datasets` to read it."""
    needs("datasets")
    directory, records = megatron_jsonl
    write_gpt2_files(directory)
    write_wordpiece_vocab(directory)
    return directory, records


def run(*args: str) -> int:
    return main(["preprocess", "--workers", "1", "--quiet", *map(str, args)])


def test_gpt2_bpe_with_megatron_arguments_and_names(tmp_path, megatron_inputs):
    src, records = megatron_inputs
    gpt2 = load_tokenizer(src / "gpt2-vocab.json")
    rc = run("--input", src / "c.jsonl", "--output-prefix", tmp_path / "g",
             "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", src / "gpt2-vocab.json",
             "--merge-file", src / "gpt2-merges.txt", "--json-keys", "text", "title", "--append-eod")
    assert rc == 0
    for key in ("text", "title"):
        ds = IndexedDataset(tmp_path / f"g_{key}_document")   # Megatron's naming
        assert ds.vocab_size == 300 and ds.meta["json_key"] == key and ds.meta["append_eod"]
        assert ds.meta["tokenizer_fingerprint"] == gpt2.fingerprint
        assert [ds.document(d).tolist() for d in range(ds.num_documents)] == \
            [gpt2.encode(r[key]) + [gpt2.eod_id] for r in records]


def test_append_eod_can_be_turned_off(tmp_path, megatron_inputs):
    src, records = megatron_inputs
    assert run("--input", src / "c.jsonl", "--output-prefix", tmp_path / "n",
               "--tokenizer", src / "gpt2-vocab.json", "--no-append-eod", "--json-key", "text") == 0
    ds = IndexedDataset(tmp_path / "n")   # ptdp's naming: --json-key, the prefix as given
    gpt2 = load_tokenizer(src / "gpt2-vocab.json")
    assert ds.meta["append_eod"] is False
    assert ds.document(0).tolist() == gpt2.encode(records[0]["text"])


def test_wordpiece_sentences_and_describe(tmp_path, megatron_inputs):
    src, records = megatron_inputs
    rc = run("--input", src / "c.jsonl", "--output-prefix", tmp_path / "b", "--tokenizer-type",
             "BertWordPieceLowerCase", "--vocab-file", src / "vocab.txt", "--split-sentences")
    assert rc == 0
    prefix = tmp_path / "b_text_sentence"
    bert = load_tokenizer(src / "vocab.txt", lowercase=True)
    ds = IndexedDataset(prefix)
    assert ds.meta["sentences"] and ds.meta["lowercase"] is True and len(ds) > ds.num_documents
    sentences = split_sentences(records[1]["text"])
    assert [ds[i].tolist() for i in range(ds.doc_idx[1], ds.doc_idx[2])] == \
        [bert.encode(s) for s in sentences[:-1]] + [bert.encode(sentences[-1]) + [bert.eod_id]]
    # A pair without its sidecar (as Megatron's tool leaves it) gets one back from the tokenizer.
    sidecar = prefix.with_name(prefix.name + ".ptdp.json")
    written = json.loads(sidecar.read_text())
    sidecar.unlink()
    assert IndexedDataset(prefix).vocab_size is None
    assert run("--describe", "--output-prefix", prefix, "--vocab-file", src / "vocab.txt") == 0
    described = IndexedDataset(prefix)
    assert described.vocab_size == written["vocab_size"] == bert.vocab_size
    for key in ("tokenizer_fingerprint", "special_ids", "sentences"):
        assert described.meta[key] == written["meta"][key]
    sample = BertDataset(described, 0, described.num_documents, 24, seed=1)[0]   # BERT reads it
    assert sample["tokens"][0] == bert.cls_id and (sample["tokens"] == bert.sep_id).sum() == 2


def test_hugging_face_tokenizer_json_gives_the_same_data(tmp_path, megatron_inputs):
    src, _ = megatron_inputs
    load_tokenizer(src / "gpt2-vocab.json").backend.save(str(tmp_path / "tokenizer.json"))
    for name, flags in (("hf", ["--tokenizer-model", tmp_path]), ("bpe", ["--tokenizer", src / "gpt2-vocab.json"])):
        assert run("--input", src / "c.jsonl", "--output-prefix", tmp_path / name, *flags) == 0
    hf, bpe = tmp_path / "hf_text_document", tmp_path / "bpe_text_document"   # Megatron's names
    assert hf.with_suffix(".bin").read_bytes() == bpe.with_suffix(".bin").read_bytes()
    assert IndexedDataset(hf).meta["tokenizer_fingerprint"] == \
        IndexedDataset(bpe).meta["tokenizer_fingerprint"]


def test_llama2_tokenizer_starts_every_sequence_with_bos(tmp_path, megatron_jsonl):
    """Megatron's Llama2Tokenizer: <s> + ids (+ </s> with --append-eod) per document."""
    import sentencepiece as spm

    needs("datasets")
    src, records = megatron_jsonl
    spm.SentencePieceTrainer.Train(sentence_iterator=iter(TEXTS * 20), model_prefix=str(tmp_path / "llama"),
                                   vocab_size=120, model_type="bpe", minloglevel=2)
    assert run("--input", src / "c.jsonl", "--output-prefix", tmp_path / "l", "--tokenizer-type",
               "Llama2Tokenizer", "--tokenizer-model", tmp_path / "llama.model", "--append-eod") == 0
    sp = load_tokenizer(tmp_path / "llama.model")
    ds = IndexedDataset(tmp_path / "l_text_document")
    assert ds.meta["prepend_bos"] is True and (sp.bos_id, sp.eod_id) == (1, 2)
    assert ds.document(3).tolist() == [1] + sp.encode(records[3]["text"]) + [2]


@pytest.mark.parametrize("flags, message", [
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{src}/words/vocab.txt"],
     "--tokenizer-type GPT2BPETokenizer does not read {src}/words/vocab.txt (a wordpiece file)"),
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "x"], "--tokenizer-type TikTokenizer: ptdp reads"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "no tokenizer: pass --vocab-file"),
    ([], "no tokenizer: pass --tokenizer"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "org/model"],
     "--tokenizer-type HuggingFaceTokenizer: org/model not found (a local file or directory is "
     "needed: Hugging Face hub names are not downloaded)"),
])
def test_tokenizer_arguments_errors_in_one_line(tmp_path, megatron_jsonl, capsys, flags, message):
    """Refused before any tokenizer is read: no optional extra needed."""
    src, _ = megatron_jsonl
    (src / "words").mkdir(exist_ok=True)
    (src / "words" / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\n")
    flags, message = [f.format(src=src) for f in flags], message.format(src=src)
    assert run("--input", src / "c.jsonl", "--output-prefix", tmp_path / "x", *flags) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
