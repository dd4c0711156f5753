"""Checkpoints written by older code still load: the files in tests/checkpoint_v1 were saved by
the code of commit ca907fd (tests/checkpoint_v1/make.py), for 1F1B with and without the
distributed optimizer, in fp32, bf16 and fp16, PipeDream-2BW (its shadow weights and fixed loss
scales) and PipeDream.

Each is loaded by today's code and (1) saved again at once: every file holds the same tensors
and the metadata the same entries, so the format is unchanged on disk; (2) resumed: the losses
are exactly those the old code's resumed run printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within

FIXTURES = Path(__file__).resolve().parent / "checkpoint_v1"
CASES = json.loads((FIXTURES / "cases.json").read_text())


def _resume_job(root: str) -> dict:
    from ptdp.checkpoint.save import save_checkpoint
    from ptdp.config import load_config
    from ptdp.training import Trainer
    out = {}
    for case, spec in CASES.items():
        saved = FIXTURES / case / f"iter_{spec['saved']:07d}"
        overrides = spec["overrides"] + [f"train.iters={spec['iters']}", f"checkpoint.load={saved}"]
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            trainer = Trainer(load_config(None, overrides, world_size=dist.get_world_size()))
            again = save_checkpoint(trainer.state, Path(root) / case)
            out[case] = {"again": str(again), "losses": [r["loss"] for r in trainer.train()]}
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("v1")
    return run_on_ranks(2, _resume_job, str(root), timeout_s=within(300))[0]


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            _same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _without_paths(meta: dict) -> dict:
    """The metadata less what names this run (the config's checkpoint paths, the save times)
    and the files' checksums, which the old code did not record."""
    meta = {key: value for key, value in meta.items() if key not in ("timing", "checksums")}
    meta["config"] = {key: value for key, value in meta["config"].items() if key != "checkpoint"}
    return meta


def _assert_same_config(old: dict, new: dict, only: str | None = None) -> None:
    """`new` keeps every key and value of `old`, and is `old` as today's code reads it: keys
    added since then hold the values they take for that config (their defaults). `only`:
    compare that section alone."""
    from ptdp.config import config_from_dict
    for section, values in old.items():
        assert {k: new[section].get(k) for k in values} == values, section
    today = _without_checkpoint(config_from_dict(old).to_dict())
    assert new == ({only: today[only]} if only else today)


def _without_checkpoint(cfg: dict) -> dict:
    return {section: values for section, values in cfg.items() if section != "checkpoint"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_of_the_old_code_is_saved_again_unchanged(resumed, case):
    old = FIXTURES / case / f"iter_{CASES[case]['saved']:07d}"
    new = Path(resumed[case]["again"])
    assert sorted(p.name for p in new.iterdir()) == sorted(p.name for p in old.iterdir())
    for path in sorted(old.glob("*.pt")):
        _same(torch.load(path, weights_only=True), torch.load(new / path.name, weights_only=True),
              path.name)
    old_meta, new_meta = (_without_paths(json.loads((d / "metadata.json").read_text()))
                          for d in (old, new))
    _assert_same_config(old_meta.pop("config"), new_meta.pop("config"))
    for section in ("model", "train"):   # (keys added since hold their defaults)
        _assert_same_config({section: old_meta.pop(section)}, {section: new_meta.pop(section)},
                            only=section)
    assert old_meta == new_meta
    old_cfg, new_cfg = (yaml.safe_load((d / "config.yaml").read_text()) for d in (old, new))
    _assert_same_config(_without_checkpoint(old_cfg), _without_checkpoint(new_cfg))


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_of_the_old_code_resumes_with_the_old_codes_losses(resumed, case):
    assert resumed[case]["losses"] == CASES[case]["resumed"]
