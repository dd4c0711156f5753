"""No anonymous hang: a rank that stops is named, and the job ends within train.timeout_s.

The unit tests drive the watchdog with an in-memory store and, where time matters, fake
clocks (one per host: they may disagree) and fake device events (the GPU's progress); one
trains 2 real ranks through a slow first iteration and a long validation pass, which must not
end the job; the last stops one of 4 real ranks with SIGSTOP under torchrun and checks that
the job ends, non-zero, naming it.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from ptdp.runtime.progress import DeviceProgress, Label
from ptdp.runtime.trace import NO_SPANS
from ptdp.runtime.watchdog import Watchdog, is_communication_error
from tests.deadline import within
from tools import jobs

ROOT = Path(__file__).resolve().parents[1]


class MemoryStore:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def multi_get(self, keys):
        return [self.data.get(k, b"") for k in keys]

    def add(self, key, amount):
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value


class FakeClock:
    """A host's monotonic clock, advanced by the test; `offset` makes hosts disagree."""

    def __init__(self, offset: float = 0.0):
        self.now = 1000.0 + offset

    def __call__(self) -> float:
        return self.now


def _watchdogs(world: int, timeout_s: float = 30.0, offsets=None, **kwargs):
    store = MemoryStore()
    clocks = [FakeClock(offsets[r] if offsets else 0.0) for r in range(world)]
    dogs = [Watchdog(r, world, lambda r: f"(p={r})", timeout_s, store=store,
                     on_hang=lambda line: None, clock=clocks[r], **kwargs) for r in range(world)]
    return store, dogs, clocks


def _advance(dogs, clocks, seconds: float, live, step: float = 0.5) -> dict:
    """Let `seconds` pass on every host; the `live` ranks publish a heartbeat every `step`, and
    rank 0 reads them all each time (as its watchdog does near its budget)."""
    for _ in range(round(seconds / step)):
        for clock in clocks:
            clock.now += step
        for dog in dogs:
            if dog.rank in live:
                dog._publish()
        beats = dogs[0].heartbeats()
    return beats


def test_a_rank_without_heartbeat_is_named_with_its_last_action():
    store, dogs, clocks = _watchdogs(4)
    for dog in dogs:
        dog.doing("iteration 7", iteration=7)
    with dogs[2].track(NO_SPANS)("F3@s1", "forward", mb=3, stage=1):
        for dog in dogs:
            dog._publish()
    clocks[2].now -= 100            # rank 2's host keeps its own time: it is never compared
    beats = _advance(dogs, clocks, 4.0, live={0, 1, 3})
    line = dogs[0].diagnose(beats)
    assert line.startswith("rank(s) stopped making progress: rank 2 (p=2) (pid ")
    assert "no heartbeat for 4s, last in iteration 7 at F3@s1, for 4s" in line
    assert [d.is_reporter(beats) for d in dogs] == [True, False, False, False]


def test_clock_skew_between_hosts_marks_no_live_rank_as_stopped():
    """Hosts 15 s apart (an NTP-less cluster): heartbeats carry sequence numbers and durations
    measured on their own host, and each rank times the others' numbers on its own clock, so
    live ranks stay live and the durations in the line are right."""
    store, dogs, clocks = _watchdogs(3, offsets=[0.0, 15.0, -15.0])
    for dog in dogs:
        dog.doing("iteration 4", iteration=4)
    spans = [dog.track(NO_SPANS) for dog in dogs]
    with spans[0]("wait act mb1 s0->s1", "wait"), spans[1]("B1@s1", "backward"), \
            spans[2]("data-parallel reduce", "reduce"):
        beats = _advance(dogs, clocks, 6.0, live={0, 1, 2})
        assert dogs[0]._stopped(beats) == []
        line = dogs[0].diagnose(beats)
    assert "every rank is alive" in line and "stopped" not in line
    assert "rank 1 (p=1)" in line and "at B1@s1, for 6s" in line
    assert "rank 0 " not in line and "rank 2 " not in line


