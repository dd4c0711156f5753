"""Which samples make up each micro-batch, for any data-parallel layout.

Iteration `it` consumes global samples [it*B, (it+1)*B) (with a batch ramp-up, the samples
after those of the iterations before it, ptdp/config/batches.py). Data rank j owns the contiguous
slice [j*B/d, (j+1)*B/d) of it, cut into micro-batches of b. Concatenating the ranks'
micro-batches in order gives exactly the single-process micro-batch sequence, which is what
makes every layout train the same model.

With context parallelism (c > 1) the c ranks of a context group read the same samples and each
keeps only its two chunks of the sequence (ptdp/parallel/context.py) of every tensor laid out
along it (`SEQUENCE_KEYS`); `loss_count` carries the whole sequence's loss-mask count, so each
rank's loss is its share of the single-process mean. `document_ids` stays whole: the ring
attention masks each (query chunk, key chunk) block by the documents of both chunks
(ptdp/parallel/ring_attention.py).

With multi-token prediction (model.mtp_layers = D) each micro-batch also carries every depth's
inputs and targets, `mtp_tokens`, `mtp_labels` and `mtp_loss_mask` [b, s, D], and the counts
over the whole sequence `mtp_loss_count` [D] (`future_targets`): shifted on the host, before the
context split, so that no context rank needs a token another holds.
"""

from __future__ import annotations

import numpy as np
import torch

from ptdp.config.batches import BatchSchedule
from ptdp.parallel.context import context_shard

# The [b, s] tensors of a micro-batch, split along the sequence with context parallelism.
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "types", "padding_mask", "position_ids",
                 "mtp_tokens", "mtp_labels", "mtp_loss_mask")


def micro_batch_indices(iteration: int, micro_batch: int, *, global_batch: int,
                        micro_batch_size: int, data_rank: int, data_size: int,
                        consumed: int | None = None) -> range:
    """The global sample numbers of one micro-batch. `global_batch` is this iteration's batch,
    `consumed` the samples before it (default: iteration * global_batch, a constant batch)."""
    per_rank = global_batch // data_size
    first = iteration * global_batch if consumed is None else consumed
    start = first + data_rank * per_rank + micro_batch * micro_batch_size
    return range(start, start + micro_batch_size)


def collate(samples: list[dict], device: torch.device | None = None) -> dict:
    """Stack dicts of numpy arrays into dicts of tensors [b, ...], on the host, or on `device`
    (`to_device`)."""
    batch = {key: torch.from_numpy(np.stack([s[key] for s in samples])) for key in samples[0]}
    return batch if device is None else to_device(batch, device)


def to_device(batch: dict, device: torch.device, pinned: bool = False) -> dict:
    """A host micro-batch on `device`. On GPU the copy goes from pinned memory without
    blocking (a data-loader worker's batches are pinned already): a plain copy from pageable
    memory would make the host wait for the GPU at every micro-batch (a hidden sync)."""
    if device.type != "cuda":
        return {key: value.to(device) for key, value in batch.items()}
    return {key: (value if pinned else value.pin_memory()).to(device, non_blocking=True)
            for key, value in batch.items()}


