"""GPT dataset: fixed-length samples cut from a shuffled stream of documents.

The documents of one split are shuffled (per seed) and concatenated; sample j is tokens
[j*L, j*L + L + 1) of that stream, so samples cross document boundaries (each document ends
with <eod>) and no token is wasted on padding. The order of the samples is shuffled again.
`ds[i]` returns inputs `tokens`, next-token `labels` and a `loss_mask`.

The index (document order, where each sample starts, sample order) depends only on the
documents' sizes, L and the seed; it is cached next to the data.
"""

from __future__ import annotations

import numpy as np

from ptdp.data.index_cache import cache_key, cached_arrays
from ptdp.data.indexed import IndexedDataset


def build_gpt_index(doc_sizes: np.ndarray, seq_length: int, seed: int) -> dict[str, np.ndarray]:
    """Shuffle documents, locate every sample's start in the stream, shuffle the samples.

    Returns `doc_order` (document ids, relative to the split), `sample_doc` / `sample_offset`
    (position in `doc_order` and token offset where sample j starts) and `shuffle`.
    """
    rng = np.random.default_rng(seed)
    doc_order = rng.permutation(doc_sizes.size)
    ends = np.cumsum(doc_sizes[doc_order], dtype=np.int64)
    total = int(ends[-1]) if ends.size else 0
    num_samples = max(total - 1, 0) // seq_length  # each sample needs L + 1 tokens
    starts = np.arange(num_samples, dtype=np.int64) * seq_length
    sample_doc = np.searchsorted(ends, starts, side="right")  # skips empty documents
    doc_start = np.concatenate([[0], ends])[sample_doc]
    return {"doc_order": doc_order, "sample_doc": sample_doc,
            "sample_offset": starts - doc_start, "shuffle": rng.permutation(num_samples)}


class GPTDataset:
    """Map-style dataset over documents [doc_begin, doc_end) of an indexed dataset, or over
    the document ids `documents` when given (the split's share, ptdp/data/build.py)."""

    def __init__(self, indexed: IndexedDataset, doc_begin: int, doc_end: int,
                 seq_length: int, seed: int, name: str = "train", documents=None):
        self.indexed, self.seq_length, self.name = indexed, seq_length, name
        docs = np.arange(doc_begin, doc_end) if documents is None else np.asarray(documents)
        bounds = indexed.document_bounds()
        self.doc_starts = bounds[docs]
        doc_sizes = bounds[docs + 1] - bounds[docs]
        key = cache_key(doc_sizes=doc_sizes, seq_length=seq_length, seed=seed, kind="gpt")
        index = cached_arrays(indexed.prefix, f"{name}-gpt", key,
                              lambda: build_gpt_index(doc_sizes, seq_length, seed))
        self.doc_order, self.shuffle = index["doc_order"], index["shuffle"]
        self.sample_doc, self.sample_offset = index["sample_doc"], index["sample_offset"]
        self._doc_sizes = doc_sizes

    def __len__(self) -> int:
        return int(self.shuffle.size)

    def sample_tokens(self, i: int) -> np.ndarray:
        """The L + 1 tokens of sample i, gathered across as many documents as needed."""
        if not 0 <= i < len(self):
            raise IndexError(f"{self.name} sample {i} out of range: the {self.name} split of "
                             f"{self.indexed.prefix} has {len(self)} samples"
                             + ("" if len(self) else "; give it more data with data.split"))
        j = int(self.shuffle[i])
        pos, offset = int(self.sample_doc[j]), int(self.sample_offset[j])
        need, parts = self.seq_length + 1, []
        while need > 0:
            doc = int(self.doc_order[pos])
            start = int(self.doc_starts[doc]) + offset
            take = min(need, int(self._doc_sizes[doc]) - offset)
            parts.append(self.indexed.tokens[start:start + take])
            need -= take
            pos, offset = pos + 1, 0
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        tokens = self.sample_tokens(i)
        return {"tokens": tokens[:-1], "labels": tokens[1:],
                "loss_mask": np.ones(self.seq_length, dtype=np.float32)}
