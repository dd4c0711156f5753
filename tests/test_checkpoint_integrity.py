"""Checkpoints prove themselves (ptdp/checkpoint/integrity.py): every file's size and CRC-32 and
the metadata's own CRC are recorded at the save and checked at the load and by `ptdp check`.

A 2-rank job (p = 2, dropout on) saves at iterations 2 and 4; the newest checkpoint is then
damaged four ways (low bits flipped in a shard, a rank file overwritten with random bytes, a
shard truncated, metadata.json rewritten as valid JSON with another iteration). Each time
`checkpoint.load=auto` skips it with one line and resumes from iteration 2 with exactly the
uninterrupted run's losses; a checkpoint named as such is refused; `ptdp check` says the same
before any rank starts. Before checksums, the flips and the metadata loaded silently (other
losses), random bytes failed only later, the truncated shard stopped the job.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from ptdp.checkpoint.integrity import (DamagedCheckpoint, file_checksum, is_disk_full,
                                       save_durably, seal, verify_metadata)
from ptdp.checkpoint.layout import iteration_dir_name
from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import TINY

JOB = TINY + ["parallel.pipeline=2", "model.dropout=0.1", "train.iters=4",
              "checkpoint.save_interval=2", "log.progress=false"]
DAMAGES = ["flipped bits", "random bytes", "truncated shard", "edited metadata"]


def _trainer(overrides: list[str]):
    from ptdp.config import load_config
    from ptdp.training import Trainer
    return Trainer(load_config(None, JOB + overrides, world_size=dist.get_world_size()))


def _reference(root: str) -> list[float]:
    return [r["loss"] for r in _trainer([f"checkpoint.dir={root}"]).train()]


def _resume_each(root: str) -> dict:
    out = {}
    for kind in DAMAGES:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            trainer = _trainer([f"checkpoint.dir={Path(root) / kind}", "checkpoint.load=auto"])
            losses = [r["loss"] for r in trainer.train()]
        out[kind] = {"losses": losses, "printed": printed.getvalue()}
    try:   # the damaged checkpoint named as such: refused on every rank
        _trainer([f"checkpoint.load={Path(root) / 'named' / iteration_dir_name(4)}"])
        out["named"] = None
    except Exception as err:  # noqa: BLE001 - the message is what the test reads
        out["named"] = str(err)
    return out


def _damage(directory: Path, kind: str) -> None:
    if kind == "flipped bits":    # 64 low bits in the second half (the tensors' bytes)
        path = directory / "model_pp000_tp000.pt"
        data = bytearray(path.read_bytes())
        for i in range(64):
            data[len(data) // 2 + 37 * i] ^= 1
        path.write_bytes(bytes(data))
    elif kind == "random bytes":
        path = directory / "rng_rank00001.pt"
        path.write_bytes(os.urandom(path.stat().st_size))
    elif kind == "truncated shard":
        path = directory / "model_pp001_tp000.pt"
        os.truncate(path, path.stat().st_size // 2)
    else:   # valid JSON, well-formed, but not what the save wrote
        path = directory / "metadata.json"
        meta = json.loads(path.read_text())
        meta["iteration"] = 3
        path.write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    reference = run_on_ranks(2, _reference, str(root / "ref"), timeout_s=within(300))[0]
    for kind in DAMAGES:   # one copy for the resumed runs (which save iteration 4 again),
        for copy in (kind, f"check {kind}"):   # one for `ptdp check`
            shutil.copytree(root / "ref", root / copy)
            _damage(root / copy / iteration_dir_name(4), kind)
    shutil.copytree(root / "ref", root / "named")
    _damage(root / "named" / iteration_dir_name(4), DAMAGES[0])
    return root, reference, run_on_ranks(2, _resume_each, str(root), timeout_s=within(300))[0]


@pytest.mark.parametrize("kind", DAMAGES)
def test_a_damaged_checkpoint_is_skipped_and_the_run_continues_exactly(damaged, kind):
    root, reference, resumed = damaged
    run = resumed[kind]
    assert run["losses"] == reference[2:]      # resumed from iteration 2, bit-identical
    skipped = [line for line in run["printed"].splitlines() if "skipping" in line]
    assert skipped == [line for line in skipped if str(root / kind / iteration_dir_name(4)) in line]
    assert len(skipped) == 1 and "verifying checkpoint" in skipped[0]


def test_a_damaged_checkpoint_named_as_such_is_refused(damaged):
    named = damaged[2]["named"]
    assert named is not None and "failed on rank 0" in named
    assert "model_pp000_tp000.pt: it fails its checksum" in named


@pytest.mark.parametrize("kind", DAMAGES)
def test_ptdp_check_verifies_checksums(damaged, kind):
    from ptdp.checks import check_job
    directory = damaged[0] / f"check {kind}"
    base = JOB + [f"checkpoint.dir={directory}"]
    named = check_job(None, base + [f"checkpoint.load={directory / iteration_dir_name(4)}"], 2)
    assert len(named.errors) == 1 and "checkpoint.load" in named.errors[0]
    auto = check_job(None, base + ["checkpoint.load=auto"], 2)
    assert auto.errors == []
    assert any("skipping" in note and iteration_dir_name(4) in note for note in auto.notes)


# --------------------------------------------------------------------------------------------
# Without processes
# --------------------------------------------------------------------------------------------

def test_save_durably_records_what_it_wrote(tmp_path):
    path = tmp_path / "x.pt"
    assert save_durably({"a": 1}, path) == file_checksum(path)


def test_a_full_disk_raises_no_space_not_torchs_position_error():
    with pytest.raises(OSError) as caught:
        save_durably({"a": list(range(100000))}, Path("/dev/full"))
    assert is_disk_full(caught.value)


def test_sealed_metadata_detects_any_edit(tmp_path):
    meta = seal({"iteration": 4, "layout": {}, "model": {}, "params": {}, "files": ["a"]},
                {"a": [1, "00000000"]})
    verify_metadata(meta, tmp_path)
    for edit in ({"iteration": 5}, {"files": ["a", "b"]}, {"layout": {"tensor": 2}}):
        with pytest.raises(DamagedCheckpoint):
            verify_metadata({**meta, **edit}, tmp_path)
    unsealed = {key: value for key, value in meta.items() if key != "checksums"}
    verify_metadata(unsealed, tmp_path)   # older checkpoints carry no checksums
    with pytest.raises(DamagedCheckpoint, match="iteration"):
        verify_metadata({**unsealed, "iteration": "4"}, tmp_path)
