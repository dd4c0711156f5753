"""Asynchronous checkpoints (`checkpoint.async_save`): training stands still only while the state
is copied to host memory; a background thread writes the files while training goes on.

A save is split in three (ptdp/checkpoint/save.py):

1. `start_save`, at the iteration boundary, on the training thread: the `.tmp` directory and a
   host copy of this rank's state (pinned and asynchronous from a GPU). Collective.
2. `PendingSave.write` on a background thread: this rank's files, written durably. It runs no
   collective, so it never interleaves with training's communication (NCCL rule 3).
3. `finish_save`, on the training thread at a later iteration boundary, once every rank's
   writer is done (`poll` asks all ranks, one small all-reduce per iteration while a save is
   in flight): rank 0 publishes metadata.json, the rename and `latest`.

At most one save is in flight: starting another (or ending the run) first waits for the one
before and publishes it. The tear-proof guarantees of a synchronous save stand: `latest` moves
only to a complete checkpoint, so a rank killed while the background writes run leaves a
`.tmp` directory (swept by the next save) and the previous checkpoint, which the restarted job
resumes from.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.distributed as dist

from ptdp.checkpoint.save import PendingSave, finish_save, start_save


class BackgroundSaves:
    def __init__(self, device: torch.device):
        self.device = device
        self.pending: PendingSave | None = None
        self.writer: threading.Thread | None = None

    @property
    def in_flight(self) -> bool:
        return self.pending is not None

    def start(self, state, directory, timing: dict | None = None) -> Path | None:
        """Snapshot the state and start writing it; returns the checkpoint the previous save
        published first (at most one in flight), if there was one. Collective."""
        previous = self.wait()
        self.pending = start_save(state, directory, timing)
        self.writer = threading.Thread(target=self.pending.write, name="checkpoint-writer",
                                       daemon=True)
        self.writer.start()
        return previous

    def poll(self) -> Path | None:
        """Publish the save in flight if every rank has written its files; returns its
        directory, or None (nothing in flight, or some rank still writing). Collective: every
        rank calls it at the same iteration boundary."""
        if self.pending is None:
            return None
        done = torch.tensor([0 if self.writer.is_alive() else 1], device=self.device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return self._publish() if done.item() else None

    def wait(self) -> Path | None:
        """Wait for the save in flight and publish it; returns its directory (None if there
        was none). Collective."""
        if self.pending is None:
            return None
        self.writer.join()
        return self._publish()

    def _publish(self) -> Path:
        pending, self.pending, self.writer = self.pending, None, None
        return finish_save(pending)
