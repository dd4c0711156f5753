"""Timelines from real traces: a (4, 1, 1) 1F1B run records every rank's actions in the
schedule's order, and `ptdp timeline` draws it and writes Chrome-trace JSON."""

import json

import pytest
import torch.distributed as dist

from ptdp.cli import main
from ptdp.config.catalogue import INTERLEAVED
from ptdp.runtime.local_ranks import run_on_ranks
from ptdp.pipeline import gantt
from ptdp.pipeline.schedules import build_schedule
from tests.deadline import within
from tests.equivalence import TINY
from tests.optional import needs

M = 8


def _traced_runs(runs: dict) -> None:
    """Each {trace path: overrides} in turn (one spawn for all)."""
    from ptdp.config import load_config
    from ptdp.training import Trainer
    for path, overrides in runs.items():
        cfg = load_config(None, TINY + overrides + ["train.iters=4", f"log.trace_file={path}",
                                                    "log.interval=100",
                                                    "train.global_batch_size=16"],
                          world_size=dist.get_world_size())
        Trainer(cfg).train()


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    runs = {"1f1b": ["parallel.pipeline=4"],
            "interleaved": ["parallel.pipeline=4", "parallel.chunks=2", "schedule.name=interleaved"]}
    run_on_ranks(4, _traced_runs, {str(root / f"{name}.json"): overrides
                                   for name, overrides in runs.items()}, timeout_s=within(240))
    return root


def test_recorded_order_is_the_schedule(traces):
    trace = gantt.read_trace(traces / "1f1b.json")
    assert trace["otherData"] == {"p": 4, "t": 1, "d": 1, "v": 1, "schedule": "1f1b", "m": M}
    assert gantt.traced_iterations(trace) == [2, 3, 4]
    for iteration in (2, 3, 4):
        lanes = gantt.lanes_from_trace(trace, iteration)
        assert len(lanes) == 4
        for rank, lane in enumerate(lanes):
            expected = [str(a) for a in build_schedule("1f1b", 4, 1, M, rank)]
            assert gantt.compute_order(lane) == expected, (iteration, rank)
            starts = [b.start for b in lane.boxes]
            assert starts == sorted(starts) and all(b.end >= b.start for b in lane.boxes)


def test_interleaved_order_and_chunks(traces):
    trace = gantt.read_trace(traces / "interleaved.json")
    lanes = gantt.lanes_from_trace(trace, 3, chunks_of=INTERLEAVED.stage_map(4, 2).chunk_of)
    for rank, lane in enumerate(lanes):
        assert gantt.compute_order(lane) == [str(a) for a in
                                             build_schedule("interleaved", 4, 2, M, rank)]
        assert {b.chunk for b in lane.boxes if b.category == "forward"} == {0, 1}


def test_ptdp_timeline_draws_png_and_chrome_trace(traces, tmp_path, capsys):
    needs("matplotlib")
    png, chrome = tmp_path / "t.png", tmp_path / "t.json"
    assert main(["timeline", str(traces / "1f1b.json"), "--out", str(png),
                 "--chrome", str(chrome)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(chrome.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" and e["cat"] == "forward" for e in events) == 4 * M
    out = capsys.readouterr().out
    assert out.count(", bubble ") == 4 and "rank 3 (p=3, d=0, t=0)" in out


def test_ptdp_timeline_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert main(["timeline", str(bad), "--out", str(tmp_path / "x.png")]) == 2
    assert main(["timeline", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ptdp timeline: {bad} is not a Chrome trace (no traceEvents); write one with "
                   f"log.trace_file=PATH",
                   "ptdp timeline: give a TRACE file, or --schedule NAME to draw a simulated "
                   "schedule"]
