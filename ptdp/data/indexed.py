"""Memory-mapped indexed dataset: token ids in `PREFIX.bin`, their layout in `PREFIX.idx`,
ptdp's metadata in `PREFIX.ptdp.json`.

A dataset is a list of *documents*, each a list of *sequences* (sentences for BERT, the whole
document for GPT). `.bin` holds every sequence's tokens back to back. `.idx` is Megatron-LM's
index (`ptdp/data/megatron_index.py`), so a pair written by Megatron's
`preprocess_data.py` trains here as it is, and a pair written here opens in
megatron-core. Megatron's index knows nothing of the vocabulary, so ptdp writes a *sidecar*
beside the pair, `PREFIX.ptdp.json`: the vocabulary size, the tokenizer's fingerprint and
special ids, whether sentences were split, and the pair's counts (a sidecar left over from an
earlier version of the data is refused, not believed). A Megatron pair without a sidecar loads
too: its vocabulary size is then unknown (`vocab_size` None; the model config says it) and
sentence boundaries are assumed when there are more sequences than documents or the prefix
ends in `_sentence` (Megatron's naming). `ptdp preprocess --describe` writes a sidecar for such
a pair. Datasets written by older ptdp versions (`PTDPIDX`, `ptdp/data/legacy_index.py`, with
the metadata inside the index) still load.

Both files are checked against each other on open, so a truncated or mismatched pair fails
with the file's name instead of producing garbage batches. The writer writes every file under
a temporary name and renames them only when complete.
"""

from __future__ import annotations

import json
import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

import ptdp.data.legacy_index as legacy_index
import ptdp.data.megatron_index as megatron_index
from ptdp.data.megatron_index import FormatError

SIDECAR_SUFFIX = ".ptdp.json"
SIDECAR_VERSION = 1


class IndexedDataError(ValueError):
    """A .bin/.idx pair is missing, corrupt, truncated or does not fit the configuration."""


class TokenIdError(IndexedDataError):
    """A token id the model has no embedding for, found while reading a sample."""


def check_token_ids(indexed, pieces: list, limit: int | None) -> None:
    """Raise TokenIdError naming the file and document if a token of `pieces` ((offset of its
    first token in the .bin, or a function giving it, called only then; tokens) of one sample)
    is not in [0, limit). Costs a min and a max over the sample's tokens; `limit` None checks
    nothing."""
    if limit is None:
        return
    for offset, tokens in pieces:
        if tokens.size and (int(tokens.max()) >= limit or int(tokens.min()) < 0):
            bad = int(np.flatnonzero((tokens >= limit) | (tokens < 0))[0])
            offset = offset() if callable(offset) else offset
            doc = int(np.searchsorted(indexed.document_bounds(), offset + bad, side="right")) - 1
            raise TokenIdError(
                f"{indexed.bin_path}: document {doc} holds token id {int(tokens[bad])}, outside "
                f"model.vocab_size={limit} (ids 0..{limit - 1}): the data was made with another "
                f"tokenizer, or model.vocab_size is too small")


def token_id_range(header, chunk: int = 1 << 26) -> tuple[int, int]:
    """(smallest, largest) token id in the .bin of `header` (read_index_header): one pass,
    at memory speed once the file is cached; what `ptdp check` reads of a pair whose
    vocabulary no sidecar records."""
    tokens = np.memmap(data_paths(header.prefix)[0], dtype=header.dtype, mode="r")
    low, high = 0, 0
    for begin in range(0, tokens.size, chunk):
        part = tokens[begin:begin + chunk]
        low, high = min(low, int(part.min())), max(high, int(part.max()))
    return low, high


def data_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


def sidecar_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}{SIDECAR_SUFFIX}")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Megatron's rule (`DType.optimal_dtype`): uint16 below 65,500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def _sidecar_counts(num_sequences: int, num_documents: int, num_tokens: int) -> dict:
    return {"num_sequences": num_sequences, "num_documents": num_documents,
            "num_tokens": num_tokens}


def _write_sidecar(path: Path, vocab_size: int, meta: dict, counts: dict) -> None:
    record = {"ptdp_sidecar": SIDECAR_VERSION, "vocab_size": int(vocab_size), **counts,
              "meta": meta}
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")


