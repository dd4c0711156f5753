"""Tokenizers: sentencepiece (training with `ptdp tokenizer train`, and a small wrapper class)
and Hugging Face fast tokenizers (a `tokenizer.json`, as a converted model brings one, or
built from Megatron's GPT-2 `vocab.json` + `merges.txt` or WordPiece `vocab.txt` by
ptdp/data/vocab_tokenizers.py), behind one interface; `load_tokenizer(path)` picks by file.

The special tokens GPT and BERT need are reserved as sentencepiece *control symbols*: they get
fixed ids, are never produced from raw text (a docstring that says "[MASK]" stays text), and
decode to nothing. The wrapper exposes their ids plus a fingerprint of the vocabulary, which
the preprocessor stores in the dataset's sidecar (ptdp/data/indexed.py) so training can refuse
data tokenised with a different vocabulary.

A Hugging Face tokenizer (`HFTokenizer`) plays the same roles with its own special tokens: its
end-of-sequence token is the end-of-document token (<eod>), and its bos, pad, cls, sep and mask
tokens take the other roles; they are named by the `tokenizer_config.json` beside the
`tokenizer.json` when there is one, else recognised by their usual spellings (GPT-2's
`<|endoftext|>`, BERT's `[EOS]` as Megatron adds it). Like sentencepiece's, its `encode` adds
no special token and `decode` drops them; the fingerprint hashes the same ordered token list,
so a sentencepiece model and its conversion (`ptdp convert --to hf`) share it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import ptdp.data.vocab_tokenizers as vocab_tokenizers
from ptdp.data.vocab_tokenizers import vocab_files

EOD = "<eod>"
CLS, SEP, MASK, PAD = "[CLS]", "[SEP]", "[MASK]", "[PAD]"
SPECIAL_TOKENS = (EOD, CLS, SEP, MASK, PAD)
BOS = "<bos>"   # a role only Hugging Face tokenizers fill (sentencepiece models here have none)
HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_CHAT_TEMPLATE = "chat_template.jinja"           # transformers 5 saves the template apart
HF_GENERATION_CONFIG = "generation_config.json"   # the model's end ids, beside its tokenizer


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

    @property
    def bos_id(self) -> int:
        """The model's <s> (Llama's; `ptdp tokenizer train` reserves none)."""
        if self._sp.bos_id() < 0:
            raise TokenizerError(f"{self.path}: has no beginning-of-sequence token")
        return int(self._sp.bos_id())

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


# Hugging Face tokenizer roles: tokenizer_config.json key, and the usual spellings when that
# file is absent or silent.
_HF_ROLES = {
    EOD: ("eos_token", ("<eod>", "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>",
                        "[EOS]")),
    BOS: ("bos_token", ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[BOS]")),
    PAD: ("pad_token", ("[PAD]", "<pad>", "<|pad|>")),
    CLS: ("cls_token", ("[CLS]",)),
    SEP: ("sep_token", ("[SEP]",)),
    MASK: ("mask_token", ("[MASK]", "<mask>")),
}
HF_ROLE_KEYS = {role: key for role, (key, _) in _HF_ROLES.items()}   # <eod> -> eos_token, ...


def is_hf_tokenizer(path: str | os.PathLike) -> bool:
    """Read by `HFTokenizer`: a `.json` file (a tokenizer.json or a GPT-2 vocab.json), a
    WordPiece `vocab.txt`, or a directory holding one of them."""
    path = Path(path)
    return path.suffix in (".json", ".txt") or path.is_dir()


def hf_tokenizer_files(path: str | os.PathLike) -> dict[str, Path]:
    """The files that make a Hugging Face tokenizer, by their usual names: its tokenizer.json
    (whatever it is called), and the tokenizer_config.json beside it when there is one (it
    names the special tokens), with the chat template and generation config (its end ids)
    that travel with it (ptdp/inference/prompts.py). For a GPT-2 or WordPiece vocabulary, a tokenizer.json written
    from it (once per process, in a temporary directory), so that copies of the tokenizer
    (checkpoints, Hugging Face exports) are one self-contained file."""
    if vocab_files(path) is not None:
        return {HF_TOKENIZER_FILE: _materialised(str(Path(path).resolve()))}
    path = Path(path)
    file = path / HF_TOKENIZER_FILE if path.is_dir() else path
    beside = (HF_TOKENIZER_CONFIG, HF_CHAT_TEMPLATE, HF_GENERATION_CONFIG)
    return {HF_TOKENIZER_FILE: file, **{name: file.with_name(name) for name in beside
                                        if file.with_name(name).is_file()}}


@functools.lru_cache(maxsize=None)
def _materialised(path: str) -> Path:
    import tempfile
    out = Path(tempfile.mkdtemp(prefix="ptdp-tokenizer-")) / HF_TOKENIZER_FILE
    HFTokenizer(path).backend.save(str(out))
    return out


def _require_tokenizers(path) -> None:
    """`tokenizers` (an optional extra) reads every file but a sentencepiece model: its absence
    is one line naming the install, not a misleading "not a vocabulary" or a traceback."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise TokenizerError(f"{path}: reading a Hugging Face tokenizer or a GPT-2/WordPiece "
                             f"vocabulary needs the tokenizers package: pip install 'ptdp[hf]' "
                             f"(or pip install tokenizers)") from None


