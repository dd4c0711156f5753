"""`ptdp preprocess` and the demo corpus builder."""

from __future__ import annotations

import json

import numpy as np

from ptdp.cli import main
from ptdp.data.indexed import IndexedDataset
from ptdp.data.preprocess import preprocess, split_sentences

from .conftest import load_make_corpus


def texts(corpus):
    return [json.loads(line)["text"] for line in corpus.read_text().splitlines()]


def test_documents_are_tokenised_in_order_and_end_with_eod(corpus, tokenizer, gpt_prefix):
    ds = IndexedDataset(gpt_prefix)
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


def test_sentence_split_keeps_documents_together(corpus, tokenizer, bert_prefix):
    ds = IndexedDataset(bert_prefix)
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


def test_workers_give_identical_output_via_cli(tmp_path, corpus, tokenizer, gpt_prefix):
    out = tmp_path / "w2"
    rc = main(["preprocess", "--input", str(corpus), "--tokenizer", tokenizer.path,
               "--output-prefix", str(out), "--workers", "2", "--quiet"])
    assert rc == 0
    assert (tmp_path / "w2.bin").read_bytes() == open(f"{gpt_prefix}.bin", "rb").read()
    np.testing.assert_array_equal(IndexedDataset(out).sizes, IndexedDataset(gpt_prefix).sizes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w2.bin", "w2.idx"]


def test_empty_documents_are_skipped(tmp_path, tokenizer):
    (tmp_path / "c.jsonl").write_text('{"text": "Hello there."}\n{"text": ""}\n{"text": "Bye."}\n')
    summary = preprocess(tmp_path / "c.jsonl", tokenizer.path, tmp_path / "o", progress=False)
    assert summary["documents"] == 2 and summary["skipped"] == 1
    assert IndexedDataset(tmp_path / "o").num_documents == 2


def test_preprocess_errors(tmp_path, corpus, tokenizer, capsys):
    rc = main(["preprocess", "--input", str(corpus), "--tokenizer", tokenizer.path,
               "--output-prefix", str(tmp_path / "o"), "--json-key", "body", "--quiet"])
    assert rc == 1 and "no 'body' field" in capsys.readouterr().err
    rc = main(["preprocess", "--input", str(corpus), "--tokenizer", str(tmp_path / "no.model"),
               "--output-prefix", str(tmp_path / "o"), "--quiet"])
    assert rc == 1 and "no.model" in capsys.readouterr().err
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


def test_make_corpus_with_nothing_to_read_fails(tmp_path):
    rc = load_make_corpus().main(["--output", str(tmp_path / "c.jsonl"), "--stdlib-dir", str(tmp_path)])
    assert rc == 1 and list(tmp_path.iterdir()) == []  # neither an empty corpus nor a temp file
