"""Blending several datasets by weight into one map-style dataset.

Sample i of the blend comes from the dataset whose share of the first i + 1 samples is
furthest behind its weight, so every prefix of the blend matches the weights to within one
sample per dataset (no sampling noise, nothing random to seed). Each dataset's own samples are
taken in order and wrap around when a heavily weighted small dataset runs out.

`MegatronBlendedDataset` blends as Megatron-LM does (`data.sampling: megatron`): a fixed
number of samples, assigned by the largest-error rule of ptdp/data/megatron_sampling.py; no
part wraps (each was built large enough, ptdp/data/build.py).
"""

from __future__ import annotations

import numpy as np

from ptdp.data.index_cache import cache_key, cached_arrays
from ptdp.data.megatron_sampling import blending_indices, normalize


def blend_index(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset id, sample id within it) for each of `size` blended samples.

    Dataset k's n-th sample is placed at "time" (n + 1/2) / w_k; sorting all those times
    interleaves the datasets so that counts track w_k * i (Sainte-Lague apportionment).
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"blend weights must be non-negative and not all zero, got {weights}")
    w = w / w.sum()
    times, owner, nth = [], [], []
    for k, wk in enumerate(w):
        if wk == 0:
            continue
        n = np.arange(int(np.ceil(wk * size)) + 1)
        times.append((n + 0.5) / wk)
        owner.append(np.full(n.size, k))
        nth.append(n)
    order = np.argsort(np.concatenate(times), kind="stable")[:size]
    return np.concatenate(owner)[order], np.concatenate(nth)[order]


class BlendedDataset:
    """Datasets mixed by normalised weight; length = the sum of the parts' lengths."""

    def __init__(self, datasets: list, weights: list[float], size: int | None = None):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        for ds, w in zip(datasets, weights):
            if w > 0 and len(ds) == 0:
                raise ValueError(f"cannot blend an empty dataset with weight {w}: {ds!r}")
        self.datasets = datasets
        self.weights = [float(w) for w in weights]
        self.size = sum(len(d) for d in datasets) if size is None else size
        self.dataset_index, self.sample_index = blend_index(self.weights, self.size)

    def __len__(self) -> int:
        return self.size

    @property
    def masked_lm(self) -> bool:
        return _masked_lm(self.datasets)

    def __getitem__(self, i: int):
        ds = self.datasets[int(self.dataset_index[i])]
        return ds[int(self.sample_index[i]) % len(ds)]


class MegatronBlendedDataset:
    """`size` samples of `datasets` mixed by `weights` in Megatron's order; sample i is
    `datasets[dataset_index[i]][dataset_sample_index[i]]`. The index is cached next to the
    first dataset's data (it takes about a second per million samples to build)."""

    def __init__(self, datasets: list, weights: list[float], size: int, name: str = "train"):
        self.datasets, self.size = datasets, size
        self.weights = normalize(weights)   # Megatron normalises again here: same floats
        key = cache_key(weights=self.weights, size=size, kind="megatron-blend",
                        parts=[d.indexed.prefix for d in datasets],
                        lengths=[len(d) for d in datasets])
        index = cached_arrays(datasets[0].indexed.prefix, f"{name}-megatron-blend", key,
                              lambda: dict(zip(("dataset_index", "dataset_sample_index"),
                                               blending_indices(self.weights, size))))
        self.dataset_index = index["dataset_index"]
        self.dataset_sample_index = index["dataset_sample_index"]
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for ds, count in zip(datasets, counts):
            if count > len(ds):
                raise ValueError(f"the {name} blend takes {count} samples from "
                                 f"{ds.indexed.prefix}, which has {len(ds)}")

    def __len__(self) -> int:
        return self.size

    @property
    def masked_lm(self) -> bool:
        return _masked_lm(self.datasets)

    def __getitem__(self, i: int):
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def _masked_lm(datasets: list) -> bool:
    """A blend of masked-LM datasets is one (ptdp/data/batching.py lists its loss rows)."""
    return all(getattr(d, "masked_lm", False) for d in datasets)