def test_a_lost_peer_is_named_once_with_the_backend_error():
    """Ranks whose communication failed wait for the dead rank's heartbeat to go stale (as
    their own clocks measure it); the first to claim the report names it, the others end
    quietly."""
    fired = []
    store, clocks = MemoryStore(), [FakeClock(offset=7.0 * r) for r in range(4)]

    def sleep(seconds):       # time passes on every host; the live ranks keep publishing
        for clock in clocks:
            clock.now += seconds
        for dog in dogs:
            if dog.rank != 2:
                dog._publish()

    dogs = [Watchdog(r, 4, lambda r: f"(p={r})", 1.0, store=store, on_hang=fired.append,
                     clock=clocks[r], sleep=sleep) for r in range(4)]
    for dog in dogs:
        dog.doing("iteration 3", iteration=3)
        dog._publish()
    error = RuntimeError("[/x/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                         "by peer [10.213.0.2]:17536. This is typically caused by a remote "
                         "worker crashing.")
    assert is_communication_error(error) and not is_communication_error(ValueError("gloo"))
    dogs[3].lost_peer(error)
    dogs[0].lost_peer(error)
    assert fired[1] is None
    assert fired[0].startswith("lost rank(s): rank 2 (p=2) (pid ")
    assert "no heartbeat for 2s" in fired[0] and "last in iteration 3 at iteration 3, for 2s" in fired[0]
    assert fired[0].endswith("rank 3 (p=3) saw: gloo: Connection closed by peer "
                             "[10.213.0.2]:17536. Ending the job.")


class FakeEvent:
    """A device event: complete once the fake device has run past it."""

    def __init__(self, device):
        self.device, self.at = device, None

    def record(self):
        self.device.recorded += 1
        self.at = self.device.recorded

    def query(self):
        return self.at <= self.device.finished


class FakeDevice:
    def __init__(self):
        self.recorded = self.finished = 0


def test_progress_is_what_the_device_finished_and_the_line_names_its_action():
    """On NCCL the host runs ahead and blocks later (in the iteration's one read): host marks
    say nothing. Device events recorded after each action, polled by the watchdog's thread,
    are the progress, and the first unfinished one is where the device is stuck: rank,
    stage, micro-batch and transfer. Rank 1 sent nothing, so it is named as the one not
    waiting; rank 0's device is in the receive."""
    devices = [FakeDevice(), FakeDevice()]
    store, dogs, clocks = _watchdogs(
        2, timeout_s=10.0, first_iteration=1)
    for dog, device in zip(dogs, devices):
        dog.progress = DeviceProgress(lambda device=device: FakeEvent(device), dog.clock)
        dog.progress.moved_at = dog.clock()
        dog.doing("iteration 5", iteration=5)
    spans = [dog.track(NO_SPANS) for dog in dogs]
    for name, category, mb in (("F0@s0", "forward", 0), ("wait grad mb0 s1->s0", "wait", 0),
                               ("B0@s0", "backward", 0)):
        with spans[0](name, category, mb=mb, stage=0):
            pass                        # enqueued at once: the host never waits
    with spans[1]("F0@s1", "forward", mb=0, stage=1):
        pass
    with spans[1]("B0@s1", "backward", mb=0, stage=1):
        pass
    devices[0].finished = 1             # rank 0's device ran F0 and waits for the gradient
    devices[1].finished = 1             # rank 1's is stuck in B0
    for dog in dogs:
        dog.doing("iteration 5 statistics", iteration=5)   # the host blocks here
    for _ in range(18):                                     # 9 s: past the 8 s budget
        for clock in clocks:
            clock.now += 0.5
        for dog in dogs:
            dog.progress.poll()
            dog._publish()
        beats = dogs[0].heartbeats()
    assert dogs[0].progress.last_done.name == "F0@s0"
    assert dogs[0].clock() - dogs[0].last_progress() > dogs[0].budget_s
    line = dogs[0].diagnose(beats)
    assert line.startswith("no progress for 8s but every rank is alive; not waiting for "
                           "another rank: rank 1 (p=1)")
    assert "its device in B0@s1 (stage 1, micro-batch 0) for 8s" in line
    assert ("rank 0's device is in wait grad mb0 s1->s0 (stage 0, micro-batch 0)") in line
    devices[1].finished = 2              # the device moves again: progress, no stall
    dogs[1].progress.poll()
    assert dogs[1].clock() - dogs[1].last_progress() == 0


def test_a_slow_first_iteration_and_first_validation_get_the_start_up_budget():
    """The first iteration and the first validation pass compile; later ones do not."""
    dog = Watchdog(0, 2, str, timeout_s=10.0, startup_timeout_s=100.0, store=MemoryStore(),
                   first_iteration=3, on_hang=lambda line: None, clock=FakeClock())
    dog.doing("iteration 3", iteration=3)
    assert dog.budget_s == pytest.approx(80.0)
    dog.doing("evaluation", slow=True)
    assert dog.budget_s == pytest.approx(80.0)
    dog.doing("iteration 4", iteration=4)
    assert dog.budget_s == pytest.approx(8.0)
    dog.doing("evaluation")
    assert dog.budget_s == pytest.approx(8.0)


# Three tests that mostly wait on real clocks (a stall budget, a reporter's grace, a late rank
# and a slow validation: ~12 s together) run their scenarios at once, in threads of the
# `waits` fixture below; each test asserts on its own scenario's outcome.

