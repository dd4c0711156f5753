"""BERT dataset: sentence pairs with sentence-order prediction (SOP) and masked tokens.

A sample is a run of consecutive sentences from one document (at least two) holding up to
seq_length - 3 tokens, split at a random sentence boundary into segments A and B:

    [CLS] A [SEP] B [SEP] [PAD] ...        types 0 for [CLS] A [SEP], 1 for B [SEP]

With probability 1/2 the segments are swapped (`sop_label` = 1). Then `mask_prob` of the
segment tokens are chosen for prediction: 80 % become [MASK], 10 % a random token, 10 % stay
unchanged; `labels` holds the original token there and `loss_mask` marks them.

Which sentences form sample i is decided once (cached next to the data); the split point,
swap, truncation and masking are drawn from an RNG seeded by (seed, i), so `ds[i]` is
deterministic without storing anything per sample.
"""

from __future__ import annotations

import numpy as np

from ptdp.config.models import Samples
from ptdp.data.index_cache import cache_key, cached_arrays
from ptdp.data.indexed import IndexedDataError, IndexedDataset
from ptdp.data.tokenizer import CLS, EOD, MASK, PAD, SEP

SHORT_SEQ_PROB = 0.1  # share of samples with a shorter target length (as in BERT)


def build_bert_index(sizes: np.ndarray, doc_idx: np.ndarray, max_tokens: int,
                     seed: int) -> dict[str, np.ndarray]:
    """Group each document's sentences into samples of >= 2 sentences and ~max_tokens tokens.

    `sizes` are sentence lengths, `doc_idx` the first sentence of each document (plus the
    end). Returns `samples`: rows of (first sentence, end sentence), in shuffled order.
    """
    rng = np.random.default_rng(seed)

    def target() -> int:
        return int(rng.integers(2, max_tokens + 1)) if rng.random() < SHORT_SEQ_PROB else max_tokens

    samples = []
    for d in range(doc_idx.size - 1):
        first, end = int(doc_idx[d]), int(doc_idx[d + 1])
        if end - first < 2:
            continue  # a single sentence cannot make a pair
        start, length, goal = first, 0, target()
        for s in range(first, end):
            length += int(sizes[s])
            remaining = end - (s + 1)
            # Close a sample once it is long enough, but never strand a lone last sentence.
            full = length >= goal and s + 1 - start >= 2 and remaining != 1
            if full or remaining == 0:
                if s + 1 - start >= 2:
                    samples.append((start, s + 1))
                start, length, goal = s + 1, 0, target()
    samples = np.asarray(samples, dtype=np.int64).reshape(-1, 2)
    return {"samples": samples[rng.permutation(len(samples))]}


