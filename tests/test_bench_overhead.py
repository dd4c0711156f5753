"""tools/bench_overhead.py and bench_startup.py's initial-weights part run their main paths on a
tiny shape: paired rounds with their spread, equal first losses; slices equal to full draws."""

import json
import math

import tools.bench_overhead as bench_overhead
import tools.bench_startup as bench_startup


def test_one_rank_rounds_are_paired_and_start_from_the_same_loss(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    assert bench_overhead.main(["--only", "one-rank", "--rounds", "2", "--warmup", "1",
                                "--layers", "1", "--hidden", "32", "--seq", "16",
                                "--micro-batch", "1", "--m", "2", "--heads", "2", "--vocab", "128",
                                "--json", str(out)]) == 0
    data = json.loads(out.read_text())["one_rank"]
    assert len(data["wall"]["rounds"]) == len(data["cpu"]["rounds"]) == 2
    assert data["wall"]["min"] <= data["wall"]["median"] <= data["wall"]["max"]
    ours, plain = data["first_loss"]
    assert abs(ours - math.log(128)) < 0.3 and abs(plain - math.log(128)) < 0.3   # untrained
    assert "1 rank: ptdp tokens/s / plain PyTorch" in capsys.readouterr().out


def test_startup_init_draws_slices_equal_to_full_draws_and_extrapolates(tmp_path, capsys):
    assert bench_startup.main(["--only", "init", "--init-hidden", "128", "--init-threads", "2",
                               "--repeats", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "init.json").read_text())
    at_scale = data["gpt_175b"]
    assert at_scale["1"]["slices_1_thread_s"] < at_scale["1"]["full_draws_s"]
    assert at_scale["2"]["slices_threads_s"] < at_scale["1"]["slices_1_thread_s"]
    assert "equal to the full draws' slices" in capsys.readouterr().out
