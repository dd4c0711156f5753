"""Tokenizer training (both algorithms, via the CLI too) and the wrapper's special tokens."""

from __future__ import annotations

import json

import pytest

from ptdp.cli import main
from ptdp.data.tokenizer import SPECIAL_TOKENS, Tokenizer, TokenizerError, read_texts

from .conftest import VOCAB

TEXT = "Return the number of items in the sequence. Raise ValueError if it is empty."


def test_special_tokens_are_reserved(tokenizer):
    ids = [tokenizer.eod_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id, tokenizer.pad_id]
    assert len(set(ids)) == 5 and all(0 < i < tokenizer.vocab_size for i in ids)
    assert tokenizer.special_ids() == dict(zip(SPECIAL_TOKENS, ids))
    # Control symbols never come out of raw text, even when the text spells them.
    encoded = tokenizer.encode("use [MASK] and [SEP] or <eod> here")
    assert not set(encoded) & set(ids)


def test_encode_decode_round_trip(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert tokenizer.vocab_size == VOCAB and len(ids) < len(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode(ids + [tokenizer.eod_id]) == TEXT  # specials decode to nothing
    # Byte fallback: characters never seen in training still round-trip.
    assert tokenizer.decode(tokenizer.encode("naïve € 東京")) == "naïve € 東京"


def test_unigram_via_cli_and_fingerprints(tmp_path, corpus, tokenizer):
    prefix = tmp_path / "uni"
    rc = main(["tokenizer", "train", "--input", str(corpus), "--model-prefix", str(prefix),
               "--vocab-size", str(VOCAB), "--type", "unigram"])
    uni = Tokenizer(f"{prefix}.model")
    assert rc == 0 and uni.vocab_size == VOCAB and uni.mask_id == tokenizer.mask_id
    assert uni.decode(uni.encode(TEXT)) == TEXT
    assert uni.fingerprint != tokenizer.fingerprint  # same size, different vocabulary
    assert Tokenizer(tokenizer.path).fingerprint == tokenizer.fingerprint


def test_plain_text_input_and_json_key(tmp_path):
    lines = [f"Sentence number {i} is about the parser and the scanner." for i in range(300)]
    (tmp_path / "c.txt").write_text("\n".join(lines))
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in lines))
    assert list(read_texts(tmp_path / "c.txt")) == lines
    assert list(read_texts(tmp_path / "c.jsonl", "body")) == lines
    with pytest.raises(ValueError, match=r"c\.jsonl:1: no 'text' field \(use --json-key\)"):
        next(read_texts(tmp_path / "c.jsonl"))
    rc = main(["tokenizer", "train", "--input", str(tmp_path / "c.txt"),
               "--model-prefix", str(tmp_path / "t"), "--vocab-size", "300"])
    assert rc == 0 and Tokenizer(tmp_path / "t.model").vocab_size == 300


def test_clear_errors(tmp_path, tokenizer, capsys):
    with pytest.raises(TokenizerError, match=r"tokenizer model not found: .*nope\.model"):
        Tokenizer(tmp_path / "nope.model")
    (tmp_path / "bad.model").write_text("not a model")
    with pytest.raises(TokenizerError, match=r"bad\.model: not a sentencepiece model"):
        Tokenizer(tmp_path / "bad.model")
    rc = main(["tokenizer", "train", "--input", str(tmp_path / "missing.jsonl"),
               "--model-prefix", str(tmp_path / "x"), "--vocab-size", "300"])
    assert rc == 1 and "missing.jsonl" in capsys.readouterr().err


def test_pickles_by_path(tokenizer):
    import pickle

    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.encode(TEXT) == tokenizer.encode(TEXT)


def test_foreign_model_uses_eos_and_names_missing_specials(tmp_path, corpus):
    """A plain sentencepiece model (not from `ptdp tokenizer train`) still works for GPT."""
    import sentencepiece as spm

    lines = (json.loads(line)["text"].replace("\n", " ") for line in corpus.read_text().splitlines())
    spm.SentencePieceTrainer.Train(sentence_iterator=lines, model_prefix=str(tmp_path / "plain"),
                                   vocab_size=400, model_type="bpe", minloglevel=2)
    tok = Tokenizer(tmp_path / "plain.model")
    assert tok.eod_id == 2  # sentencepiece's default </s>
    with pytest.raises(TokenizerError, match=r"plain\.model: has no special token \[MASK\]"):
        tok.mask_id
