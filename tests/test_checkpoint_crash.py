"""Checkpoints that cannot tear: a save that dies at any step leaves a checkpoint to resume
from, the resumed job continues exactly (same losses and weights as an uninterrupted run),
its metrics file holds every iteration once, and the next save sweeps the leftovers.

A crash is simulated by raising from `ptdp.checkpoint.save._reached`, which a save calls after
each of its steps: nothing after that point runs, as if the process had been killed there.
All runs share one spawned 2-rank job (process start-up dominates on 2 cores).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ptdp.checkpoint import save as checkpoint_save
from ptdp.checkpoint.layout import (CheckpointError, find_checkpoint, iteration_dir_name,
                                    resolve_checkpoint)
from ptdp.runtime.local_ranks import run_on_ranks
from ptdp.metrics.log import drop_records_after, read_metrics
from tests.deadline import within
from tests.equivalence import TINY

ITERS = 6                      # saves at 2, 4 and 6
CRASHED_SAVE = 4               # the save each crash run dies in
LAYOUT = ["parallel.pipeline=2", "model.dropout=0.1"]   # dropout: the RNG state must resume too
# Steps of a save of an iteration that does not exist yet, and of one that does.
FRESH_STAGES = ["tmp_dir", "rank_files", "metadata", "renamed"]
RESAVE_STAGES = ["metadata", "side_renamed", "latest_to_side", "old_moved", "old_removed",
                 "renamed_back"]
CASES = [("fresh", s) for s in FRESH_STAGES] + [("resave", s) for s in RESAVE_STAGES]


class SimulatedCrash(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------
# The spawned job
# --------------------------------------------------------------------------------------------

def _trainer(directory: Path, metrics: Path, load: Path | None = None):
    from ptdp.config import load_config
    from ptdp.training import Trainer
    overrides = TINY + LAYOUT + [f"train.iters={ITERS}", f"checkpoint.dir={directory}",
                                 "checkpoint.save_interval=2", f"log.metrics_file={metrics}",
                                 "log.progress=false"]
    if load:
        overrides.append(f"checkpoint.load={load}")
    return Trainer(load_config(None, overrides, world_size=dist.get_world_size()))


def _crash_after(stage: str):
    def reached(name: str) -> None:
        # Rank files are written by every rank: let only rank 1 die there.
        if name == stage and (name != "rank_files" or dist.get_rank() == 1):
            raise SimulatedCrash(f"simulated crash after {name}")
    return reached


def _set_up(kind: str, ref: Path, ref_metrics: Path, directory: Path, metrics: Path) -> None:
    """Rank 0 copies the reference checkpoints as they were before the save of iteration 4:
    only iter_2 for a fresh save; iter_2 and iter_4 for a re-save of 4."""
    if dist.get_rank() == 0:
        shutil.copytree(ref, directory)
        drop = [ITERS] + ([CRASHED_SAVE] if kind == "fresh" else [])
        for it in drop:
            shutil.rmtree(directory / iteration_dir_name(it))
        keep = CRASHED_SAVE if kind == "resave" else 2
        (directory / "latest").write_text(iteration_dir_name(keep) + "\n")
        shutil.copy(ref_metrics, metrics)
        drop_records_after(metrics, 2)   # the crash run starts at 2 and logs 3 and 4 again
    dist.barrier()


def _crash_then_resume(kind: str, stage: str, root: Path, ref: Path, ref_metrics: Path) -> dict:
    directory, metrics = root / f"{kind}-{stage}", root / f"{kind}-{stage}.jsonl"
    _set_up(kind, ref, ref_metrics, directory, metrics)
    crashing = _trainer(directory, metrics, load=directory / iteration_dir_name(2))
    original, checkpoint_save._reached = checkpoint_save._reached, _crash_after(stage)
    try:
        crashing.train()
        error = None
    except CheckpointError as err:
        error = str(err)
    finally:
        checkpoint_save._reached = original
    on_disk = sorted(p.name for p in directory.iterdir())
    note = find_checkpoint(directory)[1]
    resumed = _trainer(directory, metrics, load=directory)
    start = resumed.iteration
    losses = [r["loss"] for r in resumed.train()]
    return {"error": error, "on_disk_after_crash": on_disk, "note": note, "start": start,
            "losses": losses, "weights": resumed.full_state(),
            "on_disk_at_end": sorted(p.name for p in directory.iterdir()),
            "metrics": [(r["iter"], r["loss"]) for r in read_metrics(metrics)]}


def crash_job(root: str) -> dict:
    root = Path(root)
    ref, ref_metrics = root / "ref", root / "ref.jsonl"
    reference = _trainer(ref, ref_metrics)
    out = {"ref_losses": [r["loss"] for r in reference.train()],
           "ref_weights": reference.full_state()}
    for kind, stage in CASES:
        out[kind, stage] = _crash_then_resume(kind, stage, root, ref, ref_metrics)
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_on_ranks(2, crash_job, str(tmp_path_factory.mktemp("crash")),
                        timeout_s=within(280))[0]


# --------------------------------------------------------------------------------------------
# Crashes at every step
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,stage", CASES)
def test_a_crashed_save_resumes_exactly(job, kind, stage):
    run = job[kind, stage]
    assert run["error"] and f"simulated crash after {stage}" in run["error"]
    # Before the new iter_4 is published, latest still names the previous checkpoint (iter_2
    # for a fresh save, the old iter_4 for a re-save); after, the new one.
    assert run["start"] == (2 if kind == "fresh" else CRASHED_SAVE)
    want = job["ref_losses"][run["start"]:]
    assert len(run["losses"]) == len(want)
    for got, ref in zip(run["losses"], want):
        assert abs(got - ref) <= 1e-6, (run["losses"], want)
    for name, ref in job["ref_weights"].items():
        assert torch.equal(run["weights"][name], ref), name


@pytest.mark.parametrize("kind,stage", CASES)
def test_metrics_hold_each_iteration_once_after_a_resume(job, kind, stage):
    records = job[kind, stage]["metrics"]
    assert [it for it, _ in records] == list(range(1, ITERS + 1))
    for (_, got), want in zip(records, job["ref_losses"]):
        assert abs(got - want) <= 1e-6


@pytest.mark.parametrize("kind,stage", CASES)
def test_the_next_save_sweeps_what_the_crash_left(job, kind, stage):
    run = job[kind, stage]
    assert run["on_disk_at_end"] == ["iter_0000002", "iter_0000004", "iter_0000006", "latest"]


def test_latest_naming_nothing_falls_back_with_a_note(job):
    """Between the last rename of a re-save and the switch of `latest`, `latest` names the
    side copy that was just renamed: the loader takes the newest complete checkpoint."""
    run = job["resave", "renamed_back"]
    assert "iter_0000004.new" not in run["on_disk_after_crash"]
    assert run["note"] is not None
    assert "names 'iter_0000004.new'" in run["note"] and run["note"].endswith("iter_0000004")


def test_a_crash_mid_resave_keeps_a_complete_copy_under_latest(job):
    """The old copy goes only after latest names the new one."""
    for stage in ("side_renamed", "latest_to_side", "old_moved", "old_removed"):
        run = job["resave", stage]
        assert run["note"] is None, stage  # latest named a complete checkpoint
        assert "iter_0000004.new" in run["on_disk_after_crash"], stage


# --------------------------------------------------------------------------------------------
# Without processes: the sweep and the fallback on hand-made folders
# --------------------------------------------------------------------------------------------

def _fake_checkpoint(directory: Path) -> None:
    directory.mkdir()
    (directory / "model.pt").write_bytes(b"x")
    (directory / "metadata.json").write_text(
        '{"format_version": %d, "files": ["model.pt"]}' % checkpoint_save.FORMAT_VERSION)


def test_prepare_removes_stale_temporaries_but_keeps_what_latest_names(tmp_path):
    _fake_checkpoint(tmp_path / "iter_0000002")
    (tmp_path / "iter_0000004.tmp").mkdir()               # a save that died half-way
    (tmp_path / "iter_0000002.old.tmp").mkdir()           # an old copy being deleted
    (tmp_path / "latest.tmp").write_text("iter_0000002\n")
    _fake_checkpoint(tmp_path / "iter_0000001.new")        # a re-save latest never named
    (tmp_path / "latest").write_text("iter_0000002\n")
    checkpoint_save._prepare(tmp_path, tmp_path / "iter_0000006.tmp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000006.tmp",
                                                          "latest"]


def test_prepare_finishes_a_resave_that_latest_names(tmp_path):
    _fake_checkpoint(tmp_path / "iter_0000004")
    _fake_checkpoint(tmp_path / "iter_0000004.new")
    (tmp_path / "iter_0000004.new" / "model.pt").write_bytes(b"new")
    (tmp_path / "latest").write_text("iter_0000004.new\n")
    checkpoint_save._prepare(tmp_path, tmp_path / "iter_0000006.tmp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", "iter_0000006.tmp",
                                                          "latest"]
    assert (tmp_path / "iter_0000004" / "model.pt").read_bytes() == b"new"
    assert resolve_checkpoint(tmp_path) == tmp_path / "iter_0000004"


def test_fallback_takes_the_newest_complete_checkpoint(tmp_path):
    _fake_checkpoint(tmp_path / "iter_0000002")
    _fake_checkpoint(tmp_path / "iter_0000004")
    (tmp_path / "iter_0000004" / "model.pt").unlink()      # incomplete: skipped
    (tmp_path / "iter_0000006.tmp").mkdir()                # never loaded
    directory, note = find_checkpoint(tmp_path)            # no `latest` at all
    assert directory == tmp_path / "iter_0000002"
    assert note.startswith("no 'latest' file") and "iter_0000002" in note
    (tmp_path / "latest").write_text("iter_0000004\n")     # names an incomplete directory
    directory, note = find_checkpoint(tmp_path)
    assert directory == tmp_path / "iter_0000002" and "names 'iter_0000004'" in note
    (tmp_path / "latest").write_text("iter_0000002\n")
    assert find_checkpoint(tmp_path) == (tmp_path / "iter_0000002", None)
