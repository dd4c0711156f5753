"""Memory-mapped indexed dataset: token ids in `PREFIX.bin`, their layout in `PREFIX.idx`.

A dataset is a list of *documents*, each a list of *sequences* (sentences for BERT, the whole
document for GPT). `.bin` holds every sequence's tokens back to back; `.idx` holds

    header   magic b"PTDPIDX\\0", format version, dtype code, vocab size,
             #sequences, #documents, #tokens, length of the metadata blob
    metadata JSON (tokenizer fingerprint, special-token ids, sentence splitting, ...)
    doc_idx  int64[#documents + 1]  index of each document's first sequence (and the end)
    sizes    int32[#sequences]      tokens per sequence

Both files are checked against each other on open, so a truncated or mismatched pair fails
with the file's name instead of producing garbage batches. The writer writes both files under
temporary names and renames them only when complete.
"""

from __future__ import annotations

import json
import os
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

MAGIC = b"PTDPIDX\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQQQQ")  # magic, version, dtype, vocab, seqs, docs, tokens, meta
DTYPES = {1: np.uint16, 2: np.int32}
_DTYPE_CODES = {np.dtype(v): k for k, v in DTYPES.items()}


class IndexedDataError(ValueError):
    """A .bin/.idx pair is missing, corrupt, truncated or does not fit the configuration."""


def data_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest dtype that holds every token id (halves the file for vocabularies < 64K)."""
    return np.dtype(np.uint16 if vocab_size <= 2 ** 16 else np.int32)


class IndexedDatasetWriter:
    """Streams documents into `PREFIX.bin` and writes `PREFIX.idx` on `finish()`.

    Use as a context manager: on an exception the temporary files are removed and nothing is
    left under the real names.
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, meta: dict | None = None):
        self.bin_path, self.idx_path = data_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.vocab_size = int(vocab_size)
        self.dtype = dtype_for_vocab(self.vocab_size)
        self.meta = dict(meta or {})
        suffix = f".tmp-{os.getpid()}"
        self._tmp_bin = self.bin_path.with_name(self.bin_path.name + suffix)
        self._tmp_idx = self.idx_path.with_name(self.idx_path.name + suffix)
        self._bin = self._tmp_bin.open("wb")
        self._sizes = array("q")
        self._doc_idx = array("q", [0])

    def add_document(self, sequences: Iterable[Iterable[int]]) -> None:
        """Append one document made of one or more sequences of token ids."""
        for seq in sequences:
            tokens = np.asarray(seq, dtype=np.int64)
            if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
                raise IndexedDataError(f"{self.bin_path}: token id out of range "
                                       f"[0, {self.vocab_size}) in document {len(self._doc_idx) - 1}")
            self._bin.write(tokens.astype(self.dtype).tobytes())
            self._sizes.append(tokens.size)
        self._doc_idx.append(len(self._sizes))

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    def finish(self) -> None:
        """Write the index and move both files to their real names."""
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        doc_idx = np.asarray(self._doc_idx, dtype=np.int64)
        meta = json.dumps(self.meta, sort_keys=True).encode("utf-8")
        meta += b" " * (-len(meta) % 8)  # keep the arrays 8-byte aligned
        header = _HEADER.pack(MAGIC, VERSION, _DTYPE_CODES[self.dtype], self.vocab_size,
                              sizes.size, doc_idx.size - 1, int(sizes.sum(dtype=np.int64)),
                              len(meta))
        with self._tmp_idx.open("wb") as f:
            f.write(header + meta + doc_idx.tobytes() + sizes.tobytes())
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)

    def abort(self) -> None:
        self._bin.close()
        self._tmp_bin.unlink(missing_ok=True)
        self._tmp_idx.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.finish()
        else:
            self.abort()
        return False


@dataclass(frozen=True)
class IndexHeader:
    """What the fixed-size start of a `.idx` says, checked against both files' sizes."""

    prefix: str
    dtype: np.dtype
    vocab_size: int
    num_sequences: int
    num_documents: int
    num_tokens: int
    meta: dict
    arrays_offset: int   # where doc_idx starts in the .idx


def _corrupt(idx_path: Path, what: str) -> IndexedDataError:
    return IndexedDataError(f"{idx_path}: {what}; the index is corrupt or was not written by "
                            f"`ptdp preprocess`, re-run it")


