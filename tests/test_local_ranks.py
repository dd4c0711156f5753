"""Local ranks (ptdp/runtime/local_ranks.py): forked from a server that has torch and the trainer
imported, with the caller's environment as it is at the call; fresh interpreters on request,
for measurements of a rank's own memory."""

import os
import sys

from ptdp.runtime.local_ranks import PRELOAD, run_on_ranks


def _what_a_rank_sees(name: str) -> tuple:
    return os.environ.get(name), "ptdp.training" in sys.modules, int(os.environ["RANK"])


def test_forked_ranks_start_with_the_trainer_imported_and_see_the_callers_environment(
        monkeypatch):
    run_on_ranks(1, _what_a_rank_sees, "PTDP_TEST_PROBE")   # the server runs from here on
    monkeypatch.setenv("PTDP_TEST_PROBE", "set after the server started")
    seen = run_on_ranks(2, _what_a_rank_sees, "PTDP_TEST_PROBE")
    assert "ptdp.training" in PRELOAD
    assert seen == [("set after the server started", True, 0),
                    ("set after the server started", True, 1)]


def test_fresh_interpreters_import_only_what_the_function_needs(monkeypatch):
    monkeypatch.setenv("PTDP_TEST_PROBE", "fresh")
    seen = run_on_ranks(2, _what_a_rank_sees, "PTDP_TEST_PROBE", fresh_interpreters=True)
    assert seen == [("fresh", False, 0), ("fresh", False, 1)]
