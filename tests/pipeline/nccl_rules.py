"""A test-only pipeline transport that imposes NCCL's point-to-point rules on gloo.

gloo matches messages by tag and lets a rank's sends and receives complete in any order, so a
pipeline exchange that would hang or mix up tensors on NCCL can pass on gloo. This transport
takes those freedoms away (tests/pipeline/nccl_rules.py imposes them on gloo):

1. **No tags.** Every boundary tensor goes out with tag 0, so it matches the receiver's next
   receive from that peer, in issue order. Each payload is preceded by a header naming the
   message; the receiver checks it against the message it expected and fails loudly (naming
   both) instead of silently using the wrong tensor.
2. **In-order completion, no buffering.** A batch completes only when every receive has
   arrived *and* every send has been received by its peer (the receiver acknowledges on a
   separate tag, which is this transport's own bookkeeping, not a data message), and the next
   batch is not posted before that. This is the rendezvous model under which
   `ptdp.pipeline.comm_plan.check_plans` proves a plan deadlock-free; the host blocks where
   NCCL would block the communication stream, which only removes freedom.

Use: `trainer.pipeline.p2p.transport = InOrderTransport(trainer.state.grid.group("pipeline"))`;
for the context-parallel ring, `trainer.state.ctx.cp.transport =
InOrderTransport(trainer.state.grid.group("context"))` (the same rules, the ring's messages).
"""

from __future__ import annotations

import functools
import queue
import threading
import time

import torch
import torch.distributed as dist

from ptdp.pipeline.comm_plan import ACTIVATION

DATA_TAG, ACK_TAG = 0, 1


class MessageMismatch(RuntimeError):
    pass


class _Done:
    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


def _header(transfer, numel: int) -> torch.Tensor:
    """(kind, mb, src, dst, numel) of a pipeline message (kind: 0 activation, 1 gradient, plus
    2 x the tensor's index on its boundary); a message that names its own four fields (the
    context-parallel ring's, ptdp/parallel/context.py) gives them itself."""
    m = transfer.message
    fields = (m.header() if hasattr(m, "header")
              else [(0 if m.kind == ACTIVATION else 1) + 2 * m.index, m.mb, m.src, m.dst])
    return torch.tensor([*fields, numel])


class InOrderTransport:
    def __init__(self, group=None, timeout_s: float = 60.0):
        self.group, self.timeout_s = group, timeout_s
        self.batches = 0      # batches posted (tests check that the transport was used)

    def post(self, ops) -> list:
        """Run the whole batch to completion; return already-completed handles.

        Each operation completes on its own, as in the rendezvous model: a receive as soon as
        its header and payload are in (it is acknowledged at once), a send when its
        acknowledgement arrives. The call returns when all of them have. (gloo's works only
        progress inside wait(), so each operation waits in a thread of its own.)
        """
        self.batches += 1
        waits, errors = [], []
        for transfer, tensor, peer in ops:
            if transfer.send:
                works = [dist.isend(_header(transfer, tensor.numel()), peer, self.group, DATA_TAG),
                         dist.isend(tensor, peer, self.group, DATA_TAG),
                         dist.irecv(torch.zeros(1, dtype=torch.int64), peer, self.group, ACK_TAG)]
                job = functools.partial(_wait_all, works)
            else:
                header = torch.zeros(5, dtype=torch.int64)
                works = [dist.irecv(header, peer, self.group, DATA_TAG),
                         dist.irecv(tensor, peer, self.group, DATA_TAG)]
                job = functools.partial(self._receive, transfer, tensor, header, peer, works)
            waits.append((transfer, _WAITERS.start(job, errors)))
        deadline = time.monotonic() + self.timeout_s
        for _, done in waits:
            done.wait(max(0.0, deadline - time.monotonic()))
        if errors:
            raise errors[0]
        stuck = [str(t) for t, done in waits if not done.is_set()]
        if stuck:
            raise TimeoutError(f"in-order transport timed out after {self.timeout_s:g}s waiting "
                               f"for: {', '.join(stuck)}")
        return [_Done()] * len(ops)

    def _receive(self, transfer, tensor, header, peer, works) -> None:
        _wait_all(works)
        expected = _header(transfer, tensor.numel())
        if not torch.equal(header, expected):
            raise MessageMismatch(f"expected {transfer} ({expected.tolist()}) but rank {peer} "
                                  f"sent {header.tolist()} (kind, mb, src, dst, numel)")
        dist.isend(torch.ones(1, dtype=torch.int64), peer, self.group, ACK_TAG).wait()


def _wait_all(works) -> None:
    for work in works:
        work.wait()


def _capture(job, errors: list) -> None:
    try:
        job()
    except Exception as err:  # re-raised by post() on the calling thread
        errors.append(err)


class _Waiters:
    """Daemon threads that each wait out one operation at a time and are kept for the next:
    starting a thread per operation cost ~0.3 ms, hundreds of times per training run. One
    that never finishes (the timeout above) is simply not reused."""

    def __init__(self):
        self.idle = queue.SimpleQueue()   # the job queues of threads waiting for work

    def start(self, job, errors: list) -> threading.Event:
        """Run `job` on an idle thread (or a new one); the event is set when it has ended."""
        done = threading.Event()
        try:
            jobs = self.idle.get_nowait()
        except queue.Empty:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), daemon=True).start()
        jobs.put((job, errors, done))
        return done

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        while True:
            job, errors, done = jobs.get()
            _capture(job, errors)
            self.idle.put(jobs)   # idle again before the poster can see this one done
            done.set()


_WAITERS = _Waiters()
