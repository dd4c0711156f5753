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
    """Offsets of tensors of the given shapes inside one flat buffer (gaps are padding)."""

    def __init__(self, shapes: list[torch.Size], align: int = ALIGN):
        self.shapes = [torch.Size(s) for s in shapes]
        self.offsets = [0] * len(shapes)
        offset = 0
        for i in reversed(range(len(shapes))):  # backward's order: last registered first
            self.offsets[i] = offset
            offset = _round_up(offset + self.shapes[i].numel(), align)
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


class FlatGrads:
    """The gradient buffer and its layout: what the data-parallel reduction slices."""

    def __init__(self, layout: FlatLayout, buffer: torch.Tensor, index_of: dict[int, int]):
        self.layout, self.buffer = layout, buffer
        self.index_of = index_of        # id(model parameter) -> its index in the layout

    def slice_for(self, params: list) -> torch.Tensor:
        start, end = self.layout.span([self.index_of[id(p)] for p in params])
        return self.buffer[start:end]
