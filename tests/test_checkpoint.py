"""Checkpoints: exact resume, resharding to other layouts, atomic layout on disk, errors.

Process start-up dominates on 2 cores, so all multi-rank work happens in two spawned jobs
(world 4, then world 1) that run several Trainers one after another; the tests below only
look at what those jobs returned and wrote.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ptdp.checkpoint.layout import (CheckpointError, check_model_config, read_metadata,
                                    resolve_checkpoint)
from ptdp.checkpoint.reshard import ShardReader
from ptdp.config import ModelConfig
from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import RTOL, TINY, relative_error

P2_T2 = ["parallel.pipeline=2", "parallel.tensor=2"]
# Layouts of 4 ranks that load the (p=2, t=2) checkpoint: (p, t, d, v) all differ somewhere.
RESHARD_LAYOUTS = {
    "p1-t4-d1": ["parallel.tensor=4"],
    "p4-t1-d1": ["parallel.pipeline=4"],
    "p1-t2-d2": ["parallel.tensor=2", "parallel.data=2"],
    "p2-t1-d2-v2": ["parallel.pipeline=2", "parallel.data=2", "parallel.chunks=2",
                    "schedule.name=interleaved"],
}
SAVED_BY_D2 = "p1-t2-d2"   # this reshard run also saves (checks that only data rank 0 writes)


# --------------------------------------------------------------------------------------------
# The spawned jobs
# --------------------------------------------------------------------------------------------

def _trainer(overrides: list[str]):
    from ptdp.config import load_config
    from ptdp.training import Trainer
    return Trainer(load_config(None, TINY + overrides, world_size=dist.get_world_size()))


def _losses(trainer) -> list[float]:
    return [record["loss"] for record in trainer.train()]


def _ckpt(directory: Path, load: Path | None = None) -> list[str]:
    out = [f"checkpoint.dir={directory}", "checkpoint.save_interval=2"]
    return out + ([f"checkpoint.load={load}"] if load else [])


def _load_error(overrides: list[str]) -> str | None:
    """The CheckpointError a Trainer raises while loading, as text (None if none)."""
    from ptdp.checkpoint.layout import CheckpointError
    try:
        _trainer(overrides)
    except CheckpointError as err:
        return str(err)
    return None


def _corrupt_copy(source: Path, target: Path, victim: str) -> None:
    """Rank 0 copies a checkpoint and overwrites one shard file with garbage."""
    if dist.get_rank() == 0:
        shutil.copytree(source, target)
        (target / victim).write_bytes(b"not a torch file")
    dist.barrier()


def world4_job(root: str) -> dict:
    root, out = Path(root), {}
    gpt4 = P2_T2 + ["train.iters=4"]
    # Resume exactness with dropout on: needs model, optimizer, RNG and data position.
    dropout = gpt4 + ["model.dropout=0.1"]
    first = _trainer(dropout + _ckpt(root / "dropout"))
    out["dropout_full"] = _losses(first)
    out["dropout_full_weights"] = first.full_state()
    # A NEW trainer resumes at 2 and re-saves iteration 4 into the same directory.
    resumed = _trainer(dropout + _ckpt(root / "dropout", root / "dropout" / "iter_0000002"))
    out["dropout_resumed_start"] = resumed.iteration
    out["dropout_resumed"] = _losses(resumed)
    out["dropout_resumed_weights"] = resumed.full_state()

    # The reference for resharding (dropout 0: masks are layout-specific).
    ref = _trainer(gpt4 + _ckpt(root / "ref"))
    out["ref"] = _losses(ref)
    out["ref_weights"] = ref.full_state()
    for name, layout in RESHARD_LAYOUTS.items():
        save = _ckpt(root / name) if name == SAVED_BY_D2 else []
        trainer = _trainer(layout + ["train.iters=4", f"checkpoint.load={root}/ref/iter_0000002"]
                           + save)
        out[f"reshard {name}"] = _losses(trainer)

    # BERT: vocab-padded LM bias and token types go through the same path.
    bert = _trainer(P2_T2 + ["model.arch=bert", "train.iters=2"] + _ckpt(root / "bert"))
    bert.train()
    out["bert_weights"] = bert.full_state()

    # A rank-specific read failure must fail every rank (no rank left waiting).
    _corrupt_copy(root / "ref" / "iter_0000002", root / "corrupt" / "iter_0000002",
                  "model_pp001_tp001.pt")
    out["corrupt_error"] = _load_error(gpt4 + [f"checkpoint.load={root}/corrupt/iter_0000002"])
    out["model_error"] = _load_error(gpt4 + ["model.ffn_hidden_size=64",
                                             f"checkpoint.load={root}/ref"])
    return out if dist.get_rank() == 0 else {"corrupt_error": out["corrupt_error"],
                                              "model_error": out["model_error"]}


def world1_job(root: str) -> dict:
    root, out = Path(root), {}
    single = _trainer([f"checkpoint.load={root}/ref/iter_0000002", "train.iters=4"])
    out["reshard p1-t1-d1"] = _losses(single)
    # Following `latest` (iteration 4) of a (2, 2) and of a (1, 2, 2) checkpoint.
    for name in ("ref", SAVED_BY_D2):
        trainer = _trainer([f"checkpoint.load={root}/{name}", "train.iters=4"])
        out[f"{name} iteration"] = trainer.iteration
        out[f"{name} weights"] = trainer.full_state()
    bert = _trainer(["model.arch=bert", "train.iters=2", f"checkpoint.load={root}/bert"])
    out["bert_weights"] = bert.full_state()
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    world4 = run_on_ranks(4, world4_job, str(root), timeout_s=within(280))
    world1 = run_on_ranks(1, world1_job, str(root), timeout_s=within(120))[0]
    return root, world4, world1


# --------------------------------------------------------------------------------------------
# Resume and reshard
# --------------------------------------------------------------------------------------------

def test_resume_continues_the_loss_sequence_exactly(jobs):
    _, world4, _ = jobs
    out = world4[0]
    assert out["dropout_resumed_start"] == 2
    assert len(out["dropout_full"]) == 4
    for got, want in zip(out["dropout_resumed"], out["dropout_full"][2:], strict=True):
        assert abs(got - want) <= 1e-6, (out["dropout_resumed"], out["dropout_full"])
    for name, want in out["dropout_full_weights"].items():
        assert torch.equal(out["dropout_resumed_weights"][name], want), name


@pytest.mark.parametrize("layout", [*RESHARD_LAYOUTS, "p1-t1-d1"])
def test_reshard_on_load_continues_the_uninterrupted_losses(jobs, layout):
    _, world4, world1 = jobs
    got = (world1 if layout == "p1-t1-d1" else world4[0])[f"reshard {layout}"]
    want = world4[0]["ref"][2:]
    assert len(got) == len(want) == 2
    for x, y in zip(got, want):
        assert abs(x - y) <= RTOL * abs(y), f"{layout}: {got} vs {want}"


@pytest.mark.parametrize("name", ["ref", SAVED_BY_D2])
def test_resharded_weights_match_the_saved_model(jobs, name):
    """(2, 2) and (1, 2, 2) checkpoints rebuilt in one process: the weights the savers had."""
    _, world4, world1 = jobs
    assert world1[f"{name} iteration"] == 4
    want = world4[0]["ref_weights"]
    got = world1[f"{name} weights"]
    assert got.keys() == want.keys()
    for key in want:
        if name == "ref":  # same numbers, only re-cut: bit-exact
            assert torch.equal(got[key], want[key]), key
        else:              # trained in another layout from iteration 2
            assert relative_error(got[key], want[key]) <= RTOL, key


def test_bert_checkpoint_reshards_exactly(jobs):
    _, world4, world1 = jobs
    want, got = world4[0]["bert_weights"], world1["bert_weights"]
    assert got.keys() == want.keys() and "lm_bias" in " ".join(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


# --------------------------------------------------------------------------------------------
# On-disk layout and atomicity
# --------------------------------------------------------------------------------------------

def test_layout_on_disk(jobs):
    root, _, _ = jobs
    ref = root / "ref"
    assert sorted(p.name for p in ref.iterdir()) == ["iter_0000002", "iter_0000004", "latest"]
    assert (ref / "latest").read_text().strip() == "iter_0000004"
    meta = json.loads((ref / "iter_0000004" / "metadata.json").read_text())
    assert meta["iteration"] == 4
    assert meta["layout"] == {"pipeline": 2, "tensor": 2, "data": 1, "chunks": 1}
    assert meta["model"]["hidden_size"] == 32 and meta["train"]["seed"] == 7
    word = meta["params"]["embedding.word.weight"]
    assert word == {"shape": [100, 32], "tp_split_dim": 0, "vocab_padded": True,
                    "pipeline_rank": 0}
    assert meta["params"]["layers.7.mlp.fc2.weight"]["pipeline_rank"] == 1
    assert sorted(p.name for p in (ref / "iter_0000004").iterdir()) == sorted(
        meta["files"] + ["metadata.json"])


def test_only_data_rank_zero_writes_model_shards(jobs):
    root, _, _ = jobs
    files = sorted(p.name for p in (root / SAVED_BY_D2 / "iter_0000004").iterdir())
    assert files == ["config.yaml", "metadata.json", "model_pp000_tp000.pt", "model_pp000_tp001.pt",
                     "rng_rank00000.pt", "rng_rank00001.pt", "rng_rank00002.pt",
                     "rng_rank00003.pt"]


def test_resaving_an_iteration_replaces_it_and_leaves_no_temporaries(jobs):
    root, _, _ = jobs
    names = sorted(p.name for p in (root / "dropout").iterdir())
    assert names == ["iter_0000002", "iter_0000004", "latest"]


def test_tmp_directories_are_never_loaded(jobs, tmp_path):
    root, _, _ = jobs
    copy = tmp_path / "ckpt"
    shutil.copytree(root / "ref", copy)
    # A save of iteration 6 that crashed after writing everything but before the rename.
    shutil.copytree(copy / "iter_0000004", copy / "iter_0000006.tmp")
    assert resolve_checkpoint(copy) == copy / "iter_0000004"
    with pytest.raises(CheckpointError, match=r"iter_0000006\.tmp is an incomplete checkpoint"):
        resolve_checkpoint(copy / "iter_0000006.tmp")
    assert resolve_checkpoint(copy / "iter_0000002") == copy / "iter_0000002"


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

def test_missing_directory_and_missing_latest(tmp_path):
    with pytest.raises(CheckpointError, match=r"nowhere does not exist"):
        resolve_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"no 'latest' file"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "iter_0000003").mkdir()
    with pytest.raises(CheckpointError, match=r"iter_0000003 is an incomplete checkpoint"):
        resolve_checkpoint(tmp_path / "iter_0000003")
    (tmp_path / "latest").write_text("iter_0000003\n")
    with pytest.raises(CheckpointError, match=r"names 'iter_0000003'.*missing or incomplete"):
        resolve_checkpoint(tmp_path)


def test_missing_shard_file_is_incomplete(jobs, tmp_path):
    root, _, _ = jobs
    copy = tmp_path / "iter_0000002"
    shutil.copytree(root / "ref" / "iter_0000002", copy)
    (copy / "model_pp001_tp000.pt").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint: missing model_pp001_tp000"):
        read_metadata(copy)


def test_shape_and_name_mismatches_name_the_parameter(jobs, tmp_path):
    root, _, _ = jobs
    directory = root / "ref" / "iter_0000002"
    meta = read_metadata(directory)
    meta["params"]["layers.0.mlp.fc1.weight"]["shape"] = [64, 32]
    reader = ShardReader(directory, meta)
    with pytest.raises(CheckpointError, match=r"'layers\.0\.mlp\.fc1\.weight' rebuilds to shape "
                                              r"\[128, 32\], metadata says \[64, 32\]"):
        reader.full("layers.0.mlp.fc1.weight")
    with pytest.raises(CheckpointError, match=r"has no parameter 'layers\.9\.mlp\.fc1\.weight'"):
        reader.full("layers.9.mlp.fc1.weight")


def test_model_mismatch_names_the_key(jobs):
    root, world4, _ = jobs
    directory = root / "ref" / "iter_0000002"
    meta = read_metadata(directory)
    model = ModelConfig(**{**meta["model"], "num_heads": 2, "dropout": 0.3})
    with pytest.raises(CheckpointError, match=r"model\.num_heads=4 in the checkpoint but 2") as err:
        check_model_config(meta, model, directory)
    assert "dropout" not in str(err.value)  # dropout may change on resume
    for rank in world4:  # through the Trainer: every rank raises
        assert "model.ffn_hidden_size=128 in the checkpoint but 64" in rank["model_error"]


def test_unreadable_shard_fails_every_rank(jobs):
    _, world4, _ = jobs
    for rank in world4:
        message = rank["corrupt_error"]
        assert message is not None
        assert "failed on rank 2 (and on 1 more rank(s))" in message
        assert "model_pp001_tp001.pt" in message
