"""Tokenizer training (both algorithms, via the CLI too) and the wrapper's special tokens."""

from __future__ import annotations

import json

import pytest

from ptdp.cli import main
from ptdp.data.tokenizer import SPECIAL_TOKENS, Tokenizer, TokenizerError, read_texts

from .conftest import VOCAB
from tests.optional import needs

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
    assert rc == 2 and "missing.jsonl" in capsys.readouterr().err


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


# Megatron's vocabulary files: GPT-2 BPE and WordPiece ------------------------------------------

@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    from .tiny_vocabs import write_gpt2_files, write_wordpiece_vocab

    directory = tmp_path_factory.mktemp("vocabs")
    write_gpt2_files(directory)
    write_wordpiece_vocab(directory)
    return directory


def test_vocabulary_files_encode_like_transformers(vocab_dir):
    """The ids transformers' GPT2Tokenizer / BertTokenizer give (what Megatron's
    GPT2BPETokenizer and BertWordPiece* use), with Megatron's special tokens."""
    transformers = needs("transformers")
    from ptdp.data.tokenizer import EOD, HFTokenizer, load_tokenizer

    from .tiny_vocabs import TEXTS

    gpt2 = load_tokenizer(vocab_dir / "gpt2-vocab.json")   # gpt2-merges.txt found beside it
    theirs = transformers.GPT2Tokenizer(str(vocab_dir / "gpt2-vocab.json"),
                                        str(vocab_dir / "gpt2-merges.txt"))
    assert isinstance(gpt2, HFTokenizer) and gpt2.kind == "gpt2-bpe"
    assert gpt2.vocab_size == len(theirs) == 300
    assert gpt2.eod_id == theirs.convert_tokens_to_ids("<|endoftext|>")
    bert = load_tokenizer(vocab_dir / "vocab.txt")
    uncased = transformers.BertTokenizer(str(vocab_dir / "vocab.txt"), do_lower_case=True)
    assert bert.kind == "wordpiece" and bert.lowercase is True   # no upper-case piece in it
    assert bert.vocab_size == len(uncased) + 2                   # Megatron adds [BOS], [EOS]
    assert bert.special_ids()[EOD] == len(uncased) + 1
    for text in TEXTS:
        assert gpt2.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]
        # As in transformers, a special token spelled in the text is that token (then dropped).
        assert gpt2.decode(gpt2.encode(text)) == text.replace("<|endoftext|>", "")
        assert bert.encode(text) == uncased(text, add_special_tokens=False)["input_ids"]
    cased = load_tokenizer(vocab_dir / "vocab.txt", lowercase=False)
    assert cased.encode("Hello") != bert.encode("Hello")


def test_vocabulary_files_pickle_and_become_one_tokenizer_json(vocab_dir, tmp_path):
    import pickle
    import shutil

    from ptdp.data.tokenizer import hf_tokenizer_files, load_tokenizer

    shutil.copy(vocab_dir / "gpt2-vocab.json", tmp_path / "v.json")
    shutil.copy(vocab_dir / "gpt2-merges.txt", tmp_path / "m.txt")
    with pytest.raises(TokenizerError, match=r"v\.json: no merges file .*--merge-file"):
        load_tokenizer(tmp_path / "v.json")
    gpt2 = load_tokenizer(tmp_path / "v.json", merge_file=tmp_path / "m.txt")
    clone = pickle.loads(pickle.dumps(gpt2))
    assert clone.encode(TEXT) == gpt2.encode(TEXT) and clone.fingerprint == gpt2.fingerprint
    # Checkpoints and Hugging Face exports copy a tokenizer as one tokenizer.json.
    for path in (vocab_dir / "gpt2-vocab.json", vocab_dir / "vocab.txt", vocab_dir):
        copy = hf_tokenizer_files(path)["tokenizer.json"]
        assert copy.name == "tokenizer.json" and copy.is_file()
        assert load_tokenizer(copy).fingerprint == load_tokenizer(path).fingerprint
        assert load_tokenizer(copy).special_ids() == load_tokenizer(path).special_ids()