class IndexedDatasetWriter:
    """Streams documents into `PREFIX.bin`; `finish()` writes Megatron's `PREFIX.idx` and the
    sidecar `PREFIX.ptdp.json`.

    Use as a context manager: on an exception the temporary files are removed and nothing is
    left under the real names.
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, meta: dict | None = None):
        self.bin_path, self.idx_path = data_paths(prefix)
        self.sidecar_path = sidecar_path(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.vocab_size = int(vocab_size)
        self.dtype = dtype_for_vocab(self.vocab_size)
        self.meta = dict(meta or {})
        self._tmp = {p: p.with_name(f"{p.name}.tmp-{os.getpid()}")
                     for p in (self.bin_path, self.idx_path, self.sidecar_path)}
        self._bin = self._tmp[self.bin_path].open("wb")
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
        """Write the index and the sidecar, then move all three files to their real names."""
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int64)
        if sizes.size and sizes.max() > np.iinfo(np.int32).max:
            raise IndexedDataError(f"{self.bin_path}: a sequence of {sizes.max()} tokens does "
                                   f"not fit Megatron's int32 lengths")
        with self._tmp[self.idx_path].open("wb") as f:
            megatron_index.write_index(f, self.dtype, sizes, np.asarray(self._doc_idx))
        counts = _sidecar_counts(sizes.size, self.num_documents, int(sizes.sum()))
        _write_sidecar(self._tmp[self.sidecar_path], self.vocab_size, self.meta, counts)
        # The sidecar goes last: a crash before it leaves the old one, which the counts reject.
        for final, tmp in self._tmp.items():
            os.replace(tmp, final)

    def abort(self) -> None:
        self._bin.close()
        for tmp in self._tmp.values():
            tmp.unlink(missing_ok=True)

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
    """What a `.idx` header (and the sidecar) says, checked against both files' sizes."""

    prefix: str
    format: str               # "megatron" or "ptdpidx"
    dtype: np.dtype
    vocab_size: int | None    # None: a Megatron pair without a sidecar
    num_sequences: int
    num_documents: int
    num_tokens: int
    meta: dict
    layout: object = field(default=None, repr=False)   # the format's own header


def _corrupt(idx_path: Path, what: str) -> IndexedDataError:
    return IndexedDataError(f"{idx_path}: {what}; the index is corrupt or incomplete, re-run "
                            f"`ptdp preprocess` (or Megatron's preprocess_data.py)")


def _check_bin_size(bin_path: Path, idx_path: Path, dtype: np.dtype, num_tokens: int) -> None:
    size, expected = bin_path.stat().st_size, num_tokens * dtype.itemsize
    if size != expected:
        state = "truncated" if size < expected else "longer than its index"
        raise IndexedDataError(
            f"{bin_path}: {size} bytes but {idx_path.name} describes {num_tokens} {dtype.name} "
            f"tokens ({expected} bytes): the .bin is {state} or the pair does not belong "
            f"together; re-run `ptdp preprocess`")


def read_index_header(prefix: str | os.PathLike, sidecar: bool = True) -> IndexHeader:
    """Read only the header of `PREFIX.idx` (and the sidecar, unless `sidecar` is False) and
    check both files' sizes.

    Cheap (no token or size array is read), so `ptdp check` can use it on any corpus.
    """
    bin_path, idx_path = data_paths(prefix)
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise IndexedDataError(f"{path}: not found (data prefix '{prefix}'; create it "
                                   f"with `ptdp preprocess --output-prefix {prefix}`)")
    idx_size = idx_path.stat().st_size
    with idx_path.open("rb") as f:
        magic = f.read(len(megatron_index.MAGIC))
        f.seek(0)
        try:
            if magic.startswith(legacy_index.MAGIC):
                return _legacy_header(prefix, f, idx_size)
            if magic == megatron_index.MAGIC or len(magic) < len(megatron_index.MAGIC):
                return _megatron_header(prefix, f, idx_size, sidecar)   # a short file: says so
            raise FormatError(f"bad magic {magic!r}: neither Megatron's "
                              f"{megatron_index.MAGIC!r} nor ptdp's older {legacy_index.MAGIC!r}")
        except FormatError as err:
            raise _corrupt(idx_path, str(err)) from None


def _legacy_header(prefix, f, idx_size: int) -> IndexHeader:
    bin_path, idx_path = data_paths(prefix)
    h = legacy_index.read_header(f, idx_size)
    _check_bin_size(bin_path, idx_path, h.dtype, h.num_tokens)
    return IndexHeader(str(prefix), "ptdpidx", h.dtype, h.vocab_size, h.num_sequences,
                       h.num_documents, h.num_tokens, h.meta, layout=h)


