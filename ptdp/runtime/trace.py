"""Per-rank timelines of real iterations: record spans, write one Chrome-trace JSON file.

A `Spans` object records the start and end of named spans on one rank: every forward and
backward (per micro-batch and chunk), every wait for a received boundary tensor, the
data-parallel and embedding reductions and the optimizer step. On GPU the marks are CUDA
events (the kernels' own times, no synchronisation until the iteration is collected); on CPU
they are host clocks. `TraceRecorder` collects a few iterations and at the end gathers every
rank's events to rank 0, which writes one row ("process") per rank, readable by
chrome://tracing, Perfetto and `ptdp timeline`.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

TRACED = range(1, 4)   # iterations traced, counted from 0 at the job's first (warm-up) one
CATEGORIES = ("forward", "backward", "wait", "reduce", "optimizer")


class _NoSpans:
    """Records nothing (the default when no trace is wanted)."""

    def __call__(self, name: str, category: str, **args):
        return contextlib.nullcontext()


NO_SPANS = _NoSpans()


class Spans:
    """Named, categorised spans of one rank, timed by CUDA events on GPU, host clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.open: list = []      # (name, category, start mark, end mark, args)
        self._reference = None    # (CUDA event, host time) taken together, to place events

    @contextlib.contextmanager
    def __call__(self, name: str, category: str, **args):
        start = self._mark()
        try:
            yield
        finally:
            self.open.append((name, category, start, self._mark(), args))

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        if self._reference is None:
            torch.cuda.synchronize()
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            event.synchronize()
            self._reference = (event, time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, mark) -> float:
        if not self.cuda:
            return mark
        reference, host = self._reference
        return host + reference.elapsed_time(mark) / 1e3

    def collect(self) -> list[tuple[str, str, float, float, dict]]:
        """(name, category, start, end, args) in host-clock seconds; forgets them."""
        if self.cuda and self.open:
            torch.cuda.synchronize()
        spans = [(name, cat, self._seconds(a), self._seconds(b), args)
                 for name, cat, a, b, args in self.open]
        self.open = []
        return spans


class TraceRecorder:
    def __init__(self, path: str | None, rank: int, coords, device: torch.device,
                 first_iteration: int = 1, layout: dict | None = None):
        """`first_iteration` (1-based) is the job's first: a resumed job traces its own
        second to fourth iterations, like a fresh one. `layout` (p, t, d, v, schedule, m)
        goes into the file's `otherData` for `ptdp timeline`."""
        self.path, self.rank, self.coords = path, rank, coords
        self.device, self.first, self.layout = device, first_iteration, layout or {}
        self.events: list[dict] = []
        # perf_counter is per-host monotonic; shift it to wall-clock so ranks line up.
        self.offset = time.time() - time.perf_counter()

    def spans_for(self, iteration: int):
        """A fresh `Spans` when `iteration` (1-based) is traced, else `NO_SPANS`."""
        if self.path is None or iteration - self.first not in TRACED:
            return NO_SPANS
        return Spans(self.device)

    def add(self, iteration: int, spans) -> None:
        if spans is NO_SPANS:
            return
        for name, category, start, end, args in spans.collect():
            self.events.append({"name": name, "cat": category, "ph": "X", "pid": self.rank,
                                "tid": 0, "ts": (start + self.offset) * 1e6,
                                "dur": (end - start) * 1e6,
                                "args": {"iteration": iteration, **args}})

    def write(self) -> None:
        """Collective: every rank must call it when a trace file is configured."""
        if self.path is None:
            return
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.rank, str(self.coords), self.events))
        if self.rank != 0:
            return
        events = []
        for rank, coords, rank_events in gathered:
            events.append({"name": "process_name", "ph": "M", "pid": rank,
                           "args": {"name": f"rank {rank} {coords}"}})
            events.extend(rank_events)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        Path(self.path).write_text(json.dumps({"traceEvents": events, "otherData": self.layout}))
