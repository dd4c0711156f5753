"""Megatron-LM's `.idx` layout, the one megatron-core's `IndexedDataset` reads and
`preprocess_data.py` writes (read from its source; no Megatron import):

    magic        b"MMIDIDX\\0\\0"                 9 bytes
    version      u64, always 1
    dtype code   u8 (the token dtype in `.bin`, see DTYPES)
    #sequences   u64
    #doc entries u64: #documents + 1 (the document index starts with 0)
    lengths      int32[#sequences]   tokens per sequence
    pointers     int64[#sequences]   byte offset of each sequence in `.bin`
    doc index    int64[#documents + 1]  first sequence of each document, then #sequences
    modes        int8[#sequences]    only in multimodal datasets

Nothing else is stored: no vocabulary size and no tokenizer, which ptdp keeps in a sidecar
file (`ptdp/data/indexed.py`). Everything here is plain numpy over bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")   # magic, version, dtype code, #sequences, #doc entries
# megatron/core/datasets/indexed_dataset.py `DType`: every code megatron-core can write.
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
DTYPE_CODES = {np.dtype(v): k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class MegatronHeader:
    version: int
    dtype_code: int
    num_sequences: int
    num_documents: int
    multimodal: bool          # the int8 modes array follows the document index

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype_code])

    def arrays_size(self) -> int:
        n = self.num_sequences
        return 4 * n + 8 * n + 8 * (self.num_documents + 1) + (n if self.multimodal else 0)


class FormatError(ValueError):
    """What is wrong with a `.idx`, without the file name (the caller adds it)."""


def read_header(f: BinaryIO, file_size: int) -> MegatronHeader:
    """Parse and check the fixed header of an open `.idx`; the file size tells whether the
    optional modes array is there."""
    head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        raise FormatError(f"file is {len(head)} bytes, shorter than the {HEADER.size}-byte "
                          f"Megatron header")
    magic, version, code, n_seq, n_entries = HEADER.unpack(head)
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise FormatError(f"Megatron index version {version}; megatron-core writes and reads "
                          f"only version {VERSION}")
    if code not in DTYPES:
        raise FormatError(f"unknown dtype code {code} (megatron-core's codes are "
                          f"{sorted(DTYPES)})")
    if n_entries < 1:
        raise FormatError("document index is empty (it always starts with 0)")
    plain = MegatronHeader(version, code, n_seq, n_entries - 1, multimodal=False)
    expected = HEADER.size + plain.arrays_size()
    if file_size == expected + n_seq and n_seq > 0:
        return MegatronHeader(version, code, n_seq, n_entries - 1, multimodal=True)
    if file_size != expected:
        raise FormatError(f"file is {file_size} bytes but its header describes {expected} "
                          f"({n_seq} sequences, {n_entries - 1} documents)")
    return plain


def tail_values(f: BinaryIO, header: MegatronHeader) -> tuple[int, int, int, int]:
    """(last length, last pointer, first and last document-index entries), read without
    loading any array: enough to check the `.bin`'s size on any corpus in microseconds."""
    n, d = header.num_sequences, header.num_documents
    lengths_at, pointers_at = HEADER.size, HEADER.size + 4 * n
    docs_at = pointers_at + 8 * n

    def value(offset: int, fmt: str) -> int:
        f.seek(offset)
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

    last_len = value(lengths_at + 4 * (n - 1), "<i") if n else 0
    last_ptr = value(pointers_at + 8 * (n - 1), "<q") if n else 0
    return last_len, last_ptr, value(docs_at, "<q"), value(docs_at + 8 * d, "<q")


def read_arrays(idx_path: Path, header: MegatronHeader) -> dict[str, np.ndarray]:
    """lengths, byte pointers, document index and modes (or None), memory-mapped."""
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    n, d, at = header.num_sequences, header.num_documents, HEADER.size
    lengths = np.frombuffer(raw, np.int32, n, at)
    pointers = np.frombuffer(raw, np.int64, n, at + 4 * n)
    doc_idx = np.frombuffer(raw, np.int64, d + 1, at + 12 * n)
    modes = np.frombuffer(raw, np.int8, n, at + 12 * n + 8 * (d + 1)) if header.multimodal else None
    return {"lengths": lengths, "pointers": pointers, "doc_idx": doc_idx, "modes": modes}


def write_index(f: BinaryIO, dtype: np.dtype, lengths: np.ndarray, doc_idx: np.ndarray) -> None:
    """Write a complete `.idx` (text: no modes) for tokens of `dtype` stored back to back in
    `.bin`."""
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    f.write(HEADER.pack(MAGIC, VERSION, DTYPE_CODES[np.dtype(dtype)], lengths.size,
                        len(doc_idx)))
    f.write(lengths.tobytes())
    f.write(pointers.tobytes())
    f.write(np.asarray(doc_idx, dtype=np.int64).tobytes())
