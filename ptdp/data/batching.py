"""Which samples make up each micro-batch, for any data-parallel layout.

Iteration `it` consumes global samples [it*B, (it+1)*B). Data rank j owns the contiguous
slice [j*B/d, (j+1)*B/d) of it, cut into micro-batches of b. Concatenating the ranks'
micro-batches in order gives exactly the single-process micro-batch sequence, which is what
makes every layout train the same model.
"""

from __future__ import annotations

import numpy as np
import torch


def micro_batch_indices(iteration: int, micro_batch: int, *, global_batch: int,
                        micro_batch_size: int, data_rank: int, data_size: int) -> range:
    per_rank = global_batch // data_size
    start = iteration * global_batch + data_rank * per_rank + micro_batch * micro_batch_size
    return range(start, start + micro_batch_size)


def collate(samples: list[dict], device: torch.device) -> dict:
    """Stack dicts of numpy arrays into dicts of tensors [b, ...] on `device`.

    On GPU the copy goes from pinned memory without blocking: a plain copy from pageable
    memory would make the host wait for the GPU at every micro-batch (a hidden sync).
    """
    def to_device(array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if device.type == "cuda":
            return tensor.pin_memory().to(device, non_blocking=True)
        return tensor.to(device)

    return {key: to_device(np.stack([s[key] for s in samples])) for key in samples[0]}


class MicroBatches:
    """Builds micro-batch `i` of iteration `it` for this data rank from a map-style dataset."""

    def __init__(self, dataset, *, global_batch: int, micro_batch_size: int, data_rank: int,
                 data_size: int, device: torch.device):
        self.dataset, self.device = dataset, device
        self.layout = dict(global_batch=global_batch, micro_batch_size=micro_batch_size,
                           data_rank=data_rank, data_size=data_size)

    def get(self, iteration: int, micro_batch: int) -> dict:
        n = len(self.dataset)
        idx = micro_batch_indices(iteration, micro_batch, **self.layout)
        return collate([self.dataset[i % n] for i in idx], self.device)
