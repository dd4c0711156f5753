"""Initial weights: a rank's slice of a full normal tensor, drawn without drawing the rest.

Every weight is the slice of one full tensor, `randn(shape) * std` from a CPU generator seeded
by the run seed and the parameter's global name (ptdp/parallel/layers.py `full_normal`), so
any layout starts from a single process's weights. Drawing the full tensor on every tensor
rank costs t times the rank's share; at GPT-175B with p = t = 8 that was about 220 s per
rank. `normal_slice` returns the same values (bit for bit) and draws only the rows, or the
pieces of rows, the rank keeps. It relies on how torch's CPU generator fills a float tensor
(aten/src/ATen/native/cpu/DistributionTemplates.h, `normal_fill`):

* the generator is an mt19937 stream of 32-bit numbers; `randn` of n >= 16 contiguous floats
  takes n of them (one uniform each) and turns them into normals in blocks of 16 counted from
  the tensor's start (Box-Muller on pairs i, i + 8), and, when 16 does not divide n, draws 16
  more and recomputes the last 16 values from them;
* `random_` on uint8 takes one number per element and is several times faster, so a part of
  the stream the rank does not keep is skipped by filling a scratch byte buffer.

Hence the full tensor's values [a, b) are `randn(b - a)` after skipping a numbers, when a is a
multiple of 16 and b - a >= 16 is a multiple of 16 or ends the tensor. Where a slice does not
meet that (odd shapes, tiny tensors), the full tensor is drawn and sliced, as before. A
self-check at the first use compares both ways on a small tensor and falls back to full draws
for good if they differ (another torch's kernel).

Within `drawing_in_threads(n)` the draws run on n threads (each tensor has its own generator,
and torch releases the GIL while drawing): the parameter is allocated at once and filled in
the background, and the block waits for every fill before it ends.
"""

from __future__ import annotations

import contextlib
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch

BLOCK = 16                 # normals are made in blocks of 16 uniforms
SKIP_CHUNK = 1 << 24       # numbers skipped per call, through a reused byte buffer
SMALL = 1 << 16            # below this many values drawing the full tensor is as cheap

_pool: list = []           # the active ThreadPoolExecutor and its futures, inside the block


def _skip(generator: torch.Generator, count: int, scratch: list) -> None:
    """Advance `generator` by `count` 32-bit numbers."""
    while count > 0:
        n = min(count, SKIP_CHUNK)
        if not scratch or scratch[0].numel() < n:
            scratch[:] = [torch.empty(n, dtype=torch.uint8)]
        scratch[0][:n].random_(generator=generator)
        count -= n


def _segments(shape: tuple, split_dim: int, parts: int, index: int) -> list[tuple[int, int]] | None:
    """The [a, b) ranges of the flattened full tensor that slice `index` of `parts` along
    `split_dim` covers, in order; None when one of them cannot be drawn on its own."""
    if shape[split_dim] % parts:
        return None
    rows, inner = 1, 1
    for size in shape[:split_dim]:
        rows *= size
    for size in shape[split_dim + 1:]:
        inner *= size
    width = shape[split_dim] * inner               # one outer row of the full tensor
    piece = width // parts                         # my part of it
    total = rows * width
    segments: list[tuple[int, int]] = []
    for r in range(rows):
        a, b = r * width + index * piece, r * width + (index + 1) * piece
        if segments and segments[-1][1] == a:      # whole rows: one segment
            segments[-1] = (segments[-1][0], b)
        else:
            segments.append((a, b))
    ok = all(a % BLOCK == 0 and b - a >= BLOCK and ((b - a) % BLOCK == 0 or b == total)
             for a, b in segments)
    return segments if ok else None


def _draw_segments(out: torch.Tensor, generator: torch.Generator, segments: list,
                   std: float) -> None:
    flat, position, written, scratch = out.view(-1), 0, 0, []
    for a, b in segments:
        _skip(generator, a - position, scratch)
        flat[written:written + b - a] = torch.randn(b - a, generator=generator).mul_(std)
        written += b - a
        position = b + (BLOCK if (b - a) % BLOCK else 0)   # the tail's 16 extra numbers


@functools.lru_cache(maxsize=1)
def streams_can_be_skipped() -> bool:
    """True when this torch draws as the module docstring says: checked once, on a piece of
    each row of a [2, 80] tensor and on the last third (with its redrawn tail) of a [3, 24]."""
    def same(shape, split_dim, parts, index) -> bool:
        full = torch.randn(shape, generator=torch.Generator().manual_seed(7))
        part = torch.empty(full.chunk(parts, split_dim)[index].shape)
        segments = _segments(shape, split_dim, parts, index)
        _draw_segments(part, torch.Generator().manual_seed(7), segments, 1.0)
        return torch.equal(part, full.chunk(parts, split_dim)[index])
    return same((2, 80), 1, 5, 3) and same((3, 24), 0, 3, 2)


def normal_slice(shape, std: float, seed: int, split_dim: int | None, parts: int,
                 index: int) -> torch.Tensor:
    """Slice `index` of `parts` along `split_dim` (None: the whole tensor) of
    `randn(shape, generator=manual_seed(seed)) * std`, in fp32 on CPU, bit for bit."""
    shape = tuple(shape)
    if split_dim is None:
        split_dim, parts, index = 0, 1, 0
    local = list(shape)
    local[split_dim] //= parts
    return _draw(shape, local, std, seed, lambda: _segments(shape, split_dim, parts, index),
                 lambda full: full.chunk(parts, dim=split_dim)[index])


def normal_rows(shape, std: float, seed: int, start: int, stop: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [start, stop) of the same full tensor (a vocabulary range of an embedding table),
    written into `out` (contiguous) when given."""
    shape = tuple(shape)
    width = 1
    for size in shape[1:]:
        width *= size

    def segments():
        a, b = start * width, stop * width
        total = shape[0] * width
        ok = a % BLOCK == 0 and b - a >= BLOCK and ((b - a) % BLOCK == 0 or b == total)
        return [(a, b)] if ok else None
    return _draw(shape, [stop - start, *shape[1:]], std, seed, segments,
                 lambda full: full[start:stop], out)


def _draw(shape, local, std, seed, segments, fallback, out=None) -> torch.Tensor:
    out = torch.empty(local) if out is None else out
    job = functools.partial(_fill, out, shape, std, seed, segments, fallback)
    if _pool:
        _pool[1].append(_pool[0].submit(job))
    else:
        job()
    return out


def _fill(out, shape, std, seed, segments, fallback) -> None:
    generator = torch.Generator().manual_seed(seed)
    ranges = segments() if out.numel() >= SMALL and streams_can_be_skipped() else None
    if ranges is None:   # odd shapes, small tensors: the full tensor, sliced
        out.copy_(fallback(torch.randn(shape, generator=generator).mul_(std)))
    else:
        _draw_segments(out, generator, ranges, std)


def default_threads() -> int:
    """The cores this process may use, shared by the ranks of its node, at most 16."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(16, (cores or 1) // max(1, local)))


@contextlib.contextmanager
def drawing_in_threads(threads: int | None = None):
    """Draw the initial weights created inside on `threads` threads; wait for all at the end."""
    threads = default_threads() if threads is None else threads
    if _pool or threads <= 1:      # nested, or nothing to gain: draw as they come
        yield
        return
    executor = ThreadPoolExecutor(threads, thread_name_prefix="ptdp-init")
    _pool[:] = [executor, []]
    try:
        yield
    finally:
        futures = _pool[1]
        _pool.clear()
        executor.shutdown(wait=True)
        for future in futures:
            future.result()        # a failed draw raises here
