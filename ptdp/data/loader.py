"""Micro-batches built ahead of the training thread (`data.num_workers`).

The executor asks for micro-batch (iteration, i) when it runs the first forward of it. With
`data.num_workers` = 0 the batch is built right then, on the training thread
(`MicroBatches.get`): reading samples, stacking them and copying them to the device sit on the
critical path of every micro-batch. With n > 0 a torch `DataLoader` with n worker processes
builds them in the order the training loop asks for them (each schedule's first forwards of
an iteration come in micro-batch order, and iterations follow each other; a no-flush stream
numbers its micro-batches across iterations in the same order), `prefetch_factor` batches
ahead per worker, into pinned host memory on CUDA; the training thread only starts their
non-blocking copy to the device.

A daemonic process may not start worker processes (a rank forked by
ptdp/runtime/local_ranks.py for tests and tools; torchrun's ranks are not daemons): there one
thread builds them ahead instead, the same batches in the same order.

Every batch is a pure function of (iteration, micro-batch) (`MicroBatches.build`), so the
batches are the same whatever the number of workers. A request out of that order is served
anyway: one further ahead skips the batches in between, one behind (asked again, or a
different position) is built on the spot.
"""

from __future__ import annotations

import itertools
import multiprocessing
import queue
import threading

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ptdp.data.batching import MicroBatches, to_device


class _ByPosition(Dataset):
    """A map-style dataset of whole micro-batches, indexed by (iteration, micro-batch)."""

    def __init__(self, batches: MicroBatches):
        self.batches = batches

    def __getitem__(self, key: tuple[int, int]) -> dict:
        return self.batches.build(*key)


class _Positions(Sampler):
    """(iteration, micro-batch) from `first` on, in the order the training loop asks."""

    def __init__(self, first: tuple[int, int], batches: MicroBatches):
        self.first, self.batches = first, batches

    def __iter__(self):
        for position in itertools.count(self.batches.order(*self.first)):
            yield self.batches.key_at(position)


class PrefetchedBatches:
    """`get(iteration, micro_batch)` as `MicroBatches`, from a DataLoader's workers.

    The workers start at the first request, from its position on (a resumed job starts at its
    own iteration). `close()` ends them; a job that just exits ends them too.
    """

    def __init__(self, batches: MicroBatches, num_workers: int, prefetch_factor: int = 2):
        self.batches = batches
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.device = batches.device
        self.pinned = batches.device.type == "cuda"
        self._iterator = None
        self._next: tuple[int, int] | None = None   # what the workers deliver next
        self.served = self.built_here = 0            # batches from the workers / on the spot

    def get(self, iteration: int, micro_batch: int) -> dict:
        key = (iteration, micro_batch)
        if self._iterator is None:
            self._start(key)
        if self._order(key) < self._order(self._next):   # behind the workers: build it here
            self.built_here += 1
            return self.batches.get(iteration, micro_batch)
        while True:
            batch = next(self._iterator)
            delivered, self._next = self._next, self._after(self._next)
            if delivered == key:
                self.served += 1
                return to_device(batch, self.device, pinned=self.pinned)

    def close(self) -> None:
        """End the workers (the next request would start them again)."""
        if isinstance(self._iterator, _Ahead):
            self._iterator.close()
        self._iterator, self._next = None, None

    def _start(self, key: tuple[int, int]) -> None:
        dataset, positions = _ByPosition(self.batches), _Positions(key, self.batches)
        if multiprocessing.current_process().daemon:
            self._iterator = _Ahead(dataset, positions, self.num_workers * self.prefetch_factor,
                                    self.pinned)
        else:
            context = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
            self._iterator = iter(DataLoader(
                dataset, batch_size=None, sampler=positions, num_workers=self.num_workers,
                prefetch_factor=self.prefetch_factor, pin_memory=self.pinned,
                multiprocessing_context=context,
                # its own generator: the workers' base seed must not draw from the default
                # one, whose state dropout (and the checkpoint) depends on
                generator=torch.Generator()))
        self._next = key

    def _order(self, key: tuple[int, int]) -> int:
        return self.batches.order(*key)

    def _after(self, key: tuple[int, int]) -> tuple[int, int]:
        return self.batches.key_at(self._order(key) + 1)


class _Ahead:
    """`dataset[key]` for each of `keys`, built by one thread at most `depth` ahead."""

    def __init__(self, dataset, keys, depth: int, pin: bool):
        self.items: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._fill, args=(dataset, keys, pin),
                                       name="ptdp-data", daemon=True)
        self.thread.start()

    def _fill(self, dataset, keys, pin: bool) -> None:
        for key in keys:
            try:
                item = dataset[key]
                if pin:
                    item = {name: value.pin_memory() for name, value in item.items()}
            except BaseException as err:   # noqa: BLE001 - raised on the training thread
                item = err
            while not self.stopped.is_set():
                try:
                    self.items.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self.stopped.is_set() or isinstance(item, BaseException):
                return

    def __next__(self) -> dict:
        item = self.items.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stopped.set()


def micro_batch_source(batches: MicroBatches, num_workers: int):
    """What the training loop reads micro-batches from: `batches` itself (num_workers = 0) or
    workers building them ahead."""
    if num_workers <= 0:
        return batches
    return PrefetchedBatches(batches, num_workers)

