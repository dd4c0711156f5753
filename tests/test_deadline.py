"""tests/deadline.py: a test's waits end inside pytest's per-test limit, fixtures included."""

import time

import pytest

from tests import deadline


def _limit(request) -> float:
    limit = deadline.limit_of(request.node)
    if limit is None:
        pytest.skip("no per-test limit (pytest-timeout is off)")
    return limit


@pytest.fixture(scope="module")
def left_in_module_setup():
    """What a module-scoped fixture (a spawned job's, say) may wait: it runs inside the first
    test that uses it, so inside that test's budget."""
    return deadline.within(10_000)


def test_a_module_fixture_waits_inside_the_first_tests_budget(left_in_module_setup, request):
    limit = _limit(request)
    assert limit - deadline.MARGIN_S - 5 < left_in_module_setup <= limit - deadline.MARGIN_S


def test_the_configured_limit_less_the_margin_bounds_every_wait(request, pytestconfig):
    limit = _limit(request)
    if request.node.get_closest_marker("timeout") is None and \
            pytestconfig.getoption("timeout", None) is None:
        assert limit == float(pytestconfig.getini("timeout"))   # pyproject.toml's 300
    assert deadline.within(10_000) <= limit - deadline.MARGIN_S
    assert deadline.within(2) == 2


@pytest.mark.timeout(100)
def test_a_timeout_marker_sets_the_budget(request):
    assert _limit(request) == 100
    assert deadline.within(10_000) <= 100 - deadline.MARGIN_S


def test_waits_share_what_is_left_and_never_get_less_than_the_shortest(monkeypatch):
    monkeypatch.setattr(deadline, "_ends_at", time.monotonic() + 50)
    assert 45 < deadline.within(400) <= 50 and deadline.within(20) == 20
    monkeypatch.setattr(deadline, "_ends_at", time.monotonic() - 1)
    assert deadline.within(400) == deadline.SHORTEST_S and deadline.within(1) == 1
    monkeypatch.setattr(deadline, "_ends_at", None)   # outside a test: a wait keeps its own
    assert deadline.within(400) == 400