def _megatron_header(prefix, f, idx_size: int, use_sidecar: bool) -> IndexHeader:
    bin_path, idx_path = data_paths(prefix)
    h = megatron_index.read_header(f, idx_size)
    last_len, last_ptr, first_doc, last_doc = megatron_index.tail_values(f, h)
    if first_doc != 0 or last_doc != h.num_sequences:
        raise FormatError(f"document index runs from sequence {first_doc} to {last_doc}, not "
                          f"over the {h.num_sequences} sequences")
    end = last_ptr + last_len * h.dtype.itemsize
    if last_len < 0 or last_ptr < 0 or last_ptr % h.dtype.itemsize:
        raise FormatError(f"last sequence has length {last_len} at byte {last_ptr}")
    num_tokens = end // h.dtype.itemsize
    _check_bin_size(bin_path, idx_path, h.dtype, num_tokens)
    counts = _sidecar_counts(h.num_sequences, h.num_documents, num_tokens)
    sidecar = _read_sidecar(prefix, counts) if use_sidecar else None
    if sidecar is None:
        sentences = h.num_sequences > h.num_documents or str(prefix).endswith("_sentence")
        return IndexHeader(str(prefix), "megatron", h.dtype, None, *counts.values(),
                           {"sentences": sentences}, layout=h)
    vocab_size, meta = sidecar
    return IndexHeader(str(prefix), "megatron", h.dtype, vocab_size, *counts.values(), meta,
                       layout=h)


def _read_sidecar(prefix, counts: dict) -> tuple[int, dict] | None:
    """(vocab size, metadata) from `PREFIX.ptdp.json`, or None when there is none."""
    path = sidecar_path(prefix)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        version, vocab, meta = record["ptdp_sidecar"], int(record["vocab_size"]), record["meta"]
        found = {key: int(record[key]) for key in counts}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise IndexedDataError(f"{path}: not a ptdp sidecar ({type(err).__name__}: {err}); "
                               f"delete it or re-run `ptdp preprocess`") from None
    if version != SIDECAR_VERSION:
        raise IndexedDataError(f"{path}: sidecar version {version}, this ptdp reads "
                               f"version {SIDECAR_VERSION}")
    if found != counts:
        raise IndexedDataError(
            f"{path}: describes {found} but {Path(f'{prefix}.idx').name} holds {counts}: the "
            f"sidecar belongs to an earlier version of the data; delete it or re-run "
            f"`ptdp preprocess --describe`")
    return vocab, meta


class IndexedDataset:
    """Read-only view of a .bin/.idx pair; `ds[i]` is sequence i as a numpy array (no copy)."""

    def __init__(self, prefix: str | os.PathLike, sidecar: bool = True):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = data_paths(prefix)
        header = read_index_header(prefix, sidecar)
        self.format = header.format
        self.meta, self.dtype = header.meta, header.dtype
        self.vocab_size, self.num_tokens = header.vocab_size, header.num_tokens
        self.modes = None   # Megatron's per-sequence modes, multimodal datasets only
        if header.format == "ptdpidx":
            self.doc_idx, self.sizes = legacy_index.read_arrays(self.idx_path, header.layout)
            self._check_arrays(header)
        else:
            self._read_megatron(header)
        self.tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r") if self.num_tokens
                       else np.empty(0, self.dtype))

    def _read_megatron(self, header: IndexHeader) -> None:
        arrays = megatron_index.read_arrays(self.idx_path, header.layout)
        self.doc_idx, self.sizes, self.modes = arrays["doc_idx"], arrays["lengths"], arrays["modes"]
        self._check_arrays(header)
        # ptdp reads sequences by token offset; megatron-core always writes them back to back.
        if not np.array_equal(arrays["pointers"], self.pointers[:-1] * self.dtype.itemsize):
            raise _corrupt(self.idx_path, "sequence pointers are not the running sum of the "
                                          "lengths (sequences not stored back to back)")

    def _check_arrays(self, header: IndexHeader) -> None:
        """doc_idx and sizes, checked against the header's totals."""
        n_seq = header.num_sequences
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

    def max_token(self, chunk: int = 1 << 24) -> int:
        """The largest token id in `.bin` (reads the whole file; -1 when empty)."""
        return max((int(self.tokens[i:i + chunk].max()) for i in range(0, self.num_tokens, chunk)),
                   default=-1)

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, format={self.format}, "
                f"documents={self.num_documents}, sequences={len(self)}, "
                f"tokens={self.num_tokens}, vocab_size={self.vocab_size})")


def describe(prefix: str | os.PathLike, vocab_size: int, meta: dict) -> Path:
    """Write (or replace) the sidecar of an existing Megatron pair, after checking every token
    fits the vocabulary, so that ptdp knows its tokenizer; returns the sidecar's path."""
    ds = IndexedDataset(prefix, sidecar=False)
    if ds.format != "megatron":
        raise IndexedDataError(f"{ds.idx_path}: a PTDPIDX index keeps its metadata inside; "
                               f"it needs no sidecar")
    top = ds.max_token()
    if top >= vocab_size:
        raise IndexedDataError(f"{ds.bin_path}: holds token id {top}, outside the tokenizer's "
                               f"vocabulary of {vocab_size}: not the tokenizer of this data")
    path = sidecar_path(prefix)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    _write_sidecar(tmp, vocab_size, meta, _sidecar_counts(len(ds), ds.num_documents, ds.num_tokens))
    os.replace(tmp, path)
    return path
