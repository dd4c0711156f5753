"""Disks that fill: a save that meets a full disk ends the job with one line naming the folder
and the space a save needs (estimated from the last one), exit 5, which the restart loop does
not retry; start-up sweeps what dead jobs left before it writes; `checkpoint.keep_last` and
`checkpoint.keep_every` bound what a run keeps, never deleting the checkpoint it resumed from
or the newest.

The full disk is injected at an exact point: rank 1's first file of the save of iteration 4
raises OSError(ENOSPC), as a write to a full device does.
"""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from ptdp.checkpoint.layout import iteration_dir_name
from ptdp.checkpoint.retention import prune, protect, sweep_leftovers
from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import TINY
from tests.test_restart import FAKE_TORCHRUN
from tools.jobs import ROOT, SCRIPT, env as _env

JOB = TINY + ["parallel.pipeline=2", "checkpoint.save_interval=2", "log.progress=false"]


def _trainer(overrides: list[str]):
    from ptdp.config import load_config
    from ptdp.training import Trainer
    return Trainer(load_config(None, JOB + overrides, world_size=dist.get_world_size()))


def _fill_the_disk_at_iteration_4(directory: str) -> dict:
    from ptdp.checkpoint import save as checkpoint_save
    from ptdp.checkpoint.integrity import DiskFull
    write = checkpoint_save.save_durably

    def full(obj, path):
        if dist.get_rank() == 1 and path.parent.name == iteration_dir_name(4) + ".tmp":
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(obj, path)
    checkpoint_save.save_durably = full
    try:
        _trainer([f"checkpoint.dir={directory}", "train.iters=6"]).train()
    except DiskFull as err:
        return {"error": str(err), "left": sorted(p.name for p in Path(directory).iterdir())}
    return {"error": None}


def test_a_full_disk_ends_the_job_with_one_line(tmp_path):
    directory = tmp_path / "ck"
    ranks = run_on_ranks(2, _fill_the_disk_at_iteration_4, str(directory),
                         timeout_s=within(300))
    assert ranks[0]["left"] == [iteration_dir_name(2), "latest"]   # rank 0 removed the .tmp
    for rank in ranks:
        line = rank["error"]
        assert line is not None and "\n" not in line
        assert line.startswith(f"no space left on the device of checkpoint.dir {directory} "
                               f"while writing {iteration_dir_name(4)}.tmp: ")
        assert "a checkpoint needs about" in line and f"the last one, {iteration_dir_name(2)}" in line


def test_a_full_disk_is_exit_5_and_not_retried(tmp_path):
    from ptdp.checkpoint.integrity import DiskFull
    from ptdp.commands.train import _final_exits
    assert _final_exits()[DiskFull] == 5
    fake, log = tmp_path / "fake_torchrun.py", tmp_path / "attempts.log"
    fake.write_text(FAKE_TORCHRUN)
    result = subprocess.run(
        ["bash", str(SCRIPT), str(ROOT / "configs/gpt_tiny.yaml"), "train.iters=2"],
        env=_env(MAX_RESTARTS="3", TORCHRUN=f"{sys.executable} {fake}", PLAN="5",
                 LOG=str(log), NPROC="2"),
        cwd=tmp_path, capture_output=True, text=True, timeout=within(120))
    assert result.returncode == 5
    assert len(log.read_text().splitlines()) == 1
    assert "a full disk (exit 5): not restarting" in result.stderr


def test_start_up_sweeps_what_dead_jobs_left(tmp_path):
    (tmp_path / "iter_0000004.tmp").mkdir()
    (tmp_path / "iter_0000004.tmp" / "model_pp000_tp000.pt").write_bytes(b"x" * 100)
    (tmp_path / ".ptdp-shared-0123abcd").write_text("x")
    (tmp_path / "latest.tmp").write_text("iter_0000002\n")
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "latest").write_text("iter_0000002\n")
    sweep_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "latest"]


def _fake_checkpoints(root: Path, iterations) -> None:
    for it in iterations:
        directory = root / iteration_dir_name(it)
        directory.mkdir()
        (directory / "a.pt").write_bytes(b"x")
        (directory / "metadata.json").write_text('{"format_version": 1, "files": ["a.pt"]}')
    (root / "latest").write_text(iteration_dir_name(max(iterations)) + "\n")


def test_keep_last_and_keep_every(tmp_path):
    _fake_checkpoints(tmp_path, range(1, 11))
    protect(tmp_path / iteration_dir_name(3))    # the checkpoint this job resumed from
    deleted = prune(tmp_path, keep_last=2, keep_every=4)
    assert [p.name for p in deleted] == [iteration_dir_name(i) for i in (1, 2, 5, 6, 7)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [iteration_dir_name(i) for i in (3, 4, 8, 9, 10)] + ["latest"])
    assert prune(tmp_path, keep_last=0, keep_every=0) == []    # 0 keeps every one


def _keep_two(directory: str) -> list[str]:
    _trainer([f"checkpoint.dir={directory}", "train.iters=10", "checkpoint.keep_last=2"]).train()
    return sorted(p.name for p in Path(directory).iterdir())


def test_a_run_keeps_its_newest_checkpoints(tmp_path):
    kept = run_on_ranks(2, _keep_two, str(tmp_path / "ck"), timeout_s=within(300))[0]
    assert kept == [iteration_dir_name(8), iteration_dir_name(10), "latest"]


@pytest.mark.parametrize("overrides, line", [
    (["checkpoint.keep_last=-1"], "checkpoint.keep_last must be >= 0, got -1"),
    (["checkpoint.keep_every=10"], "checkpoint.keep_every keeps some of the checkpoints"),
])
def test_retention_keys_are_checked(overrides, line):
    from ptdp.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=line):
        load_config(None, overrides)
