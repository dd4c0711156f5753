"""The hang detector covers checkpoint saves (ptdp/runtime/watchdog.py `saving`): a rank frozen
in a save is named within the stall budget plus the save's own time (twice the last save's;
the start-up budget for a first save), with the iteration and phase it froze in. It used to
pause during saves, leaving the frozen rank to gloo's 600-s timeout. The unit tests use fake
clocks; the last stops a real rank with SIGSTOP inside a real save."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from ptdp.runtime.local_ranks import RankFailure, run_on_ranks
from ptdp.runtime.watchdog import Watchdog
from tests.test_watchdog import FakeClock, MemoryStore, _advance


def _frozen_in_save(last_save_s: float | None, seconds: float) -> tuple[list, str | None]:
    store, clocks = MemoryStore(), [FakeClock() for _ in range(2)]
    fired = []
    dogs = [Watchdog(r, 2, lambda r: f"(p={r})", 10.0, startup_timeout_s=100.0, store=store,
                     on_hang=fired.append, clock=clocks[r], first_iteration=1)
            for r in range(2)]
    for dog in dogs:
        dog.doing("iteration 20", iteration=20)
        dog.saving(20, last_save_s)
        dog._publish()
    beats = _advance(dogs, clocks, seconds, live={0})   # rank 1 froze in the save
    ended = dogs[0].check()
    return fired, (dogs[0].diagnose(beats) if ended else None)


def test_a_rank_frozen_in_a_save_is_named_with_the_save_and_its_iteration():
    # budget 0.8 x 10 s + 2 x 3 s = 14 s
    fired, line = _frozen_in_save(3.0, 13.0)
    assert fired == [] and line is None
    fired, line = _frozen_in_save(3.0, 15.0)
    assert len(fired) == 1 and fired[0] == line
    assert line.startswith("rank(s) stopped making progress: rank 1 (p=1) (pid ")
    assert "last in iteration 20 at checkpoint save" in line


def test_a_first_save_gets_the_start_up_budget():
    fired, _ = _frozen_in_save(None, 80.0)        # 0.8 x 10 + 0.8 x 100 = 88 s
    assert fired == []
    fired, _ = _frozen_in_save(None, 90.0)
    assert len(fired) == 1 and "at checkpoint save" in fired[0]


def frozen_save_job(root: str) -> None:
    """Two real ranks (pipeline 2) saving every iteration; rank 1 stops itself with a real
    SIGSTOP inside its second save (iteration 2, after writing its files), sooner than its
    next regular heartbeat: the save's start publishes one at once. Rank 0's detector,
    on real clocks and the job's real store, must name it: its line, how long after rank 0
    entered that save it came, the budget it had and, for each of its heartbeats since, whether
    the budget was spent, go to a file; then it ends rank 1."""
    import torch.distributed as dist

    import ptdp.checkpoint.save as save
    import ptdp.runtime.watchdog as watchdog
    from ptdp.config import load_config
    from ptdp.training import Trainer
    from tests.equivalence import TINY
    root, rank = Path(root), dist.get_rank()
    if rank == 1:
        (root / "pid1").write_text(str(os.getpid()))
        saves = []

        def reached(stage: str) -> None:
            saves.append(stage)
            if stage == "rank_files" and saves.count(stage) == 2:
                time.sleep(0.2)   # under a heartbeat interval (0.5 s) into the save
                os.kill(os.getpid(), signal.SIGSTOP)
        save._reached = reached
    else:
        entered, past = {}, []   # past: each heartbeat's "budget spent" since the save began
        original, original_check = watchdog.Watchdog.saving, watchdog.Watchdog.check

        def saving(dog, iteration, last_save_s):
            original(dog, iteration, last_save_s)
            entered.update(at=time.monotonic(), budget=dog.budget_s)
            past.clear()

        def check(dog):
            # measured before the heartbeat measures it: True here means True there
            past.append(dog.clock() - dog.last_progress() > dog.budget_s)
            return original_check(dog)

        def report(line):   # (inside the heartbeat that names the rank: past[-1] is its own)
            (root / "report.json").write_text(json.dumps(
                {"elapsed": time.monotonic() - entered["at"], "budget": entered["budget"],
                 "past": past, "line": line}))
            os.kill(int((root / "pid1").read_text()), signal.SIGKILL)
            os._exit(4)
        watchdog.Watchdog.saving, watchdog.Watchdog.check = saving, check
        watchdog._print_and_exit = report
    cfg = load_config(None, TINY + ["model.num_layers=2", "parallel.pipeline=2", "train.iters=4",
                                    "train.timeout_s=2", "train.startup_timeout_s=5",
                                    f"checkpoint.dir={root}/ck", "checkpoint.save_interval=1",
                                    "log.progress=false"], world_size=2)
    Trainer(cfg).train()


def test_a_real_sigstop_inside_a_save_is_named_within_its_budget(tmp_path):
    with pytest.raises(RankFailure):   # rank 0 ends with exit 4, rank 1 is killed
        run_on_ranks(2, frozen_save_job, str(tmp_path), timeout_s=120)
    report = json.loads((tmp_path / "report.json").read_text())
    line, budget = report["line"], report["budget"]
    assert line.startswith("rank(s) stopped making progress: rank 1 ")
    assert "last in iteration 2 at checkpoint save" in line
    assert budget < 2 + 1   # 0.8 x 2 s + twice the first save's time
    # Not before the budget, and at the first heartbeat after it, however late a loaded
    # machine runs the heartbeats: no earlier one found the budget spent and went on.
    assert report["elapsed"] >= budget
    assert not any(report["past"][:-1]), report["past"]
