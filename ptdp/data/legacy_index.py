"""ptdp's own `.idx` layout (`PTDPIDX`), written by ptdp before it wrote Megatron's format;
read-only now, so datasets preprocessed by older versions keep training:

    header   magic b"PTDPIDX\\0", format version, dtype code, vocab size,
             #sequences, #documents, #tokens, length of the metadata blob
    metadata JSON (tokenizer fingerprint, special-token ids, sentence splitting, ...)
    doc_idx  int64[#documents + 1]  index of each document's first sequence (and the end)
    sizes    int32[#sequences]      tokens per sequence
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ptdp.data.megatron_index import FormatError

MAGIC = b"PTDPIDX\x00"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQQQ")  # magic, version, dtype, vocab, seqs, docs, tokens, meta
DTYPES = {1: np.uint16, 2: np.int32}


@dataclass(frozen=True)
class LegacyHeader:
    dtype: np.dtype
    vocab_size: int
    num_sequences: int
    num_documents: int
    num_tokens: int
    meta: dict
    arrays_offset: int   # where doc_idx starts


def read_header(f: BinaryIO, file_size: int) -> LegacyHeader:
    head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        raise FormatError(f"file is {len(head)} bytes, shorter than the {HEADER.size}-byte "
                          f"PTDPIDX header")
    magic, version, code, vocab, n_seq, n_doc, n_tok, meta_len = HEADER.unpack(head)
    if version != VERSION:
        raise FormatError(f"PTDPIDX format version {version}, this ptdp reads version {VERSION}")
    if code not in DTYPES:
        raise FormatError(f"unknown dtype code {code}")
    expected = HEADER.size + meta_len + 4 * n_seq + 8 * (n_doc + 1)
    if file_size != expected:
        raise FormatError(f"file is {file_size} bytes but its header describes {expected} "
                          f"({n_seq} sequences, {n_doc} documents)")
    try:
        meta = json.loads(f.read(meta_len).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise FormatError("metadata is not valid JSON") from None
    return LegacyHeader(np.dtype(DTYPES[code]), int(vocab), int(n_seq), int(n_doc), int(n_tok),
                        meta, HEADER.size + meta_len)


def read_arrays(idx_path: Path, header: LegacyHeader) -> tuple[np.ndarray, np.ndarray]:
    """(doc_idx, sizes), memory-mapped."""
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    n_doc, start = header.num_documents, header.arrays_offset
    doc_idx = np.frombuffer(raw, np.int64, n_doc + 1, start)
    sizes = np.frombuffer(raw, np.int32, header.num_sequences, start + 8 * (n_doc + 1))
    return doc_idx, sizes
