"""Many tensors as views into one flat buffer.

A GPT has hundreds of parameter tensors. Outside the micro-batches every iteration zeroes
their gradients, unscales and clips them, all-reduces them over the data group and copies the
fp32 master weights into the bf16 model: hundreds of tiny kernels and Python calls per step
when each tensor has its own storage. With the model weights, the master weights and the
gradients each laid out in one buffer, zeroing and the master-to-model copy are one kernel on
the whole buffer and the data-parallel reduction one collective per bucket, in place
(ptdp/optim/grads.py); the rest uses torch._foreach_* over the views.

Tensors are placed in reverse registration order, the order in which backward produces their
gradients, so a bucket of consecutive gradients is one contiguous slice of the buffer.
"""

from __future__ import annotations

import torch

# Every view starts at a multiple of 64 elements (128 bytes in bf16, 256 in fp32): vectorised
# and tensor-core kernels (and inductor's generated code) expect aligned tensor starts.
ALIGN = 64


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class FlatLayout:
    """Offsets of tensors of the given shapes inside one flat buffer (gaps are padding).

    `buckets` (lists of tensor indices, each in backward order) places the tensors bucket by
    bucket and pads every bucket's end to a multiple of `ALIGN * bucket_shards`: the
    distributed optimizer (ptdp/optim/distributed.py) cuts each bucket into `bucket_shards`
    equal, aligned, contiguous shards. Without it, one bucket of all tensors, unpadded.
    """

    def __init__(self, shapes: list[torch.Size], align: int = ALIGN,
                 buckets: list[list[int]] | None = None, bucket_shards: int = 1):
        self.shapes = [torch.Size(s) for s in shapes]
        self.offsets = [0] * len(shapes)
        if buckets is None:  # backward's order: last registered first
            buckets, bucket_shards = [list(reversed(range(len(shapes))))], 1
        self.bucket_spans: list[tuple[int, int]] = []
        offset = 0
        for bucket in buckets:
            start = offset
            for i in bucket:
                self.offsets[i] = offset
                offset = _round_up(offset + self.shapes[i].numel(), align)
            offset = _round_up(offset, align * bucket_shards)
            self.bucket_spans.append((start, offset))
        self.numel = offset

    def allocate(self, dtype: torch.dtype, device) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=dtype, device=device)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        start = self.offsets[i]
        return flat[start: start + self.shapes[i].numel()].view(self.shapes[i])

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [self.view(flat, i) for i in range(len(self.shapes))]

    def span(self, indices: list[int]) -> tuple[int, int]:
        """[start, end) of the smallest slice holding the tensors `indices`."""
        return (min(self.offsets[i] for i in indices),
                max(self.offsets[i] + self.shapes[i].numel() for i in indices))


def bucket_indices(sizes_bytes: list[int], limit_bytes: float,
                   alone: list[bool] | None = None) -> list[list[int]]:
    """Tensor indices grouped into buckets of about `limit_bytes`, in backward order (last
    registered first), the order in which their gradients become ready. A tensor marked
    `alone` gets a bucket of its own."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(sizes_bytes))):
        if alone and alone[i]:
            if current:
                buckets.append(current)
            buckets.append([i])
            current, size = [], 0
            continue
        current.append(i)
        size += sizes_bytes[i]
        if size >= limit_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class FlatGrads:
    """The gradient buffer and its layout: what the data-parallel reduction slices."""

    def __init__(self, layout: FlatLayout, buffer: torch.Tensor, index_of: dict[int, int]):
        self.layout, self.buffer = layout, buffer
        self.index_of = index_of        # id(model parameter) -> its index in the layout

    def slice_for(self, params: list) -> torch.Tensor:
        start, end = self.layout.span([self.index_of[id(p)] for p in params])
        return self.buffer[start:end]
