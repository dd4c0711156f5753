"""The hang detector covers checkpoint saves (ptdp/runtime/watchdog.py `saving`): a rank frozen
in a save is named within the stall budget plus the save's own time (twice the last save's;
the start-up budget for a first save), with the iteration and phase it froze in. It used to
pause during saves, leaving the frozen rank to gloo's 600-s timeout."""

from __future__ import annotations

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