def _stall_scenario() -> dict:
    """A detector with timeout_s=1 through the job's first iteration, a checkpoint save and a
    stalled iteration, 1.6 s each: what it had fired after each."""
    fired, seen = [], []
    dog = Watchdog(0, 2, str, timeout_s=1.0, store=MemoryStore(), first_iteration=5,
                   on_hang=fired.append)
    budgets = (dog.stall_s, dog.interval_s)
    dog.start()
    try:
        dog.doing("iteration 5", iteration=5)      # the job's first: start-up budget
        time.sleep(1.6)
        seen.append(list(fired))
        dog.doing("checkpoint save", iteration=6, watch=False)
        time.sleep(1.6)
        seen.append(list(fired))
        dog.doing("iteration 7", iteration=7)
        time.sleep(1.6)
    finally:
        dog.stop()
    return {"budgets": budgets, "seen": seen, "fired": fired}


def _reporter_scenario() -> dict:
    """Rank 1 blocks 0.1 s before rank 0, both with timeout_s=2: who ended, when, saying what."""
    calls = []
    store = MemoryStore()
    dogs = [Watchdog(r, 2, str, timeout_s=2.0, store=store, first_iteration=1,
                     on_hang=lambda line, r=r: calls.append((r, line, time.time())))
            for r in range(2)]
    for dog in dogs:
        dog.start()
    try:
        dogs[1].doing("iteration 2", iteration=2)
        time.sleep(0.1)                          # rank 0 blocks later than rank 1
        dogs[0].doing("iteration 2", iteration=2)
        deadline = time.monotonic() + 10
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for dog in dogs:
            dog.stop()
    return {"grace": dogs[1].reporter_grace_s, "calls": calls}


@pytest.fixture(scope="module")
def waits(tmp_path_factory):
    """The waiting scenarios, and the job of 4 ranks whose stopped rank is named (its cores
    idle while the stall budget runs out), started together: {name: future of its outcome}."""
    from concurrent.futures import ThreadPoolExecutor

    from ptdp.runtime.local_ranks import run_on_ranks
    with ThreadPoolExecutor(4) as pool:
        yield {"stall": pool.submit(_stall_scenario),
               "reporter": pool.submit(_reporter_scenario),
               "slow start": pool.submit(run_on_ranks, 2, _slow_first_iteration_and_validation,
                                         timeout_s=60),
               "sigstop": pool.submit(_sigstop_scenario, tmp_path_factory.mktemp("sigstop"))}


def test_stall_check_fires_only_after_the_first_iteration_and_not_in_checkpoint_saves(waits):
    out = waits["stall"].result()
    assert out["budgets"][0] == pytest.approx(0.8) and out["budgets"][1] == 0.5
    assert out["seen"] == [[], []]     # not in the first iteration, not in the save
    assert len(out["fired"]) == 1


def test_a_rank_that_does_not_report_gives_the_reporter_time_to_speak(waits):
    """Rank 1 sees the stall first but rank 0 reports: rank 1 ends only after a grace, so that
    torchrun does not stop rank 0 before it has printed (the job's one line)."""
    out = waits["reporter"].result()
    assert out["grace"] == pytest.approx(1.0)   # two heartbeat intervals
    (first, line, at), (second, quiet, end) = sorted(out["calls"], key=lambda c: c[2])
    assert first == 0 and line.startswith("no progress for") and (second, quiet) == (1, None)


def _slow_first_iteration_and_validation() -> list[dict]:
    """p = 2 with train.timeout_s=1 (a stall budget of 0.8 s): rank 1 builds its first
    micro-batch 1.5 s late (as when it compiles longer than its peer), and every validation
    micro-batch takes 0.1 s (a pass of 1.6 s or more, each forward short)."""
    import torch.distributed as dist

    from ptdp.config import load_config
    from ptdp.training import Trainer
    from tests.equivalence import TINY

    cfg = load_config(None, TINY + ["parallel.pipeline=2", "train.iters=2", "train.eval_interval=2",
                                    "train.eval_iters=4", "train.timeout_s=1",
                                    "train.startup_timeout_s=30", "log.progress=false"],
                      world_size=dist.get_world_size())
    trainer = Trainer(cfg)
    train, valid = trainer.batches["train"], trainer.batches["valid"]
    build_train, build_valid = train.get, valid.get

    def late_first(iteration, mb):
        if (iteration, mb) == (0, 0) and dist.get_rank() == 1:
            time.sleep(1.5)
        return build_train(iteration, mb)

    def slow(iteration, mb):
        time.sleep(0.1)
        return build_valid(iteration, mb)

    train.get, valid.get = late_first, slow
    return trainer.train()


