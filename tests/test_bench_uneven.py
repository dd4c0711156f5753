"""tools/bench_uneven.py on a tiny model: every candidate split is timed and reported."""

import json

import pytest

import tools.bench_uneven as bench_uneven

pytestmark = pytest.mark.timeout(240)


def test_neighbours_move_one_layer_and_keep_middle_stages_busy():
    got = bench_uneven.neighbours((1, 1, 0))
    assert set(got) == {(0, 2, 0), (0, 1, 1)}   # (2, 0, 0) and (1, 0, 1) empty the middle stage
    assert all(sum(split) == 2 for split in got)


def test_bench_uneven_times_even_planned_and_neighbours(tmp_path, capsys):
    assert bench_uneven.main(["--p", "2", "--m", "2", "--layers", "2", "--hidden", "32",
                              "--seq", "16", "--vocab", "4096", "--micro-batch", "1",
                              "--iters", "2", "--repeats", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "uneven.json").read_text())
    summary, rows = data["summary"], data["results"]
    splits = [tuple(r["stage_layers"]) for r in rows]
    assert splits[0] == (1, 1) and len(set(splits)) == len(splits)
    assert tuple(summary["planned"]) in splits and all(sum(s) == 2 for s in splits)
    assert all(r["step_time_s"] > 0 and len(r["steps"]) == 1 for r in rows)
    assert "stage_layers" in capsys.readouterr().out
