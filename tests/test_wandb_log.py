"""Weights & Biases logging (log.wandb_project, ptdp/metrics/wandb_log.py): offline, with no
network, the run holds the same scalars as TensorBoard at the same steps; without the package
the job is refused in one line before it starts."""

from __future__ import annotations

import json

import pytest

from ptdp.checks import Findings, check_packages
from ptdp.config import load_config
from ptdp.metrics.log import MetricsLog, scalars
from tests.test_log_interval import record

BLOCK, HEADER = 32768, 7   # the .wandb file: a 7-byte header, then LevelDB-log blocks
FULL, LAST = 1, 4


def _records(path) -> list[bytes]:
    """The protobuf records of an offline run's .wandb file (LevelDB's log format: in each
    32 KiB block, chunks of crc32, length, type and data; FIRST/MIDDLE/LAST chunks join)."""
    data, pos, out, pending = path.read_bytes(), HEADER, [], b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:   # a block's tail too short for a header: padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4: pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        pending += data[pos + HEADER: pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            out.append(pending)
            pending = b""
    return out


def _history(run_dir) -> dict:
    """{step: {key: value}} of the history records of an offline run."""
    from wandb.proto import wandb_internal_pb2 as pb
    steps = {}
    for raw in _records(next(run_dir.glob("*.wandb"))):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in rec.history.item}
            steps[items.pop("_step")] = {k: v for k, v in items.items()
                                         if not k.startswith("_")}
    return steps


def test_offline_run_holds_the_tensorboard_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'ptdp[wandb]')")
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_DIR", str(tmp_path)),
                        ("WANDB_SILENT", "true"), ("WANDB_DISABLE_GIT", "true")):
        monkeypatch.setenv(name, value)
    cfg = load_config(None, ["train.iters=3", "log.interval=100", "log.wandb_project=ptdp-test",
                             "log.wandb_name=offline"], world_size=1)
    log = MetricsLog(cfg, is_writer=True)
    records = [record(1, 6.0, 0.1), record(2, 4.0, 0.3), record(3, 3.0, 0.2)]
    for r in records:
        log.log(r)
    log.close()
    import wandb
    wandb.teardown()   # wandb-core writes the run's file in the background: until it ends
    run_dir = next((tmp_path / "wandb").glob("offline-run-*"))
    assert _history(run_dir) == {r["iter"]: scalars(r) for r in records}
    assert "train/loss" in scalars(records[0]) and "train/iter" not in scalars(records[0])


def test_wandb_project_without_the_package_is_one_line(monkeypatch):
    import ptdp.checks
    monkeypatch.setattr(ptdp.checks, "package_installed", lambda name: name != "wandb")
    cfg = load_config(None, ["log.wandb_project=p"], world_size=1)
    found = Findings()
    check_packages(cfg, found)
    assert found.errors == ["log.wandb_project is set but the wandb package is not installed: "
                            "pip install 'ptdp[wandb]', or unset log.wandb_project"]