def test_a_slow_first_iteration_and_a_long_validation_do_not_end_a_healthy_job(waits):
    """Issue 22, item 2: the stall check counts every validation forward as progress, and the
    first iteration (and validation) get train.startup_timeout_s, which the backend's own
    timeout follows; before, this job ended with exit 4 (or gloo's timeout) on both."""
    histories = waits["slow start"].result()
    assert [len(h) for h in histories] == [2, 2]
    assert all(record["valid_loss"] > 0 for record in (histories[0][1], histories[1][1]))


def _continue_when_named(job, stopped: list, lines: list) -> None:
    """Collect the job's output; once it names a stopped rank, let the stopped ranks (pids in
    `stopped`, which may be filled later) run again, so that they take torchrun's SIGTERM at
    once instead of torchrun waiting out its 30 s grace for a frozen process (the job has
    already ended by then, and said why)."""
    for line in job.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("ptdp train: rank(s) stopped making progress"):
            jobs.send(stopped, signal.SIGCONT)


# The stopped rank is named after 80 % of this (2.4 s, while the job's cores sit idle); the
# heartbeat interval is 0.5 s either way, so the stopped rank is still watched for four
# intervals before the budget runs out, as with a longer timeout.
STALL_TIMEOUT_S = 3


def _sigstop_scenario(tmp_path: Path) -> dict:
    """4 ranks under torchrun, rank 3 stopped (SIGSTOP) at iteration 3: the job's exit code
    and output, and how long it took to end after the stop."""
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "ptdp", "train", str(ROOT / "configs/gpt_tiny.yaml"), "parallel.pipeline=2",
           "parallel.tensor=2", "train.iters=100000", f"train.timeout_s={STALL_TIMEOUT_S}",
           "log.interval=1000", f"log.metrics_file={metrics}", "log.progress=false"]
    job = jobs.start(cmd, tmp_path)
    lines, reader = [], None
    try:
        jobs.wait_for_iteration(metrics, job, 3, timeout=within(120))
        stopped = jobs.pid_of_rank(3, job.marker)
        reader = threading.Thread(target=_continue_when_named, args=(job, [stopped], lines),
                                  daemon=True)
        reader.start()
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        job.wait(timeout=within(150))
        elapsed = time.monotonic() - start
        reader.join(timeout=10)
    finally:
        jobs.stop(job)   # the workers too, whatever happened
    return {"rc": job.returncode, "lines": lines, "elapsed": elapsed}


def test_sigstop_on_one_of_4_ranks_ends_the_job_naming_it(waits):
    ended = waits["sigstop"].result()
    lines, elapsed = ended["lines"], ended["elapsed"]
    out = "\n".join(lines)
    ours = [line for line in lines if line.startswith("ptdp train: ")]
    assert ended["rc"] != 0
    assert len(ours) == 1, out
    assert ours[0].startswith("ptdp train: rank(s) stopped making progress: rank 3 (p=1, d=0, t=1)")
    assert "no heartbeat for" in ours[0] and "last in iteration" in ours[0]
    assert elapsed < STALL_TIMEOUT_S + 45, elapsed   # the stall check, then torchrun's shutdown


def test_a_single_rank_records_no_device_events():
    """One rank has no hang detector thread to poll the events: none may pile up."""
    from ptdp.runtime.progress import DeviceProgress

    class Event:
        def record(self):
            pass

        def query(self):
            return False

    dog = Watchdog(0, 1, str, 30.0, progress=DeviceProgress(Event))
    with dog.track(NO_SPANS)("forward", "compute", mb=0):
        pass
    assert not dog.progress.pending


def test_the_detector_thread_binds_to_the_ranks_device_before_querying_events():
    """A new thread starts on GPU 0: the watchdog's thread must make the rank's device current
    (ptdp/runtime/progress.py `bind_thread`) before its first event query, or every rank of a
    node would make a context on GPU 0. A fake factory records which thread bound and queried."""
    calls = []

    class Event:
        def record(self):
            pass

        def query(self):
            calls.append(("query", threading.current_thread().name))
            return True

    class Events:
        def __call__(self):
            return Event()

        def bind_thread(self):
            calls.append(("bind", threading.current_thread().name))

    progress = DeviceProgress(Events())
    progress.record(Label("F0@s0", "forward"))
    dog = Watchdog(0, 2, str, timeout_s=30.0, store=MemoryStore(), progress=progress,
                   on_hang=lambda line: None)
    dog.interval_s = 0.01
    handler = signal.getsignal(signal.SIGTERM)   # start() installs its own
    try:
        dog.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(calls) < 2:
            time.sleep(0.01)
        dog.stop()
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert calls[:2] == [("bind", "ptdp-watchdog"), ("query", "ptdp-watchdog")]
