"""The console line printed every log.interval iterations averages the interval (as Megatron-LM's
log lines do), while the metrics file keeps one record per iteration."""

from __future__ import annotations

import pytest

from ptdp.config import load_config
from ptdp.metrics.log import MetricsLog, interval_average, read_metrics


def record(it: int, loss: float, seconds: float, skipped: bool = False, **extra) -> dict:
    tokens = 8 * 16
    return {"iter": it, "loss": loss, "lr": 1e-3 * it, "grad_norm": 0.5 + it,
            "step_time_s": seconds,
            "tokens_per_s": tokens / seconds, "tflops_per_gpu": 0.004 / seconds, "mfu": None,
            "loss_scale": 1.0, "skipped": skipped, "mem_gb": 0.1 * it, **extra}


def test_interval_average_is_megatrons():
    window = [record(1, 4.0, 0.1), record(2, 9.0, 0.3, skipped=True), record(3, 2.0, 0.2)]
    avg = interval_average(window)
    assert avg["loss"] == pytest.approx(3.0)            # skipped iterations left out
    assert avg["step_time_s"] == pytest.approx(0.2)
    assert avg["tokens_per_s"] == pytest.approx(3 * 8 * 16 / 0.6)   # total tokens / total time
    assert avg["tflops_per_gpu"] == pytest.approx(3 * 0.004 / 0.6)
    assert avg["skipped"] == 1
    assert (avg["iter"], avg["lr"], avg["grad_norm"], avg["mem_gb"]) == (3, 3e-3, 3.5, 0.1 * 3)
    assert interval_average([record(1, 5.0, 0.1, skipped=True)])["loss"] == 5.0


def test_console_lines_average_the_interval_and_the_file_keeps_every_iteration(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    cfg = load_config(None, ["train.iters=5", "log.interval=2", f"log.metrics_file={path}"],
                      world_size=1)
    log = MetricsLog(cfg, is_writer=True)
    records = [record(1, 6.0, 0.1), record(2, 4.0, 0.3), record(3, 3.0, 0.2),
               record(4, 1.0, 0.2, skipped=True), record(5, 2.0, 0.4, valid_loss=2.5)]
    for r in records:
        log.log(r)
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3                              # iterations 2, 4, and 5 (validation)
    assert lines[0].startswith("iter      2/5 | loss 5.0000 | lr 2.00e-03 | grad norm 2.500 | "
                               "200 ms | 640 tok/s")
    assert "loss 3.0000" in lines[1] and "| 200 ms |" in lines[1] and "skipped 1" in lines[1]
    assert "loss 2.0000" in lines[2] and "valid loss 2.5000" in lines[2]
    assert "skipped" not in lines[2]
    assert read_metrics(path) == records
