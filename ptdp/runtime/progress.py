"""What the device has finished: progress as the hang detector must read it on a GPU.

On NCCL a `work.wait()` makes the compute stream wait, not the host: the host enqueues a whole
iteration and then blocks once, in the one read of the iteration's statistics. Host marks
alone would then say nothing about where a stuck rank is. So the main thread records a device
event after each action it enqueues (a forward or backward of a micro-batch, a wait for a
received tensor, a reduction), with the action's label, and the hang detector's thread polls
those events in order, off the hot path: the time the device last finished something is its
progress, and the first event not yet complete names the action the device is stuck in (a
transfer or collective when it is a wait or a reduction).

On CPU (gloo) the host is the device: nothing is recorded and the host's marks are the
progress. Events come from a factory (`torch.cuda.Event` on CUDA; tests pass fakes), and
completed ones are reused, so recording costs one `cudaEventRecord` per action.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, NamedTuple


class Label(NamedTuple):
    """What an action was: its name (e.g. `F3@s1`, `wait act mb3 s0->s1`), its category
    (forward, backward, wait, reduce, optimizer) and, when it has them, micro-batch and stage."""

    name: str
    category: str
    mb: int | None = None
    stage: int | None = None

    def describe(self) -> str:
        where = [f"stage {self.stage}" if self.stage is not None else "",
                 f"micro-batch {self.mb}" if self.mb is not None else ""]
        where = ", ".join(filter(None, where))
        return f"{self.name} ({where})" if where else self.name


class DeviceProgress:
    """Events recorded after each action (main thread), polled in order (watchdog thread).

    `make_event()` returns an object with `record()` and `query()` (True once the device has
    passed it); None: the host is the device, and nothing is recorded.
    """

    def __init__(self, make_event: Callable | None = None, clock: Callable[[], float] = time.monotonic):
        self.make_event, self.clock = make_event, clock
        self.enabled = make_event is not None
        self.pending: deque = deque()   # (event, label), in the order recorded
        self.free: deque = deque()      # completed events, for reuse
        self.moved_at = clock()         # when the device was last seen finishing an action
        self.last_done: Label | None = None

    def record(self, label: Label) -> None:
        """Main thread, right after enqueuing the action `label` names."""
        if not self.enabled:
            return
        try:
            event = self.free.popleft()
        except IndexError:
            event = self.make_event()
        event.record()
        self.pending.append((event, label))

    def bind_thread(self) -> None:
        """Watchdog thread, before its first poll: make the rank's GPU this thread's current
        device (a thread starts on GPU 0, and its first CUDA call there would make a context
        on GPU 0 for every rank of the node)."""
        bind = getattr(self.make_event, "bind_thread", None)
        if self.enabled and bind is not None:
            bind()

    def poll(self) -> None:
        """Watchdog thread: retire the events the device has passed (they complete in order:
        all are recorded on the compute stream)."""
        while self.pending:
            event, label = self.pending[0]
            if not event.query():
                return
            self.pending.popleft()
            self.free.append(event)
            self.last_done, self.moved_at = label, self.clock()

    def stuck_in(self) -> Label | None:
        """The first action the device has not finished (None: it has finished everything)."""
        try:
            return self.pending[0][1]
        except IndexError:
            return None


class CudaEvents:
    """Makes CUDA events (no timing: cheapest to record) for the rank's `device`, and binds a
    polling thread to that device."""

    def __init__(self, device):
        self.device = device

    def __call__(self):
        import torch
        return torch.cuda.Event()

    def bind_thread(self) -> None:
        import torch
        torch.cuda.set_device(self.device)


def device_events(device) -> Callable | None:
    """The event factory for `device`: CUDA events, or None on CPU."""
    if getattr(device, "type", device) != "cuda":
        return None
    return CudaEvents(device)
