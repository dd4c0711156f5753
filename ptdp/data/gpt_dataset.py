"""GPT dataset: fixed-length samples cut from a shuffled stream of documents.

The documents of one split are shuffled (per seed) and concatenated; sample j is tokens
[j*L, j*L + L + 1) of that stream, so samples cross document boundaries (each document ends
with <eod>) and no token is wasted on padding. The order of the samples is shuffled again.
`ds[i]` returns inputs `tokens`, next-token `labels` and a `loss_mask`.

The index (document order, where each sample starts, sample order) depends only on the
documents' sizes, L and the seed; it is cached next to the data.

`MegatronGPTDataset` is the same map-style dataset in Megatron-LM's sample order
(`data.sampling: megatron`, indices from ptdp/data/megatron_sampling.py). Both honour the
end-of-document options (`EodOptions`, Megatron's `_get_ltor_masks_and_position_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ptdp.config.models import Samples
from ptdp.data.index_cache import cache_key, cached_arrays
from ptdp.data.indexed import IndexedDataset, check_token_ids
from ptdp.data.megatron_sampling import build_gpt_indices


@dataclass(frozen=True)
class EodOptions:
    """What a sample does at an <eod> inside it (data.reset_position_ids, ...)."""

    eod_id: int
    reset_position_ids: bool = False     # positions restart at 0 after each <eod>
    reset_attention_mask: bool = False   # no token attends to one before an earlier <eod>
    eod_mask_loss: bool = False          # no loss where the *input* token is <eod>


def gpt_sample(text: np.ndarray, eod: EodOptions | None = None) -> dict[str, np.ndarray]:
    """L + 1 tokens -> inputs, labels, loss mask, and with the end-of-document options
    `position_ids` and `document_ids` ([L] int64: how many <eod> precede each input token;
    the model lets a token attend only to its own document's, models/gpt.py)."""
    tokens, labels = text[:-1], text[1:]
    sample = {"tokens": tokens, "labels": labels,
              "loss_mask": np.ones(tokens.size, dtype=np.float32)}
    if eod is None:   # no option on (ptdp/data/build.py `eod_options`)
        return sample
    is_eod = tokens == eod.eod_id
    if eod.eod_mask_loss:
        sample["loss_mask"][is_eod] = 0.0
    # document of each token: the <eod> itself still belongs to the document it ends
    document = np.concatenate([[0], np.cumsum(is_eod[:-1])]).astype(np.int64)
    if eod.reset_position_ids:
        first = np.concatenate([[0], np.flatnonzero(is_eod[:-1]) + 1])   # each document's start
        sample["position_ids"] = np.arange(tokens.size, dtype=np.int64) - first[document]
    if eod.reset_attention_mask:
        sample["document_ids"] = document
    return sample


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
                 seq_length: int, seed: int, name: str = "train", documents=None,
                 eod: EodOptions | None = None, vocab_limit: int | None = None):
        self.indexed, self.seq_length, self.name, self.eod = indexed, seq_length, name, eod
        self.vocab_limit = vocab_limit   # model.vocab_size: every sample's ids are checked
        docs = np.arange(doc_begin, doc_end) if documents is None else np.asarray(documents)
        bounds = indexed.document_bounds()
        self.doc_starts = bounds[docs]
        doc_sizes = bounds[docs + 1] - bounds[docs]
        kind = Samples.DOCUMENTS.value
        key = cache_key(doc_sizes=doc_sizes, seq_length=seq_length, seed=seed, kind=kind)
        index = cached_arrays(indexed.prefix, f"{name}-{kind}", key,
                              lambda: build_gpt_index(doc_sizes, seq_length, seed))
        self.doc_order, self.shuffle = index["doc_order"], index["shuffle"]
        self.sample_doc, self.sample_offset = index["sample_doc"], index["sample_offset"]
        self._doc_sizes = doc_sizes

    def __len__(self) -> int:
        return int(self.shuffle.size)

    def sample_tokens(self, i: int) -> np.ndarray:
        """The L + 1 tokens of sample i, gathered across as many documents as needed."""
        if not 0 <= i < len(self):
            raise out_of_range(self, i)
        j = int(self.shuffle[i])
        pos, offset = int(self.sample_doc[j]), int(self.sample_offset[j])
        need, parts = self.seq_length + 1, []
        while need > 0:
            doc = int(self.doc_order[pos])
            start = int(self.doc_starts[doc]) + offset
            take = min(need, int(self._doc_sizes[doc]) - offset)
            parts.append((start, self.indexed.tokens[start:start + take]))
            need -= take
            pos, offset = pos + 1, 0
        check_token_ids(self.indexed, parts, self.vocab_limit)
        return np.concatenate([tokens for _, tokens in parts]).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return gpt_sample(self.sample_tokens(i), self.eod)


def out_of_range(dataset, i: int) -> IndexError:
    return IndexError(f"{dataset.name} sample {i} out of range: the {dataset.name} split of "
                      f"{dataset.indexed.prefix} has {len(dataset)} samples"
                      + ("" if len(dataset) else "; give it more data with data.split"))


class MegatronGPTDataset:
    """Megatron-LM's GPTDataset over the sequences `sequences` of an indexed dataset (one
    split's contiguous range): at least `num_samples` samples (None: one epoch), in Megatron's
    order for `seed`, sample for sample (tests/data/test_megatron_sampling.py)."""

    def __init__(self, indexed: IndexedDataset, sequences: np.ndarray, seq_length: int,
                 num_samples: int | None, seed: int, name: str = "train",
                 eod: EodOptions | None = None, vocab_limit: int | None = None):
        self.indexed, self.seq_length, self.name, self.eod = indexed, seq_length, name, eod
        self.vocab_limit = vocab_limit   # model.vocab_size: every sample's ids are checked
        sizes = np.asarray(indexed.sizes, dtype=np.int32)
        sequences = np.asarray(sequences, dtype=np.int32)
        key = cache_key(sizes=sizes[sequences], first=int(sequences[0]) if sequences.size else 0,
                        seq_length=seq_length, num_samples=num_samples, seed=seed,
                        kind="megatron-gpt")
        index = cached_arrays(indexed.prefix, f"{name}-megatron-gpt", key,
                              lambda: build_gpt_indices(sizes, sequences, seq_length,
                                                        num_samples, seed))
        self.document_index = index["document_index"]
        self.sample_index, self.shuffle_index = index["sample_index"], index["shuffle_index"]

    def __len__(self) -> int:
        return int(self.shuffle_index.size)

    def sample_tokens(self, i: int) -> np.ndarray:
        """Tokens [j L, j L + L] of the epochs' document stream, j = shuffle_index[i]."""
        if not 0 <= i < len(self):
            raise out_of_range(self, i)
        j = int(self.shuffle_index[i])
        (first, start), (last, end) = self.sample_index[j], self.sample_index[j + 1]
        parts = []
        for pos in range(int(first), int(last) + 1):
            k = int(self.document_index[pos])
            begin = start if pos == first else 0
            parts.append((k, begin, self.indexed[k][begin:(end + 1 if pos == last else None)]))
        check_token_ids(self.indexed, [(lambda k=k, b=begin: int(self.indexed.pointers[k]) + b,
                                        tokens) for k, begin, tokens in parts], self.vocab_limit)
        return np.concatenate([tokens for _, _, tokens in parts]).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return gpt_sample(self.sample_tokens(i), self.eod)
