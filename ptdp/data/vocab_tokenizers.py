"""Tokenizers from the vocabulary files Megatron-LM's `--tokenizer-type` takes, built by the
maintained Hugging Face `tokenizers` library (no hand-written BPE):

* GPT-2 byte-level BPE (`GPT2BPETokenizer`): `vocab.json` + `merges.txt`. The merges file is
  the one given, else the one beside the vocabulary (`merges.txt`, or `NAME-merges.txt` for
  `NAME-vocab.json` as Megatron's `gpt2-vocab.json` / `gpt2-merges.txt`). `<|endoftext|>`
  is the end-of-document token, as in Megatron.
* BERT WordPiece (`BertWordPieceLowerCase`, `BertWordPieceCase`): `vocab.txt`, one token per
  line. Like Megatron's BERT tokenizer, `[BOS]` and `[EOS]` are appended to the vocabulary
  when it lacks them, and `[EOS]` ends documents. Lower-casing is what the caller says, else
  the `tokenizer_config.json` beside the file (`do_lower_case`), else whether the vocabulary
  has upper-case word pieces at all (an uncased vocabulary has none).

Each builder returns a `tokenizers.Tokenizer`; `ptdp/data/tokenizer.py` `HFTokenizer` wraps it.
"""

from __future__ import annotations

import json
from pathlib import Path

GPT2_EOD = "<|endoftext|>"
WORDPIECE_EXTRA = ("[BOS]", "[EOS]")   # Megatron's BERT tokenizer adds these two
GPT2 = "gpt2-bpe"
WORDPIECE = "wordpiece"


def vocab_files(path: str | Path) -> tuple[str, Path] | None:
    """(kind, vocabulary file) when `path` is a GPT-2 vocab.json or a WordPiece vocab.txt, or a
    directory holding one (and no tokenizer.json); None otherwise."""
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return None
        for name, kind in (("vocab.json", GPT2), ("vocab.txt", WORDPIECE)):
            if (path / name).is_file():
                return kind, path / name
        return None
    if path.suffix == ".txt":
        return WORDPIECE, path
    if path.suffix == ".json" and path.name != "tokenizer.json" and _is_flat_vocab(path):
        return GPT2, path
    return None


def _is_flat_vocab(path: Path) -> bool:
    """A GPT-2 vocab.json is one {token: id} object; a tokenizer.json has a "model"."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False   # HFTokenizer reports the unreadable file
    return isinstance(data, dict) and bool(data) and "model" not in data and \
        all(isinstance(v, int) for v in list(data.values())[:100])


def merges_beside(vocab: Path) -> Path | None:
    stem = vocab.name[: -len("vocab.json")] if vocab.name.endswith("vocab.json") else None
    for name in ([f"{stem}merges.txt"] if stem else []) + ["merges.txt"]:
        if (vocab.parent / name).is_file():
            return vocab.parent / name
    return None


def gpt2_bpe(vocab: Path, merges: Path | None):
    """GPT-2's byte-level BPE, as transformers' GPT2Tokenizer builds it from the two files."""
    from tokenizers import AddedToken
    from tokenizers.implementations import ByteLevelBPETokenizer

    merges = merges or merges_beside(vocab)
    if merges is None or not Path(merges).is_file():
        raise FileNotFoundError(f"{vocab}: no merges file for this GPT-2 vocabulary (looked for "
                                f"{merges or 'merges.txt beside it'}); pass --merge-file")
    tok = ByteLevelBPETokenizer(str(vocab), str(merges), add_prefix_space=False,
                                trim_offsets=False)._tokenizer
    if GPT2_EOD in tok.get_vocab():
        tok.add_special_tokens([AddedToken(GPT2_EOD, special=True, normalized=False)])
    return tok


def wordpiece(vocab: Path, lowercase: bool | None):
    """BERT's WordPiece, as transformers' BertTokenizer builds it (clean text, Chinese
    characters split, accents stripped when lower-casing)."""
    from tokenizers import AddedToken
    from tokenizers.implementations import BertWordPieceTokenizer

    if lowercase is None:
        lowercase = wordpiece_lowercase(vocab)
    tok = BertWordPieceTokenizer(str(vocab), lowercase=lowercase)._tokenizer
    present = tok.get_vocab()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in WORDPIECE_EXTRA if t not in present])
    return tok


def wordpiece_lowercase(vocab: Path) -> bool:
    config = vocab.parent / "tokenizer_config.json"
    if config.is_file():
        try:
            value = json.loads(config.read_text(encoding="utf-8")).get("do_lower_case")
        except (OSError, ValueError, AttributeError):
            value = None
        if isinstance(value, bool):
            return value
    with vocab.open(encoding="utf-8") as f:
        pieces = (line.strip() for line in f)
        return not any(p.lower() != p for p in pieces if not (p.startswith("[") and p.endswith("]")))
