"""No anonymous hang: every rank publishes what it is doing, and a stuck job names who stopped.

Each rank runs a daemon thread that, every `interval_s`, writes a heartbeat to the job's
rendezvous store (a client of its own, with short timeouts): a sequence number, the rank's
process and host, what its main thread is doing (iteration and schedule action, or a phase
such as "checkpoint save") and, on a GPU, the first action its device has not finished
(ptdp/runtime/progress.py: on NCCL the host does not wait where the device does). The main
thread only updates a few attributes (`track`, `doing`) and records one device event per
action: no communication in the step loop.

Progress is what moved last, the host or the device. When neither has moved for the phase's
budget, 80 % of `train.timeout_s` (the job's first iteration and first validation pass, which
compile and set up communicators: 80 % of `train.startup_timeout_s`), the thread reads every
rank's heartbeat. No clock is compared across hosts: a rank has stopped when its sequence
number has not moved for three intervals, as this rank's own monotonic clock measures them
(it starts watching the others' numbers four intervals before its budget runs out), and the
durations in the line are measured on the host they describe. Ranks that stopped (killed,
SIGSTOPped, or a process frozen whole) are named; otherwise every rank is alive, and the ones
not waiting on another rank are named with what they and their device are in (rank, stage,
micro-batch, the transfer or collective). The lowest-numbered rank that is still alive prints
the one line, and every live rank ends with exit code 4, before the backend's own timeout
(torch's NCCL watchdog uses the larger of the two timeouts) would end it with one traceback
per rank. Under NCCL with torch's flight recorder on (`TORCH_NCCL_TRACE_BUFFER_SIZE`, set by
the launch scripts) each rank dumps it first, and the line says where.

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
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from ptdp.runtime.exit_status import HUNG, record_exit
from ptdp.runtime.progress import DeviceProgress, Label

EXIT_CODE = HUNG
WAITING = ("wait", "reduce")  # span categories in which a rank waits on other ranks
STARTUP_TIMEOUT_S = 600.0     # torch's own NCCL default
ENDED = "the end"             # the phase of a rank's last heartbeat when it ends on purpose


class Watchdog:
    def __init__(self, rank: int, world_size: int, describe_rank, timeout_s: float, *,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S, first_iteration: int = 1,
                 store=None, on_hang=None, progress: DeviceProgress | None = None,
                 clock=time.monotonic, sleep=time.sleep):
        """`describe_rank(r)` gives rank r's coordinates; `store` defaults to a new client of
        the job's store (MASTER_ADDR/MASTER_PORT); `on_hang(line)` defaults to printing the
        line (None on ranks that leave the reporting to another) and exiting. The iteration
        `first_iteration` (the job's first, 1-based) and phases marked `slow` get the budget
        of `startup_timeout_s`. `progress`: the device's (None: the host is the device).
        `clock` and `sleep` measure and wait on this host only (tests pass fakes).

        On a single rank there is nobody to wait for: the watchdog stays inert."""
        self.rank, self.world_size, self.describe_rank = rank, world_size, describe_rank
        self.clock, self.sleep = clock, sleep
        self.interval_s = min(5.0, max(0.5, timeout_s / 30))
        self.stall_s = 0.8 * timeout_s       # before the backend's timeout, so we speak first
        self.startup_stall_s = 0.8 * max(timeout_s, startup_timeout_s)
        # A non-reporter's wait for the report: the reporter checks once an interval, and
        # may have blocked a little later.
        self.reporter_grace_s = max(0.1 * timeout_s, 2 * self.interval_s)
        self.watch_from = first_iteration + 1
        self.enabled = world_size > 1
        if self.enabled and store is None:
            store = _store_client(self.interval_s)
        self.store = store
        self.on_hang = on_hang or _print_and_exit
        # inert (one rank): no thread polls the events, so record none
        self.progress = progress if (self.enabled and progress) else DeviceProgress(None, clock)
        self.prefix = f"ptdp/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.iteration, self.what, self.waiting = 0, "start-up", False
        self.moved_at = clock()
        self.watching, self.budget_s = False, self.startup_stall_s
        self.seq = 0                 # heartbeats published
        self.observed: dict = {}     # rank -> (its sequence number, when this rank first saw it)
        self._stop = threading.Event()
        self._wake = threading.Event()   # publish now (a save began), not at the next interval
        self._thread = threading.Thread(target=self._run, name="ptdp-watchdog", daemon=True)

    # Main thread ----------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        if self.enabled:
            self._thread.start()
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self.on_terminate)
        return self

    def on_terminate(self, signum, frame) -> None:
        """SIGTERM: under torchrun, the agent ending this node's ranks because one of them
        died. Name the ranks of this host whose processes are gone, in ptdp's own line (the
        first rank to claim it prints), then end as SIGTERM would."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            self._end_publicly()   # first: the ranks ending alongside must not name this one
            beats = self.heartbeats()
            here = socket.gethostname()
            dead = [r for r, b in beats.items() if r != self.rank and b is not None
                    and b["what"] != ENDED and b["host"] == here and _process_gone(b["pid"])]
            if dead and self._claim_report():
                head = "; ".join(self._where(r, beats[r]) + ", its process gone" for r in dead)
                print(f"ptdp train: lost rank(s): {head}. The launcher is ending the job.",
                      file=sys.stderr, flush=True)
        finally:
            os._exit(128 + signum)

    def stop(self) -> None:
        self._end_publicly()
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s)

    def doing(self, what: str, iteration: int | None = None, watch: bool = True,
              slow: bool = False) -> None:
        """Record the phase the main thread enters; `watch=False` (e.g. the end of a run, which
        waits for a background save's writes) suspends the stall check until the next;
        `slow` (the first validation pass: it compiles its own graphs) gives the phase the
        start-up budget, as the job's first iteration has."""
        if iteration is not None:
            self.iteration = iteration
        self.watching = watch
        self.budget_s = (self.startup_stall_s if slow or self.iteration < self.watch_from
                         else self.stall_s)
        self.what, self.waiting, self.moved_at = what, False, self.clock()

    def saving(self, iteration: int, last_save_s: float | None) -> None:
        """A checkpoint save after `iteration`, watched like an iteration but with the save's
        own time on top of the budget: twice the last save's measured time, or, for a job's
        first save (its length unknown: the disk decides), the start-up budget. A rank frozen
        in a save is then named within train.timeout_s plus the save's time, as in
        "last in iteration 20 at checkpoint save"."""
        self.doing("checkpoint save", iteration=iteration)
        extra = self.startup_stall_s if last_save_s is None else 2 * last_save_s
        self.budget_s = self.stall_s + extra
        self._wake.set()   # heartbeat at once: a rank frozen early in the save is named in it

    def track(self, spans):
        """Wrap a `spans` recorder (ptdp/runtime/trace.py) so every executor action also counts as
        progress (and, on a GPU, records a device event after it); the wrapped recorder
        still records."""
        return _Tracked(self, spans)

    def last_progress(self) -> float:
        """When the host or the device last moved, on this host's clock."""
        return max(self.moved_at, self.progress.moved_at)

    def _end_publicly(self) -> None:
        """The last heartbeat: this rank ends on purpose (its own line, if any, is said), so
        a peer's SIGTERM handler does not name it as lost."""
        if self.enabled:
            self.what = ENDED
            self._publish()

    # Heartbeat thread -----------------------------------------------------------------------
    def _run(self) -> None:
        self.progress.bind_thread()   # on the rank's GPU before querying its events
        self._publish()   # at once: a rank may be lost before the first interval
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set() or self.check():
                return

    def check(self) -> bool:
        """One heartbeat: publish, and act on a stall. True when this rank has ended (or
        handed the report over)."""
        self.progress.poll()
        self._publish()
        if not self.watching:
            return False
        stuck = self.clock() - self.last_progress()
        if stuck > self.budget_s - 4 * self.interval_s:   # watch the others' numbers move
            beats = self.heartbeats()
        if stuck <= self.budget_s:
            return False
        if self.is_reporter(beats):
            line = self.diagnose(beats)
            self._claim_report()   # the job's one line: no SIGTERM handler adds another
            self._end_publicly()
            self.on_hang(line)
            return True
        # The reporter may have blocked a little later than this rank and not yet seen the
        # stall: ending now would have torchrun stop it before it speaks.
        self._stop.wait(self.reporter_grace_s)
        self._end_publicly()
        self.on_hang(None)
        return True

    def _publish(self) -> None:
        self.seq += 1
        now = self.clock()
        device = self.progress.stuck_in()
        beat = {"seq": self.seq, "pid": os.getpid(), "host": socket.gethostname(),
                "iteration": self.iteration, "what": self.what, "waiting": self.waiting,
                "for_s": now - self.moved_at,               # durations on this host's clock
                "device": list(device) if device else None,
                "device_for_s": now - self.progress.moved_at}
        try:
            self.store.set(self.prefix + str(self.rank), json.dumps(beat))
        except Exception:  # the store may be gone while the job ends; never raise here
            pass

    def heartbeats(self) -> dict[int, dict | None]:
        """Every rank's last heartbeat, each with `age_s`: how long this rank has seen its
        sequence number stand still (its own clock; 0 when first seen)."""
        keys = [self.prefix + str(r) for r in range(self.world_size)]
        try:
            values = self.store.multi_get(keys)
        except Exception:
            return {r: None for r in range(self.world_size)}
        now, beats = self.clock(), {}
        for r, value in enumerate(values):
            beat = json.loads(value) if value else None
            if beat is not None:
                seq, seen = self.observed.get(r, (None, now))
                if seq != beat["seq"]:
                    seen = now
                self.observed[r] = (beat["seq"], seen)
                beat["age_s"] = now - seen
            beats[r] = beat
        return beats

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
        deadline = self.clock() + 4 * self.interval_s
        beats = self.heartbeats()
        while not self._stopped_others(beats) and self.clock() < deadline:
            self.sleep(self.interval_s / 4)
            beats = self.heartbeats()
        if self._stopped_others(beats):   # ranks lost together went quiet within an interval
            self.sleep(self.interval_s)
            beats = self.heartbeats()
        stopped = self._stopped_others(beats)
        cause = _first_line(error)
        if all(b is None for b in beats.values()):   # the store went with the node hosting it
            line = (f"lost the job's store at {os.environ.get('MASTER_ADDR')}:"
                    f"{os.environ.get('MASTER_PORT')} and rank {self.rank} "
                    f"{self.describe_rank(self.rank)} saw: {cause}; the node of MASTER_ADDR is "
                    f"probably down. Ending the job.")
        elif stopped:
            head = "; ".join(self._where(r, beats[r], stopped=True) for r in stopped[:8])
            more = f" (+{len(stopped) - 8} more)" if len(stopped) > 8 else ""
            line = (f"lost rank(s): {head}{more}; rank {self.rank} {self.describe_rank(self.rank)} "
                    f"saw: {cause}. Ending the job.")
        else:
            line = (f"communication failed on rank {self.rank} {self.describe_rank(self.rank)} "
                    f"while every rank's heartbeat is fresh: {cause}. Ending the job.")
        if self._claim_report():
            self._end_publicly()
            self.on_hang(line)
        else:
            self.sleep(self.interval_s)    # let the reporter print before torchrun ends us all
            self._end_publicly()
            self.on_hang(None)

    def _stopped_others(self, beats: dict) -> list[int]:
        return [r for r in self._stopped(beats) if r != self.rank]

    def _claim_report(self) -> bool:
        """The first rank to ask reports; without a store (it lived on the lost node)
        every rank does."""
        try:
            return self.store.add(self.prefix + "lost-reporter", 1) == 1
        except Exception:
            return True

    def _stopped(self, beats: dict) -> list[int]:
        """Ranks whose heartbeat has not moved for three intervals (or that have none)."""
        return [r for r, b in beats.items() if b is None or b["age_s"] > 3 * self.interval_s]

    def diagnose(self, beats: dict) -> str:
        """One line: which ranks stopped making progress, and where they were."""
        stopped = self._stopped(beats)
        stuck_for = self.clock() - self.last_progress()
        if stopped:
            head = "; ".join(self._where(r, beats[r], stopped=True) for r in stopped[:8])
            more = f" (+{len(stopped) - 8} more)" if len(stopped) > 8 else ""
            return (f"rank(s) stopped making progress: {head}{more}; the other ranks waited "
                    f"{stuck_for:.0f}s for them{self._own_wait()}. Ending the job.")
        busy = [r for r, b in beats.items() if not _waiting(b)]
        suspects = busy or list(beats)
        head = "; ".join(self._where(r, beats[r]) for r in suspects[:8])
        return (f"no progress for {stuck_for:.0f}s but every rank is alive; "
                f"{'not waiting for another rank' if busy else 'all waiting'}: {head}"
                f"{self._own_wait()}. Ending the job.")

    def _own_wait(self) -> str:
        """Where this (reporting) rank's device waits, when it knows."""
        label = self.progress.stuck_in()
        if label is None:
            return ""
        return f" (rank {self.rank}'s device is in {Label(*label).describe()})"

    def _where(self, rank: int, beat: dict | None, stopped: bool = False) -> str:
        who = f"rank {rank} {self.describe_rank(rank)}"
        if beat is None:
            return f"{who} (never reported)"
        age = beat["age_s"]
        seen = f"no heartbeat for {age:.0f}s, " if stopped else ""
        # its own durations, as of its last heartbeat, plus the time since (when stopped)
        since = beat["for_s"] + (age if stopped else 0)
        device = ""
        if beat.get("device"):
            device_for = beat["device_for_s"] + (age if stopped else 0)
            device = (f"; its device in {Label(*beat['device']).describe()} for "
                      f"{device_for:.0f}s")
        return (f"{who} (pid {beat['pid']} on {beat['host']}; {seen}last in iteration "
                f"{beat['iteration']} at {beat['what']}, for {since:.0f}s{device})")

    def is_reporter(self, beats: dict) -> bool:
        """The lowest-numbered live rank prints; the others end quietly."""
        stopped = set(self._stopped(beats))
        alive = [r for r in beats if r not in stopped] + [self.rank]
        return self.rank == min(alive)


