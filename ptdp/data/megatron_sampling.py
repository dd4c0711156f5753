"""Megatron-LM's sample order, rebuilt in numpy (`data.sampling: megatron`).

Megatron's GPTDataset (megatron-core's datasets/gpt_dataset.py and the C++ helper
`build_sample_idx`) works on *sequences* (a GPT corpus has one per document) and builds:

* the **document index**: the split's sequence ids repeated for as many epochs as the run
  needs, shuffled together with `numpy.random.RandomState(seed)`; when the last epoch is
  needed for less than 80 % of its samples it is shuffled on its own and appended, so the
  partial epoch does not favour some documents over the others in the earlier ones;
* the **sample index**: where in the document index each sample starts (row k: position,
  token offset). Sample k is tokens [k L, k L + L] of the concatenated stream: L + 1 tokens,
  the last one shared with the next sample;
* the **shuffle index**: a permutation of the samples from the same RandomState (the separate
  last epoch's samples shuffled apart, after the others).

Splits are contiguous ranges of sequences (`split_ranges`), and several datasets are blended
by `blending_indices`: sample i goes to the dataset whose count lags its weight the most.
Everything here is a pure function of sizes, weights and the seed, so the tests compare these
arrays with megatron-core's own (tests/data/test_megatron_sampling.py); nothing imports Megatron.
"""

from __future__ import annotations

import math

import numpy as np

SEPARATE_LAST_EPOCH_BELOW = 0.80   # Megatron's threshold, as a share of an epoch's samples
BLEND_SURPLUS = 0.005              # mid-level datasets are built this much larger than used


def normalize(weights) -> list[float]:
    """w / sum(w) in float64, exactly as Megatron divides (the blend indices depend on it)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_ranges(ratios: list[float], num_elements: int) -> list[tuple[int, int] | None]:
    """Train, valid and test as contiguous [begin, end) ranges of the sequences, or None for a
    split with zero weight (Megatron's split matrix, then `round(bound * n)`)."""
    ratios = list(ratios) + [0.0] * (3 - len(ratios))
    weights = normalize(ratios)
    bounds = [0.0]
    for w in weights:   # left to right, as Megatron accumulates, so the floats match
        bounds.append(bounds[-1] + w)
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi <= lo:
            out.append(None)
        else:
            out.append((int(round(lo * float(num_elements))), int(round(hi * float(num_elements)))))
    return out


def num_epochs(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """How many passes over the split give `num_samples` samples of L + 1 tokens."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(documents: np.ndarray, epochs: int, rs: np.random.RandomState,
                         separate_last: bool) -> np.ndarray:
    """int32 sequence ids, `epochs` times, shuffled (the last epoch apart when separate)."""
    if separate_last and epochs > 1:
        first = build_document_index(documents, epochs - 1, rs, False)
        return np.concatenate([first, build_document_index(documents, 1, rs, False)])
    index = np.tile(np.asarray(documents), epochs).astype(np.int32)
    rs.shuffle(index)
    return index


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_samples: int) -> np.ndarray:
    """[num_samples + 1, 2] (position in the document index, token offset) of every sample's
    first token, and one past the last sample (the C++ helper's drop-last-partial behaviour).

    Sample k starts at token k L of the stream; its row names the document that holds that
    token. The first row is always (0, 0), even before empty documents, as the helper writes.
    """
    lengths = sizes[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")   # skips empty documents
    offset = starts - (ends[position] - lengths[position])
    position[0], offset[0] = 0, 0
    largest = max(document_index.shape[0], int(sizes.max()) if sizes.size else 0)
    dtype = np.int32 if largest <= np.iinfo(np.int32).max else np.int64
    return np.stack([position, offset], axis=1).astype(dtype)


def build_shuffle_index(num_samples: int, total: int, rs: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples), then (shuffled apart) of [num_samples, total)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rs.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rs.shuffle(last)
    return np.concatenate([first, last])


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, seq_length: int,
                      num_samples: int | None, seed: int) -> dict[str, np.ndarray]:
    """Megatron GPTDataset's document, sample and shuffle indices for the sequences
    `documents` (ids into `sizes`), at least `num_samples` samples (None: one epoch)."""
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    if tokens_per_epoch <= 1:   # Megatron loops forever here; an empty split has no samples
        return {"document_index": np.zeros(0, np.int32),
                "sample_index": np.zeros((1, 2), np.int32),
                "shuffle_index": np.zeros(0, np.uint32)}
    epochs = num_epochs(tokens_per_epoch, num_samples, seq_length)
    separate_last, before_last = False, 0
    if epochs > 1:
        before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        from_last = num_samples - before_last
        separate_last = from_last < int(SEPARATE_LAST_EPOCH_BELOW * per_epoch)
    rs = np.random.RandomState(seed)
    document_index = build_document_index(documents, epochs, rs, separate_last)
    total = (epochs * tokens_per_epoch - 1) // seq_length
    sample_index = build_sample_index(sizes, document_index, seq_length, total)
    shuffle_index = build_shuffle_index(before_last if separate_last else total, total, rs)
    return {"document_index": document_index, "sample_index": sample_index,
            "shuffle_index": shuffle_index}


def blend_sizes(weights: list[float], size: int, surplus: float = 0.0) -> list[int]:
    """Samples each dataset gives a blend of `size`: ceil(ceil(size * w) * (1 + surplus))."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset id int16, sample id within it int64) of each of `size` blended samples.

    Sample i comes from the dataset with the largest error w_k * max(i, 1) - count_k (the
    first such on ties): Megatron's `build_blending_indices`, a sequential greedy rule, run
    here in plain Python (about a second per million samples; the result is cached).
    """
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    datasets = range(len(w))
    chosen, nth = [], []
    for i in range(size):
        t = float(max(i, 1))
        best = max(datasets, key=lambda k: (w[k] * t - counts[k], -k))
        chosen.append(best)
        nth.append(counts[best])
        counts[best] += 1
    return np.array(chosen, dtype=np.int16), np.array(nth, dtype=np.int64)
