"""Synthetic samples: deterministic per (seed, sample index), independent of the layout.

They are learnable, so loss curves mean something: a GPT sample is an arithmetic sequence
mod V with a random start and stride (the model must infer the stride in context); a BERT
sample is two such segments, possibly swapped, with 15 % of the tokens masked.
"""

from __future__ import annotations

import numpy as np

from ptdp.config import ModelConfig
from ptdp.config.models import Samples

# BERT special tokens in synthetic data.
PAD, CLS, SEP, MASK = 0, 1, 2, 3
FIRST_WORD = 4


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, index])


def _progression(rng, length: int, low: int, high: int) -> np.ndarray:
    start = rng.integers(low, high)
    stride = rng.integers(1, 8)
    return low + (start - low + stride * np.arange(length)) % (high - low)


class SyntheticGPT:
    def __init__(self, model: ModelConfig, seed: int, size: int = 1 << 30):
        self.seq, self.vocab, self.seed, self.size = model.seq_length, model.vocab_size, seed, size

    def __len__(self):
        return self.size

    def __getitem__(self, index: int) -> dict:
        text = _progression(_rng(self.seed, index), self.seq + 1, 0, self.vocab).astype(np.int64)
        return {"tokens": text[:-1], "labels": text[1:],
                "loss_mask": np.ones(self.seq, dtype=np.float32)}


class SyntheticBERT:
    masked_lm = True   # its loss reads only the masked positions (ptdp/data/batching.py)

    def __init__(self, model: ModelConfig, seed: int, mask_prob: float = 0.15, size: int = 1 << 30):
        if model.vocab_size <= FIRST_WORD + 1:
            raise ValueError(f"model.vocab_size must exceed {FIRST_WORD + 1} for synthetic BERT data")
        self.seq, self.vocab, self.seed, self.size = model.seq_length, model.vocab_size, seed, size
        self.mask_prob = mask_prob

    def __len__(self):
        return self.size

    def __getitem__(self, index: int) -> dict:
        rng = _rng(self.seed, index)
        s = self.seq
        used = int(rng.integers(max(5, s // 2), s + 1))       # real tokens incl. specials
        words = _progression(rng, used - 3, FIRST_WORD, self.vocab)
        cut = int(rng.integers(1, len(words))) if len(words) > 1 else 1
        first, second = words[:cut], words[cut:]
        swapped = int(rng.integers(0, 2))
        if swapped:
            first, second = second, first
        tokens = np.full(s, PAD, dtype=np.int64)
        types = np.zeros(s, dtype=np.int64)
        row = np.concatenate([[CLS], first, [SEP], second, [SEP]]).astype(np.int64)
        tokens[: len(row)] = row
        types[len(first) + 2: len(row)] = 1
        padding_mask = (np.arange(s) < len(row)).astype(np.int64)

        candidates = np.flatnonzero(tokens >= FIRST_WORD)
        n_mask = max(1, int(round(self.mask_prob * len(candidates))))
        chosen = rng.choice(candidates, size=min(n_mask, len(candidates)), replace=False)
        labels = np.zeros(s, dtype=np.int64)
        loss_mask = np.zeros(s, dtype=np.float32)
        labels[chosen], loss_mask[chosen] = tokens[chosen], 1.0
        tokens[chosen] = MASK
        return {"tokens": tokens, "types": types, "labels": labels, "loss_mask": loss_mask,
                "padding_mask": padding_mask, "sop_label": np.int64(swapped)}


def synthetic_datasets(model: ModelConfig, seed: int, mask_prob: float = 0.15) -> dict:
    """train / valid / test streams drawn with different seeds."""
    pairs = model.family.samples is Samples.SENTENCE_PAIRS

    def make(s):
        return SyntheticBERT(model, s, mask_prob) if pairs else SyntheticGPT(model, s)
    return {"train": make(seed), "valid": make(seed + 1), "test": make(seed + 2)}