class HFTokenizer:
    """A Hugging Face fast tokenizer with `Tokenizer`'s interface: from a tokenizer.json, or
    built from a GPT-2 vocab.json + merges.txt or a WordPiece vocab.txt
    (ptdp/data/vocab_tokenizers.py)."""

    def __init__(self, path: str | os.PathLike, merge_file: str | os.PathLike | None = None,
                 lowercase: bool | None = None):
        self.merge_file, self.lowercase = merge_file, lowercase
        _require_tokenizers(path)
        found = vocab_files(path)
        if found is None:
            self.kind = "tokenizer.json"
            files = hf_tokenizer_files(path)
            self.path = str(files[HF_TOKENIZER_FILE])
            self._tok = self._load(self.path)
            config = (self._read_config(files[HF_TOKENIZER_CONFIG])
                      if HF_TOKENIZER_CONFIG in files else {})
        else:
            self.kind, vocab = found
            self.path, config = str(vocab), {}
            if self.kind == vocab_tokenizers.WORDPIECE and lowercase is None:
                self.lowercase = lowercase = vocab_tokenizers.wordpiece_lowercase(vocab)
            try:
                self._tok = (vocab_tokenizers.gpt2_bpe(vocab, merge_file and Path(merge_file))
                             if self.kind == vocab_tokenizers.GPT2
                             else vocab_tokenizers.wordpiece(vocab, lowercase))
            except FileNotFoundError as err:
                raise TokenizerError(str(err)) from None
            except Exception as err:  # tokenizers raises a bare Exception for a malformed file
                raise TokenizerError(f"{vocab}: not a {self.kind} vocabulary "
                                     f"({str(err).splitlines()[0] if str(err) else err})") from err
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1
        self._special = self._roles(config, vocab)

    @staticmethod
    def _load(path: str):
        from tokenizers import Tokenizer as Backend

        if not Path(path).is_file():
            raise TokenizerError(f"tokenizer not found: {path}")
        try:
            return Backend.from_file(path)
        except Exception as err:  # tokenizers raises a bare Exception for a malformed file
            raise TokenizerError(f"{path}: not a Hugging Face tokenizer.json "
                                 f"({str(err).splitlines()[0] if str(err) else err})") from err

    def _roles(self, config: dict, vocab: dict) -> dict[str, int]:
        specials = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        roles = {}
        for role, (key, spellings) in _HF_ROLES.items():
            named = config.get(key)   # a string, or an AddedToken as a dict
            named = named.get("content") if isinstance(named, dict) else named
            if key in config:
                candidates = [named] if isinstance(named, str) else []
            else:
                candidates = [s for s in spellings if s in specials]
            ids = [vocab[c] for c in candidates if c in vocab]
            if ids:
                roles[role] = int(ids[0])
        return roles

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` doing the work."""
        return self._tok

    @staticmethod
    def _read_config(path: Path) -> dict:
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise TokenizerError(f"{path}: not valid JSON ({err})") from err
        return config if isinstance(config, dict) else {}

    def _special_id(self, token: str) -> int:
        if token not in self._special:
            key = _HF_ROLES[token][0]
            raise TokenizerError(f"{self.path}: has no {key} (the {token} role); name one in "
                                 f"the {HF_TOKENIZER_CONFIG} beside it")
        return self._special[token]

    eod_id = property(lambda self: self._special_id(EOD))
    bos_id = property(lambda self: self._special_id(BOS))
    cls_id = property(lambda self: self._special_id(CLS))
    sep_id = property(lambda self: self._special_id(SEP))
    mask_id = property(lambda self: self._special_id(MASK))
    pad_id = property(lambda self: self._special_id(PAD))

    def special_ids(self) -> dict[str, int]:
        """The special-token roles this tokenizer fills, by ptdp's names (<eod>, <bos>, ...)."""
        return dict(self._special)

    def special_tokens(self) -> dict[str, str]:
        """The same roles as token strings ({'<eod>': '</s>', ...})."""
        return {role: self._tok.id_to_token(i) for role, i in self._special.items()}

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @functools.cached_property
    def fingerprint(self) -> str:
        """Hash of the ordered token list (the same formula as `Tokenizer.fingerprint`)."""
        pieces = "\n".join(self._tok.id_to_token(i) or "" for i in range(self.vocab_size))
        return hashlib.sha256(pieces.encode("utf-8")).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, {self.kind}, vocab_size={self.vocab_size})"

    def __getstate__(self):
        return {"path": self.path, "merge_file": self.merge_file, "lowercase": self.lowercase}

    def __setstate__(self, state):
        self.__init__(**state)


def load_tokenizer(path: str | os.PathLike, merge_file: str | os.PathLike | None = None,
                   lowercase: bool | None = None) -> Tokenizer | HFTokenizer:
    """The tokenizer at `path`: a sentencepiece `.model` file, a Hugging Face `tokenizer.json`
    (or a directory holding one, such as a transformers model directory), a GPT-2 `vocab.json`
    (its merges: `merge_file`, else the file beside it) or a WordPiece `vocab.txt` (lower-cased
    when `lowercase`, else as ptdp/data/vocab_tokenizers.py decides)."""
    path = Path(path)
    if path.is_dir() and not (path / HF_TOKENIZER_FILE).is_file() and vocab_files(path) is None:
        raise TokenizerError(f"{path} is a directory without a {HF_TOKENIZER_FILE}, vocab.json or "
                             f"vocab.txt; point at a sentencepiece .model file or a Hugging Face "
                             f"{HF_TOKENIZER_FILE}")
    if not is_hf_tokenizer(path):
        return Tokenizer(path)
    return HFTokenizer(path, merge_file, lowercase)


def checked_tokenizer(path: str | os.PathLike, vocab_size: int) -> Tokenizer | HFTokenizer:
    """load_tokenizer(path), refused in one line when the file is missing or holds more tokens
    than a model of `vocab_size` can embed (conversion and generation)."""
    if not Path(path).exists():
        raise TokenizerError(f"tokenizer {path} not found")
    tok = load_tokenizer(path)
    if tok.vocab_size > vocab_size:
        raise TokenizerError(f"tokenizer {path} has {tok.vocab_size} tokens but the model's "
                             f"vocabulary is model.vocab_size={vocab_size}")
    return tok


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
