"""Writes the checkpoints of tests/test_checkpoint_v1.py: run once, with the code of commit
ca907fd (before the training state's parts were listed on TrainingState), and checked in.

    PYTHONPATH=. python tests/checkpoint_v1/make.py

For each layout of CASES (2 ranks, a tiny model, dropout on), a run of 4 iterations saves
after 2; only that checkpoint is kept, in tests/checkpoint_v1/<case>/iter_0000002, and
cases.json records the overrides, the whole run's losses and the losses of a run resumed
from it. Re-running it with later code would test nothing: the point is the old code's files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
ITERATIONS, SAVED = 4, 2
MODEL = ["model.num_layers=2", "model.hidden_size=8", "model.num_heads=2",
         "model.seq_length=8", "model.vocab_size=32", "model.dropout=0.1",
         "train.micro_batch_size=2", "train.global_batch_size=8", "train.lr=1e-2",
         "train.clip_grad=1.0", "train.timeout_s=60", "train.seed=7", "train.adam_eps=1e-3",
         "log.progress=false"]
CASES = {
    "1f1b-p2-fp16": ["parallel.pipeline=2", "train.precision=fp16"],
    "1f1b-d2-bf16": ["parallel.data=2", "train.precision=bf16"],
    "1f1b-d2-bf16-distopt": ["parallel.data=2", "train.precision=bf16",
                             "train.distributed_optimizer=true"],
    "1f1b-d2-fp32-distopt": ["parallel.data=2", "train.distributed_optimizer=true"],
    "2bw-p2-fp16": ["schedule.name=2bw", "parallel.pipeline=2", "train.precision=fp16"],
    "pipedream-p2": ["schedule.name=pipedream", "parallel.pipeline=2", "train.clip_grad=0"],
}


def _trainer(overrides: list[str]):
    import torch.distributed as dist
    from ptdp.config import load_config
    from ptdp.training import Trainer
    return Trainer(load_config(None, overrides, world_size=dist.get_world_size()))


def make_job(root: str) -> dict:
    out = {}
    for case, layout in CASES.items():
        base = MODEL + layout + [f"train.iters={ITERATIONS}"]
        directory = Path(root) / case
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            whole = _trainer(base + [f"checkpoint.dir={directory}",
                                     f"checkpoint.save_interval={SAVED}"]).train()
            resumed = _trainer(base + [f"checkpoint.load={directory}/iter_{SAVED:07d}"]).train()
        out[case] = {"overrides": MODEL + layout, "iters": ITERATIONS, "saved": SAVED,
                     "whole": [r["loss"] for r in whole],
                     "resumed": [r["loss"] for r in resumed]}
    return out


def main() -> None:
    import tempfile
    from ptdp.runtime.local_ranks import run_on_ranks
    with tempfile.TemporaryDirectory() as tmp:
        cases = run_on_ranks(2, make_job, tmp, timeout_s=600)[0]
        for case in CASES:
            target = HERE / case
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(Path(tmp) / case / f"iter_{SAVED:07d}", target / f"iter_{SAVED:07d}")
    (HERE / "cases.json").write_text(json.dumps(cases, indent=1) + "\n")


if __name__ == "__main__":
    main()
