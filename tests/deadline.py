"""Every wait of a test ends inside pytest's per-test limit, so that its own message is read.

pytest-timeout (`timeout` in pyproject.toml, 300 s, or a test's `pytest.mark.timeout`) ends a
test that runs too long with a stack dump that does not say what was awaited, and it counts the
test's fixtures: a module-scoped fixture's spawned jobs and launches count in the first test that
uses it. A test's own waits (a spawned job's `timeout_s`, a launched job's `wait`, waiting for an
iteration) say which ranks, job or iteration did not come; they must end first. Each such wait
asks `within(seconds)`: its own bound, cut to what is left of the running test's budget, its limit
less MARGIN_S (for the assertions, the teardown and stopping what it started). tests/conftest.py
starts the budget as each test starts.
"""

from __future__ import annotations

import os
import time

MARGIN_S = 30.0
SHORTEST_S = 5.0   # a wait is never given less: it still says what it waited for

_ends_at: float | None = None   # monotonic time the running test's budget ends; None: no limit


def limit_of(item) -> float | None:
    """The running test's limit as pytest-timeout reads it: its `timeout` marker, else
    --timeout, else PYTEST_TIMEOUT, else the ini's `timeout`; None if there is none."""
    marker = item.get_closest_marker("timeout")
    values = [marker.kwargs.get("timeout", marker.args[0] if marker.args else None)] \
        if marker else []
    values.append(item.config.getoption("timeout", None))
    values.append(os.environ.get("PYTEST_TIMEOUT"))
    try:
        values.append(item.config.getini("timeout"))
    except ValueError:   # pytest-timeout not installed: no limit
        pass
    for value in values:
        if value not in (None, ""):
            return float(value) if float(value) > 0 else None
    return None


def start(limit_s: float | None) -> None:
    """The budget of the test starting now (tests/conftest.py, before its fixtures)."""
    global _ends_at
    _ends_at = None if limit_s is None else time.monotonic() + limit_s - MARGIN_S


def within(seconds: float) -> float:
    """`seconds`, or what is left of the running test's budget if that is less (but at least
    SHORTEST_S): the bound to give a wait."""
    if _ends_at is None:
        return seconds
    return min(seconds, max(_ends_at - time.monotonic(), SHORTEST_S))