def _waiting(beat: dict | None) -> bool:
    """The rank waits on another: its device is in a transfer or collective, or (no device
    events: CPU) its host is."""
    if beat is None:
        return False
    if beat.get("device"):
        return Label(*beat["device"]).category in WAITING
    return beat["waiting"]


class _Tracked:
    """A spans recorder that also moves the watchdog's progress marks."""

    def __init__(self, watchdog: Watchdog, spans):
        self.watchdog, self.spans = watchdog, spans

    def __call__(self, name: str, category: str, **args):
        return _Span(self.watchdog, self.spans(name, category, **args), name, category, args)


class _Span:
    def __init__(self, watchdog: Watchdog, inner, name: str, category: str, args: dict):
        self.watchdog, self.inner, self.name, self.category = watchdog, inner, name, category
        self.label = Label(name, category, args.get("mb"), args.get("stage"))

    def __enter__(self):
        w = self.watchdog
        w.what, w.waiting, w.moved_at = self.name, self.category in WAITING, w.clock()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        w = self.watchdog
        w.waiting, w.moved_at = False, w.clock()
        w.progress.record(self.label)   # the device's mark: it has finished this action
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


def dump_flight_recorder(rank: int) -> str | None:
    """Write torch's NCCL flight recorder of this rank (the last collectives and transfers
    each communicator saw, with their state) where torch's own dump on timeout would:
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE followed by the rank. Only under NCCL with the recorder
    on (TORCH_NCCL_TRACE_BUFFER_SIZE > 0); returns the path, or None."""
    try:
        if int(os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") or 0) <= 0:
            return None
        import torch.distributed as dist
        if not dist.is_initialized() or dist.get_backend() != "nccl":
            return None
        from torch._C._distributed_c10d import _dump_nccl_trace
        path = f"{os.environ.get('TORCH_NCCL_DEBUG_INFO_TEMP_FILE', '/tmp/nccl_trace_rank_')}{rank}"
        with open(path, "wb") as out:
            out.write(_dump_nccl_trace())
        return path
    except Exception:   # advice only: never let it stop the exit
        return None


def _process_gone(pid: int) -> bool:
    """Whether process `pid` of this host has ended (a zombie counts: its parent has not
    reaped it yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _print_and_exit(line: str | None) -> None:
    """End this process at once: its main thread is blocked in communication."""
    sys.stdout.flush()
    rank = int(os.environ.get("RANK", "0"))
    dumped = dump_flight_recorder(rank)
    if line:
        if dumped:
            line += (f" NCCL flight recorder: {dumped[: -len(str(rank))]}<rank> on each "
                     f"rank's host.")
        print(f"ptdp train: {line}", file=sys.stderr, flush=True)
    record_exit(EXIT_CODE)   # a hang: worth a restart (ptdp/runtime/exit_status.py)
    os._exit(EXIT_CODE)