class MicroBatches:
    """Builds micro-batch `i` of iteration `it` for this data rank from a map-style dataset:
    `build` on the host (what a data-loader worker runs, ptdp/data/loader.py), `get` on the
    device. `schedule` gives each iteration's global batch (a ramp-up,
    ptdp/config/batches.py); by default every iteration has `global_batch`."""

    def __init__(self, dataset, *, global_batch: int, micro_batch_size: int, data_rank: int,
                 data_size: int, device: torch.device, context_rank: int = 0,
                 context_size: int = 1, schedule: BatchSchedule | None = None,
                 prediction_depths: int = 0):
        self.dataset, self.device = dataset, device
        self.prediction_depths = prediction_depths   # model.mtp_layers
        self.schedule = schedule or BatchSchedule(global_batch)
        self.micro_batch_size = micro_batch_size
        self.data_rank, self.data_size = data_rank, data_size
        self.context_rank, self.context_size = context_rank, context_size

    def order(self, iteration: int, micro_batch: int) -> int:
        """Position of (iteration, micro-batch) among this data rank's micro-batches."""
        return self.schedule.consumed(iteration) // (self.micro_batch_size * self.data_size) \
            + micro_batch

    def key_at(self, order: int) -> tuple[int, int]:
        """(iteration, micro-batch) at position `order` (the inverse of `order`)."""
        sample = order * self.micro_batch_size * self.data_size
        iteration = self.schedule.iteration_of(sample)
        return iteration, order - self.order(iteration, 0)

    def build(self, iteration: int, micro_batch: int) -> dict:
        """The micro-batch as host tensors (this context rank's part of it)."""
        n = len(self.dataset)
        idx = micro_batch_indices(iteration, micro_batch,
                                  global_batch=self.schedule.batch_size(iteration),
                                  micro_batch_size=self.micro_batch_size, data_rank=self.data_rank,
                                  data_size=self.data_size,
                                  consumed=self.schedule.consumed(iteration))
        batch = collate([self.dataset[i % n] for i in idx])
        if self.prediction_depths:
            batch.update(future_targets(batch, self.prediction_depths))
        batch = context_split(batch, self.context_rank, self.context_size)
        if getattr(self.dataset, "masked_lm", False):
            batch["loss_rows"] = loss_rows(batch["loss_mask"])
        return batch

    def get(self, iteration: int, micro_batch: int) -> dict:
        return to_device(self.build(iteration, micro_batch), self.device)


LOSS_ROW_MULTIPLE = 64


def loss_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """The rows of the [s * b] token layout (sequence-major, as the model's activations) whose
    loss counts: a masked LM computes its head on those alone (models/bert.py). Listed on the
    host, so that the device never has to say how many there are (a sync per micro-batch).

    Their count is rounded up to a multiple of LOSS_ROW_MULTIPLE with a position whose loss
    does not count (its mask, the head's weight, is 0): the number of masked tokens changes
    at every micro-batch, and each new shape of the head's GEMMs costs cuBLAS a search on the
    host (3-4 ms each, four a step, in BERT-large's profile on one H200); rounded, a few
    shapes recur."""
    flat = loss_mask.t().reshape(-1)
    rows = flat.nonzero().squeeze(1)
    count = min(-(-len(rows) // LOSS_ROW_MULTIPLE) * LOSS_ROW_MULTIPLE, flat.numel())
    if count > len(rows):   # then some position's loss does not count
        filler = (flat == 0).nonzero()[0]
        rows = torch.cat([rows, filler.expand(count - len(rows))])
    return rows


def shift_left(x: torch.Tensor, k: int) -> torch.Tensor:
    """[b, s] -> the same with position i holding x[:, i + k], the last k positions 0."""
    return torch.cat([x[:, k:], x.new_zeros(x.shape[0], k)], dim=1)


def future_targets(batch: dict, depths: int) -> dict:
    """Multi-token prediction's inputs and targets (models/mtp.py): depth k (1 .. `depths`)
    embeds at position i token i + k, tokens[i + k], and predicts the token after it,
    labels[i + k], where that token's loss mask counts. Past the sequence's end both are 0 and
    the mask 0, as Megatron's roll leaves them. Stacked along a last dimension: `mtp_tokens`,
    `mtp_labels`, `mtp_loss_mask` [b, s, depths], and `mtp_loss_count` [depths], each depth's
    count over the whole sequence."""
    ahead = range(1, depths + 1)
    stacked = lambda x: torch.stack([shift_left(x, k) for k in ahead], dim=-1)  # noqa: E731
    masks = stacked(batch["loss_mask"])
    return {"mtp_tokens": stacked(batch["tokens"]), "mtp_labels": stacked(batch["labels"]),
            "mtp_loss_mask": masks, "mtp_loss_count": masks.sum(dim=(0, 1))}


def context_split(batch: dict, rank: int, size: int) -> dict:
    """Context rank `rank`'s part of a micro-batch: its two chunks of every sequence tensor,
    and the whole sequence's loss-mask count as `loss_count` (identity for size 1)."""
    if size == 1:
        return batch
    out = {key: context_shard(value, 1, rank, size) if key in SEQUENCE_KEYS else value
           for key, value in batch.items()}
    if "loss_mask" in batch:
        out["loss_count"] = batch["loss_mask"].sum()
    return out
