"""SentencePiece tokenizer: training (`ptdp tokenizer train`) and a small wrapper class.

The special tokens GPT and BERT need are reserved as sentencepiece *control symbols*: they get
fixed ids, are never produced from raw text (a docstring that says "[MASK]" stays text), and
decode to nothing. The wrapper exposes their ids plus a fingerprint of the vocabulary, which
the preprocessor stores in the `.idx` header so training can refuse data tokenised with a
different vocabulary.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

EOD = "<eod>"
CLS, SEP, MASK, PAD = "[CLS]", "[SEP]", "[MASK]", "[PAD]"
SPECIAL_TOKENS = (EOD, CLS, SEP, MASK, PAD)


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable or lacks a needed special token."""


class Tokenizer:
    """A sentencepiece model plus the special-token ids the datasets need."""

    def __init__(self, path: str | os.PathLike):
        import sentencepiece as spm

        self.path = str(path)
        if not Path(path).is_file():
            raise TokenizerError(f"tokenizer model not found: {path} "
                                 f"(train one with `ptdp tokenizer train`)")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.path)
        except (OSError, RuntimeError) as err:
            raise TokenizerError(f"{path}: not a sentencepiece model ({err})") from err
        self.vocab_size = int(self._sp.GetPieceSize())
        self._special = {tok: self._piece_id(tok) for tok in SPECIAL_TOKENS}
        if self._special[EOD] is None and self._sp.eos_id() >= 0:
            self._special[EOD] = int(self._sp.eos_id())  # a foreign model's </s> ends documents

    def _piece_id(self, piece: str) -> int | None:
        pid = self._sp.PieceToId(piece)
        # PieceToId maps unknown pieces to unk; only a real match counts.
        return int(pid) if self._sp.IdToPiece(pid) == piece else None

    def _special_id(self, token: str) -> int:
        pid = self._special[token]
        if pid is None:
            raise TokenizerError(f"{self.path}: has no special token {token}; train the tokenizer "
                                 f"with `ptdp tokenizer train`, which reserves {', '.join(SPECIAL_TOKENS)}")
        return pid

    eod_id = property(lambda self: self._special_id(EOD))
    cls_id = property(lambda self: self._special_id(CLS))
    sep_id = property(lambda self: self._special_id(SEP))
    mask_id = property(lambda self: self._special_id(MASK))
    pad_id = property(lambda self: self._special_id(PAD))

    @property
    def unk_piece(self) -> str:
        return self._sp.IdToPiece(self._sp.unk_id())

    def special_ids(self) -> dict[str, int]:
        """The special tokens this model has, by name (stored in the .idx metadata)."""
        return {tok: pid for tok, pid in self._special.items() if pid is not None}

    def encode(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.EncodeAsIds(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])

    @functools.cached_property
    def fingerprint(self) -> str:
        """Hash of the ordered piece list: equal iff token ids mean the same strings."""
        pieces = "\n".join(self._sp.IdToPiece(i) for i in range(self.vocab_size))
        return hashlib.sha256(pieces.encode("utf-8")).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"

    # sentencepiece processors are not picklable everywhere; worker processes reload the file.
    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


def read_texts(path: str | os.PathLike, json_key: str = "text") -> Iterator[str]:
    """Yield documents from JSONL (one JSON object per line) or plain text (one per line)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input not found: {path}")
    is_jsonl = path.suffix in (".jsonl", ".json")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not is_jsonl:
                yield line.rstrip("\n")
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
            if not isinstance(record, dict) or json_key not in record:
                raise ValueError(f"{path}:{lineno}: no '{json_key}' field (use --json-key)")
            yield str(record[json_key])


def _training_lines(path, json_key: str) -> Iterator[str]:
    """Documents split into non-empty lines: sentencepiece skips over-long 'sentences'."""
    for text in read_texts(path, json_key):
        for line in text.splitlines():
            if line.strip():
                yield line


def train_tokenizer(input_path: str | os.PathLike, model_prefix: str | os.PathLike,
                    vocab_size: int, model_type: str = "bpe", json_key: str = "text",
                    max_sentences: int = 2_000_000, verbose: bool = False) -> Tokenizer:
    """Train a sentencepiece model to `{model_prefix}.model` (+ `.vocab`) and load it.

    Byte fallback keeps any input encodable (no <unk> for rare characters), and digits are
    split so numbers do not eat the vocabulary.
    """
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"tokenizer type must be bpe or unigram, got {model_type!r}")
    if not Path(input_path).is_file():
        raise FileNotFoundError(f"input not found: {input_path}")
    Path(model_prefix).parent.mkdir(parents=True, exist_ok=True)
    try:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=_training_lines(input_path, json_key),
            model_prefix=str(model_prefix), vocab_size=vocab_size, model_type=model_type,
            control_symbols=list(SPECIAL_TOKENS), bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0,
            byte_fallback=True, split_digits=True, character_coverage=0.9995,
            input_sentence_size=max_sentences, shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1, minloglevel=0 if verbose else 2)
    except RuntimeError as err:
        raise TokenizerError(f"sentencepiece could not train on {input_path}: {err}") from err
    return Tokenizer(f"{model_prefix}.model")