def read_index_header(prefix: str | os.PathLike) -> IndexHeader:
    """Read only the header and metadata of `PREFIX.idx` and check both files' sizes.

    Cheap (no token or size array is read), so `ptdp check` can use it on any corpus.
    """
    bin_path, idx_path = data_paths(prefix)
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise IndexedDataError(f"{path}: not found (data prefix '{prefix}'; create it "
                                   f"with `ptdp preprocess --output-prefix {prefix}`)")
    idx_size = idx_path.stat().st_size
    with idx_path.open("rb") as f:
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise _corrupt(idx_path, f"file is {len(head)} bytes, shorter than the "
                                     f"{_HEADER.size}-byte header")
        magic, version, code, vocab, n_seq, n_doc, n_tok, meta_len = _HEADER.unpack(head)
        if magic != MAGIC:
            raise _corrupt(idx_path, f"bad magic {magic!r} (expected {MAGIC!r})")
        if version != VERSION:
            raise IndexedDataError(f"{idx_path}: format version {version}, this ptdp reads "
                                   f"version {VERSION}; re-run `ptdp preprocess`")
        if code not in DTYPES:
            raise _corrupt(idx_path, f"unknown dtype code {code}")
        expected = _HEADER.size + meta_len + 4 * n_seq + 8 * (n_doc + 1)
        if idx_size != expected:
            raise _corrupt(idx_path, f"file is {idx_size} bytes but its header describes "
                                     f"{expected} ({n_seq} sequences, {n_doc} documents)")
        try:
            meta = json.loads(f.read(meta_len).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _corrupt(idx_path, "metadata is not valid JSON") from None
    dtype = np.dtype(DTYPES[code])
    size, expected = bin_path.stat().st_size, n_tok * dtype.itemsize
    if size != expected:
        state = "truncated" if size < expected else "longer than its index"
        raise IndexedDataError(
            f"{bin_path}: {size} bytes but {idx_path.name} describes {n_tok} {dtype.name} "
            f"tokens ({expected} bytes): the .bin is {state} or the pair does not belong "
            f"together; re-run `ptdp preprocess`")
    return IndexHeader(str(prefix), dtype, int(vocab), int(n_seq), int(n_doc), int(n_tok),
                       meta, _HEADER.size + meta_len)


class IndexedDataset:
    """Read-only view of a .bin/.idx pair; `ds[i]` is sequence i as a numpy array (no copy)."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = data_paths(prefix)
        header = read_index_header(prefix)
        self.meta, self.dtype = header.meta, header.dtype
        self.vocab_size, self.num_tokens = header.vocab_size, header.num_tokens
        self._read_arrays(header)
        self.tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r") if self.num_tokens
                       else np.empty(0, self.dtype))

    def _read_arrays(self, header: IndexHeader) -> None:
        """doc_idx and sizes, checked against the header's totals."""
        raw = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        n_doc, n_seq, start = header.num_documents, header.num_sequences, header.arrays_offset
        self.doc_idx = np.frombuffer(raw, np.int64, n_doc + 1, start)
        self.sizes = np.frombuffer(raw, np.int32, n_seq, start + 8 * (n_doc + 1))
        if int(self.sizes.sum(dtype=np.int64)) != header.num_tokens or (self.sizes < 0).any():
            raise _corrupt(self.idx_path, f"sequence sizes do not add up to the "
                                          f"{header.num_tokens} tokens in the header")
        if self.doc_idx[0] != 0 or self.doc_idx[-1] != n_seq or (np.diff(self.doc_idx) < 0).any():
            raise _corrupt(self.idx_path, "document index is not a monotonic cover of the sequences")
        # Token offset of every sequence (and one past the last), derived, not stored.
        self.pointers = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])

    # Sequences ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.sizes.size

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.pointers[i]:self.pointers[i + 1]]

    # Documents ------------------------------------------------------------------------------
    @property
    def num_documents(self) -> int:
        return self.doc_idx.size - 1

    def document_bounds(self) -> np.ndarray:
        """Token offset of each document's start, plus the end: shape [#documents + 1]."""
        return self.pointers[self.doc_idx]

    def document(self, d: int) -> np.ndarray:
        """All tokens of document d (its sequences are stored contiguously)."""
        start, end = self.pointers[self.doc_idx[d]], self.pointers[self.doc_idx[d + 1]]
        return self.tokens[start:end]

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, documents={self.num_documents}, "
                f"sequences={len(self)}, tokens={self.num_tokens}, vocab_size={self.vocab_size})")
