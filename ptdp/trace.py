"""Per-rank timelines of real iterations as one Chrome-trace JSON file.

Each rank records (action, start, end) from the executor for a few iterations; at the end the
events are gathered to rank 0 and written with one row ("process") per rank, so the pipeline
schedule, its bubble and stragglers can be inspected in chrome://tracing or Perfetto.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch.distributed as dist

TRACED_ITERATIONS = range(2, 5)   # 1-based; the first iteration is warm-up


class TraceRecorder:
    def __init__(self, path: str | None, rank: int, coords):
        self.path, self.rank, self.coords = path, rank, coords
        self.events: list[dict] = []
        # perf_counter is per-host monotonic; shift it to wall-clock so ranks line up.
        self.offset = time.time() - time.perf_counter()

    def wants(self, iteration: int) -> bool:
        return self.path is not None and iteration in TRACED_ITERATIONS

    def add(self, iteration: int, trace: list[tuple[str, float, float]]) -> None:
        for name, start, end in trace:
            self.events.append({"name": name, "ph": "X", "pid": self.rank, "tid": 0,
                                "ts": (start + self.offset) * 1e6, "dur": (end - start) * 1e6,
                                "args": {"iteration": iteration}})

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
        Path(self.path).write_text(json.dumps({"traceEvents": events}))