def _truncate_pair(a: np.ndarray, b: np.ndarray, max_tokens: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Trim the longer segment first until both fit; each cut splits randomly front/back."""
    if a.size + b.size <= max_tokens:
        return a, b
    short = min(a.size, b.size)
    if 2 * short <= max_tokens:
        keep_short, keep_long = short, max_tokens - short
    else:
        keep_short, keep_long = max_tokens // 2, max_tokens - max_tokens // 2
    keep_a, keep_b = (keep_long, keep_short) if a.size >= b.size else (keep_short, keep_long)

    def cut(seg: np.ndarray, keep: int) -> np.ndarray:
        front = int(rng.binomial(seg.size - keep, 0.5))
        return seg[front:front + keep]

    return cut(a, keep_a), cut(b, keep_b)


class BertDataset:
    """Map-style BERT pretraining samples over documents [doc_begin, doc_end), or over the
    document ids `documents` when given (the split's share, ptdp/data/build.py)."""

    masked_lm = True   # its loss reads only the masked positions (ptdp/data/batching.py)

    def __init__(self, indexed: IndexedDataset, doc_begin: int, doc_end: int,
                 seq_length: int, seed: int, mask_prob: float = 0.15, name: str = "train",
                 documents=None):
        if not indexed.meta.get("sentences"):
            raise IndexedDataError(f"{indexed.idx_path}: BERT needs sentence boundaries; re-run "
                                   f"`ptdp preprocess --split-sentences`")
        if seq_length < 5:
            raise ValueError(f"model.seq_length={seq_length} is too short for BERT "
                             f"([CLS] A [SEP] B [SEP] needs at least 5)")
        special = indexed.meta.get("special_ids", {})
        missing = [t for t in (CLS, SEP, MASK, PAD, EOD) if t not in special]
        if missing and indexed.vocab_size is None:   # a Megatron pair without ptdp's sidecar
            raise IndexedDataError(f"{indexed.idx_path}: BERT needs the special-token ids, which "
                                   f"a Megatron pair does not record; write them once with "
                                   f"`ptdp preprocess --describe --output-prefix "
                                   f"{indexed.prefix} --tokenizer TOKENIZER`")
        if missing:
            raise IndexedDataError(f"{indexed.idx_path}: tokenizer had no {', '.join(missing)}; "
                                   f"train it with `ptdp tokenizer train` and re-run preprocess")
        self.indexed, self.seq_length, self.seed, self.name = indexed, seq_length, seed, name
        self.mask_prob = mask_prob
        self.cls_id, self.sep_id, self.mask_id = special[CLS], special[SEP], special[MASK]
        self.pad_id, self.eod_id = special[PAD], special[EOD]
        self._random_ids = np.setdiff1d(np.arange(indexed.vocab_size), list(special.values()))

        docs = np.arange(doc_begin, doc_end) if documents is None else np.asarray(documents)
        first, end = indexed.doc_idx[docs].astype(np.int64), indexed.doc_idx[docs + 1].astype(np.int64)
        counts = end - first
        doc_idx = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        # the split's sentences, document after document: sample rows index into this
        self._sentences = np.repeat(first - doc_idx[:-1], counts) + np.arange(doc_idx[-1])
        sizes = indexed.sizes[self._sentences]
        kind = Samples.SENTENCE_PAIRS.value
        key = cache_key(sizes=sizes, doc_idx=doc_idx, seq_length=seq_length, seed=seed, kind=kind)
        index = cached_arrays(indexed.prefix, f"{name}-{kind}", key,
                              lambda: build_bert_index(sizes, doc_idx, seq_length - 3, seed))
        self.samples = index["samples"]

    def __len__(self) -> int:
        return len(self.samples)

    def _segments(self, i: int, rng) -> tuple[np.ndarray, np.ndarray, int]:
        """Sentences of sample i split into (A, B) at a random boundary; maybe swapped."""
        start, end = (int(x) for x in self.samples[i])
        sentences = [np.asarray(self.indexed[int(self._sentences[s])], dtype=np.int64)
                     for s in range(start, end)]
        sentences = [s[s != self.eod_id] for s in sentences]
        cut = int(rng.integers(1, len(sentences)))
        a, b = np.concatenate(sentences[:cut]), np.concatenate(sentences[cut:])
        swapped = int(rng.random() < 0.5)
        return (b, a, swapped) if swapped else (a, b, swapped)

    def _mask(self, tokens: np.ndarray, candidates: np.ndarray, rng):
        """Choose mask_prob of the candidate positions; 80 % [MASK], 10 % random, 10 % kept."""
        labels = np.zeros_like(tokens)
        loss_mask = np.zeros(tokens.size, dtype=np.float32)
        n = min(candidates.size, max(1, int(round(self.mask_prob * candidates.size))))
        chosen = rng.choice(candidates, size=n, replace=False)
        labels[chosen], loss_mask[chosen] = tokens[chosen], 1.0
        action = rng.random(n)
        tokens[chosen[action < 0.8]] = self.mask_id
        randomised = chosen[(action >= 0.8) & (action < 0.9)]
        tokens[randomised] = rng.choice(self._random_ids, size=randomised.size)
        return tokens, labels, loss_mask

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"{self.name} sample {i} out of range: the {self.name} split of "
                             f"{self.indexed.prefix} has {len(self)} samples")
        rng = np.random.default_rng([self.seed, i])
        a, b, swapped = self._segments(i, rng)
        a, b = _truncate_pair(a, b, self.seq_length - 3, rng)
        s, n = self.seq_length, a.size + b.size + 3
        tokens = np.full(s, self.pad_id, dtype=np.int64)
        tokens[:n] = np.concatenate([[self.cls_id], a, [self.sep_id], b, [self.sep_id]])
        types = np.zeros(s, dtype=np.int64)
        types[a.size + 2:n] = 1
        padding_mask = (np.arange(s) < n).astype(np.int64)
        candidates = np.concatenate([np.arange(1, a.size + 1), np.arange(a.size + 2, n - 1)])
        tokens, labels, loss_mask = self._mask(tokens, candidates, rng)
        return {"tokens": tokens, "types": types, "labels": labels, "loss_mask": loss_mask,
                "padding_mask": padding_mask, "sop_label": np.int64(swapped)}
