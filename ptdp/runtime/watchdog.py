"""No anonymous hang: every rank publishes what it is doing, and a stuck job names who stopped.

Each rank runs a daemon thread that, every `interval_s`, writes a heartbeat to the job's
rendezvous store (a client of its own, with short timeouts): the time, the rank's process
and host, and what its main thread is doing (iteration and schedule action, or a phase such
as "checkpoint save"). The main thread only updates a few attributes (`track`, `doing`): no
communication in the step loop.

When this rank's main thread has not moved for `stall_s` (it waits in a receive or a
collective on somebody), the thread reads every rank's heartbeat. Ranks whose heartbeat is
older than three intervals have stopped (killed, SIGSTOPped, or a process frozen whole);
otherwise every rank is alive and the ones not waiting are named with what they are in. The
lowest-numbered rank that is still alive prints the one line, and every live rank ends with
exit code 4, before the backend's own timeout (`train.timeout_s`) would end it with one
traceback per rank. The thread only watches from the job's second iteration on: the first
one may legitimately be slow (compilation, communicator set-up).

A rank that dies at once (its node lost, its process killed) is noticed sooner: its peers'
sockets close, and the backend raises in whichever ranks talk to it. Those ranks call
`lost_peer`, which waits until the dead ranks' heartbeats are stale (at most four intervals),
and one of them, the first to claim it in the store, prints one line naming the ranks that
stopped, their host and what they last did; every rank that saw the error exits with code 4
(the other ranks of its node are ended by torchrun).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

from ptdp.runtime.exit_status import HUNG, record_exit

EXIT_CODE = HUNG
WAITING = ("wait", "reduce")  # span categories in which a rank waits on other ranks


class Watchdog:
    def __init__(self, rank: int, world_size: int, describe_rank, timeout_s: float, *,
                 first_iteration: int = 1, store=None, on_hang=None):
        """`describe_rank(r)` gives rank r's coordinates; `store` defaults to a new client of
        the job's store (MASTER_ADDR/MASTER_PORT); `on_hang(line)` defaults to printing the
        line (None on ranks that leave the reporting to another) and exiting. Iterations
        are watched from the one after `first_iteration` (the job's first, 1-based) on.

        On a single rank there is nobody to wait for: the watchdog stays inert."""
        self.rank, self.world_size, self.describe_rank = rank, world_size, describe_rank
        self.interval_s = min(5.0, max(0.5, timeout_s / 30))
        self.stall_s = 0.8 * timeout_s       # before the backend's timeout, so we speak first
        # A non-reporter's wait for the report: the reporter checks once an interval, and
        # may have blocked a little later.
        self.reporter_grace_s = max(0.1 * timeout_s, 2 * self.interval_s)
        self.watch_from = first_iteration + 1
        self.enabled = world_size > 1
        if self.enabled and store is None:
            store = _store_client(self.interval_s)
        self.store = store
        self.on_hang = on_hang or _print_and_exit
        self.prefix = f"ptdp/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.iteration, self.what, self.waiting = 0, "start-up", False
        self.moved_at = time.time()
        self.watching = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ptdp-watchdog", daemon=True)

    # Main thread ----------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        if self.enabled:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s)

    def doing(self, what: str, iteration: int | None = None, watch: bool = True) -> None:
        """Record the phase the main thread enters; `watch=False` (e.g. a checkpoint save,
        whose length depends on the file system) suspends the stall check until the next."""
        if iteration is not None:
            self.iteration = iteration
        self.watching = watch and self.iteration >= self.watch_from
        self.what, self.waiting, self.moved_at = what, False, time.time()

    def track(self, spans):
        """Wrap a `spans` recorder (ptdp.trace) so every executor action also counts as
        progress; the wrapped recorder still records."""
        return _Tracked(self, spans)

    # Heartbeat thread -----------------------------------------------------------------------
    def _run(self) -> None:
        self._publish(time.time())   # at once: a rank may be lost before the first interval
        while not self._stop.wait(self.interval_s):
            now = time.time()
            self._publish(now)
            if self.watching and now - self.moved_at > self.stall_s:
                beats = self.heartbeats()
                if self.is_reporter(beats, now):
                    self.on_hang(self.diagnose(beats, now))
                    return
                # The reporter may have blocked a little later than this rank and not yet
                # seen the stall: ending now would have torchrun stop it before it speaks.
                self._stop.wait(self.reporter_grace_s)
                self.on_hang(None)
                return

    def _publish(self, now: float) -> None:
        beat = {"t": now, "pid": os.getpid(), "host": socket.gethostname(),
                "iteration": self.iteration, "what": self.what, "waiting": self.waiting,
                "since": self.moved_at}
        try:
            self.store.set(self.prefix + str(self.rank), json.dumps(beat))
        except Exception:  # the store may be gone while the job ends; never raise here
            pass

    def heartbeats(self) -> dict[int, dict | None]:
        keys = [self.prefix + str(r) for r in range(self.world_size)]
        try:
            values = self.store.multi_get(keys)
        except Exception:
            return {r: None for r in range(self.world_size)}
        return {r: json.loads(v) if v else None for r, v in enumerate(values)}

    def lost_peer(self, error: BaseException) -> None:
        """The backend raised `error` in this rank's main thread: name who stopped, and end
        through `on_hang` (by default: exit with code 4). Called on every rank whose
        communication failed; does nothing when the watchdog is inert (a single rank), so
        the caller re-raises."""
        if not self.enabled:
            return
        # No stall check from here on, but the heartbeat goes on: the other ranks must not
        # take this one for dead while they diagnose too.
        self.watching, self.what, self.waiting = False, "lost-peer diagnosis", True
        now = time.time()
        deadline = now + 4 * self.interval_s
        beats = self.heartbeats()
        while not self._stopped_others(beats, now) and now < deadline:
            time.sleep(self.interval_s / 4)
            now = time.time()
            beats = self.heartbeats()
        if self._stopped_others(beats, now):   # ranks lost together went quiet within an interval
            time.sleep(self.interval_s)
            now, beats = time.time(), self.heartbeats()
        stopped = self._stopped_others(beats, now)
        cause = _first_line(error)
        if all(b is None for b in beats.values()):   # the store went with the node hosting it
            line = (f"lost the job's store at {os.environ.get('MASTER_ADDR')}:"
                    f"{os.environ.get('MASTER_PORT')} and rank {self.rank} "
                    f"{self.describe_rank(self.rank)} saw: {cause}; the node of MASTER_ADDR is "
                    f"probably down. Ending the job.")
        elif stopped:
            head = "; ".join(self._where(r, beats[r], now, stopped=True) for r in stopped[:8])
            more = f" (+{len(stopped) - 8} more)" if len(stopped) > 8 else ""
            line = (f"lost rank(s): {head}{more}; rank {self.rank} {self.describe_rank(self.rank)} "
                    f"saw: {cause}. Ending the job.")
        else:
            line = (f"communication failed on rank {self.rank} {self.describe_rank(self.rank)} "
                    f"while every rank's heartbeat is fresh: {cause}. Ending the job.")
        if self._claim_report():
            self.on_hang(line)
        else:
            time.sleep(self.interval_s)    # let the reporter print before torchrun ends us all
            self.on_hang(None)

    def _stopped_others(self, beats: dict, now: float) -> list[int]:
        return [r for r in self._stopped(beats, now) if r != self.rank]

    def _claim_report(self) -> bool:
        """The first rank to ask reports; without a store (it lived on the lost node)
        every rank does."""
        try:
            return self.store.add(self.prefix + "lost-reporter", 1) == 1
        except Exception:
            return True

    def _stopped(self, beats: dict, now: float) -> list[int]:
        """Ranks with no heartbeat for three intervals (or none at all)."""
        return [r for r, b in beats.items() if b is None or now - b["t"] > 3 * self.interval_s]

    def diagnose(self, beats: dict, now: float) -> str:
        """One line: which ranks stopped making progress, and where they were."""
        stopped = self._stopped(beats, now)
        stuck_for = now - self.moved_at
        if stopped:
            head = "; ".join(self._where(r, beats[r], now, stopped=True) for r in stopped[:8])
            more = f" (+{len(stopped) - 8} more)" if len(stopped) > 8 else ""
            return (f"rank(s) stopped making progress: {head}{more}; the other ranks waited "
                    f"{stuck_for:.0f}s for them. Ending the job.")
        busy = [r for r, b in beats.items() if not b["waiting"]]
        suspects = busy or list(beats)
        head = "; ".join(self._where(r, beats[r], now) for r in suspects[:8])
        return (f"no progress for {stuck_for:.0f}s but every rank is alive; not waiting for "
                f"another rank: {head}. Ending the job.")

    def _where(self, rank: int, beat: dict | None, now: float, stopped: bool = False) -> str:
        who = f"rank {rank} {self.describe_rank(rank)}"
        if beat is None:
            return f"{who} (never reported)"
        seen = f"no heartbeat for {now - beat['t']:.0f}s, " if stopped else ""
        return (f"{who} (pid {beat['pid']} on {beat['host']}; {seen}last in iteration "
                f"{beat['iteration']} at {beat['what']}, for {now - beat['since']:.0f}s)")

    def is_reporter(self, beats: dict, now: float) -> bool:
        """The lowest-numbered live rank prints; the others end quietly."""
        stopped = set(self._stopped(beats, now))
        alive = [r for r in beats if r not in stopped] + [self.rank]
        return self.rank == min(alive)


class _Tracked:
    """A spans recorder that also moves the watchdog's progress marks."""

    def __init__(self, watchdog: Watchdog, spans):
        self.watchdog, self.spans = watchdog, spans

    def __call__(self, name: str, category: str, **args):
        return _Span(self.watchdog, self.spans(name, category, **args), name, category)


class _Span:
    def __init__(self, watchdog: Watchdog, inner, name: str, category: str):
        self.watchdog, self.inner, self.name, self.category = watchdog, inner, name, category

    def __enter__(self):
        w = self.watchdog
        w.what, w.waiting, w.moved_at = self.name, self.category in WAITING, time.time()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        w = self.watchdog
        w.waiting, w.moved_at = False, time.time()
        return self.inner.__exit__(*exc)


def _first_line(error: BaseException) -> str:
    """The backend's message without its source location, e.g. `gloo: Connection closed by
    peer [10.213.0.2]:17536` from `[.../gloo/transport/tcp/pair.cc:553] Connection ...`."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if text.startswith("[") and "] " in text:
        where, text = text[1:].split("] ", 1)
        if "gloo" in where:
            text = "gloo: " + text
    return text.split(". This is typically")[0]


def is_communication_error(error: BaseException) -> bool:
    """An error the communication backend raised (a peer gone, a timeout), as opposed to
    a bug in this rank's own computation."""
    import torch.distributed as dist
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("gloo" in text or "NCCL" in text)


def _store_client(timeout_s: float):
    """A client of the job's TCP store of our own, so its timeouts are short and ours."""
    import torch.distributed as dist
    return dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                         int(os.environ.get("MASTER_PORT", "29500")), is_master=False,
                         timeout=timedelta(seconds=max(2.0, timeout_s)), wait_for_workers=False)


def _print_and_exit(line: str | None) -> None:
    """End this process at once: its main thread is blocked in communication."""
    sys.stdout.flush()
    if line:
        print(f"ptdp train: {line}", file=sys.stderr, flush=True)
    record_exit(EXIT_CODE)   # a hang: worth a restart (ptdp/runtime/exit_status.py)
    os._exit(EXIT_CODE)
