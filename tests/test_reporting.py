"""What a run tells its user: the start-up lines, one line per checkpoint, the end summary with
the resume command, the LR-stretch warning, units; and `ptdp plot`, `--version`, `--help`."""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

import pytest

from ptdp.checkpoint.load import schedule_change_warning
from ptdp.config import load_config
from ptdp.runtime.local_ranks import run_on_ranks
from ptdp.metrics.report import end_summary, format_bytes, startup_report
from ptdp.metrics.log import format_tflops
from tests.deadline import within
from tests.optional import needs

TINY = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.seq_length=16",
        "model.vocab_size=100", "train.micro_batch_size=2", "train.global_batch_size=8",
        "log.progress=false", "train.timeout_s=60"]


def test_startup_report_is_short_and_names_every_rank_role():
    cfg = load_config(None, TINY + ["parallel.pipeline=2", "parallel.tensor=2",
                                    "log.metrics_file=runs/a/metrics.jsonl",
                                    "checkpoint.dir=runs/a/ck"], world_size=8)
    grid = SimpleNamespace(p=2, t=2, d=2)
    text = startup_report(cfg, grid, 1000, 40_000)
    lines = text.splitlines()
    assert len(lines) == 2 + 8 + 3 and "model:" not in text      # no config dump
    assert lines[2] == ("  rank 0: pipeline stage 0 (layers 0-0 + embedding), tensor shard 1/2, "
                        "data replica 1/2")
    assert lines[9] == ("  rank 7: pipeline stage 1 (layers 1-1 + head and loss), tensor shard "
                        "2/2, data replica 2/2")
    assert "runs/a/metrics.config.yaml" in text and "checkpoints runs/a/ck (at the end)" in text
    cfg.log.verbose = True
    assert "ptdp: resolved config" in startup_report(cfg, grid, 1000, 40_000)


def test_units():
    assert format_tflops(0.000123456) == "0.000123" and format_tflops(151.2) == "151"
    assert format_bytes(3 * 2**20 // 2) == "1.50 MiB" and format_bytes(512) == "512 B"


def test_end_summary():
    cfg = load_config(None, TINY + ["train.iters=4"], world_size=1)
    rec = lambda i, **kw: {"iter": i, "loss": 5.0 - i, "step_time_s": 0.5, "tflops_per_gpu": 0.002,  # noqa: E731
                           "mem_gb": 0.25 * i, **kw}
    history = [rec(3, valid_loss=2.5), rec(4, valid_loss=2.75)]
    import torch
    text = end_summary(history, cfg, 1.25, torch.device("cpu"), "ck/iter_0000004", "CMD")
    assert "iterations 3-4 (2) in 1.2 s, 256 tokens" in text
    assert "final train 1.0000, final validation 2.7500 (iteration 4), best validation 2.5000 " \
           "(iteration 3)" in text
    assert "256 tokens/s, 0.002 TFLOP/s per rank" in text and "1.00 GiB" in text
    assert "last checkpoint: ck/iter_0000004" in text and text.endswith("CMD")


def test_lr_stretch_warning_names_the_key():
    meta = {"iteration": 150, "train": {"iters": 150, "lr_decay_iters": None}}
    cfg = load_config(None, TINY + ["train.iters=300"], world_size=1)
    warning = schedule_change_warning(meta, cfg.train)
    assert "train.iters went from 150 to 300" in warning and "train.lr_decay_iters=150" in warning
    pinned = load_config(None, TINY + ["train.iters=300", "train.lr_decay_iters=150"], world_size=1)
    assert schedule_change_warning(meta, pinned.train) is None
    same = load_config(None, TINY + ["train.iters=150"], world_size=1)
    assert schedule_change_warning(meta, same.train) is None


def _run_and_resume(root: str) -> dict:
    from ptdp.training import Trainer
    out = {}
    for name, extra in (("first", ["train.iters=2"]), ("resumed", ["train.iters=3", f"checkpoint.load={root}/ck"])):
        cfg = load_config(None, TINY + extra + [f"checkpoint.dir={root}/ck",
                                               f"log.metrics_file={root}/metrics.jsonl",
                                               "train.eval_interval=1"], world_size=1)
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            Trainer(cfg).train(resume_command=f"RESUME {name}")
        out[name] = buffer.getvalue()
    return out


def test_a_run_reports_saves_summary_and_stretch(tmp_path):
    out = run_on_ranks(1, _run_and_resume, str(tmp_path), timeout_s=within(120))[0]
    first, resumed = out["first"], out["resumed"]
    assert len(first.splitlines()) < 16, first
    assert f"saved checkpoint {tmp_path}/ck/iter_0000002 (" in first and "KiB" in first
    assert "ptdp: done: iterations 1-2 (2)" in first and "best validation" in first
    assert f"last checkpoint: {tmp_path}/ck/iter_0000002" in first and "RESUME first" in first
    assert "TFLOP/s per rank" in first and "GiB" in first and "TFLOP/s/GPU" not in first
    assert "warning: train.iters went from 2 to 3" in resumed and "lr_decay_iters=2" in resumed
    assert "ptdp: done: iterations 3-3 (1)" in resumed
    config = (tmp_path / "metrics.config.yaml").read_text()
    assert "\n  iters: 3\n" in config and "verbose: false" in config
    assert "\n  iters: 2\n" in (tmp_path / "ck" / "iter_0000002" / "config.yaml").read_text()


def test_resume_command_swaps_checkpoint_load(monkeypatch):
    from ptdp.commands.train import resume_command
    monkeypatch.delenv("PTDP_RESUME_PREFIX", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = load_config(None, TINY + ["checkpoint.dir=runs/x"], world_size=1)
    args = SimpleNamespace(config="c.yaml", overrides=["train.iters=5", "checkpoint.load=old"])
    assert resume_command(args, cfg) == ("torchrun --nproc-per-node 8 -m ptdp train c.yaml "
                                         "train.iters=5 checkpoint.load=runs/x")
    monkeypatch.setenv("PTDP_RESUME_PREFIX", "NPROC=8 bash tools/pretrain_gpt.sh")
    assert resume_command(args, cfg).startswith("NPROC=8 bash tools/pretrain_gpt.sh c.yaml ")


def test_plot_draws_several_runs(tmp_path, capsys):
    needs("matplotlib")
    from ptdp.cli import main
    paths = []
    for run in ("a", "b"):
        path = tmp_path / run / "metrics.jsonl"
        path.parent.mkdir()
        path.write_text("".join(json.dumps({"iter": i, "loss": 5 - i / 10, "lr": 1e-3,
                                            "tokens_per_s": 100.0, "loss_scale": 1.0,
                                            **({"valid_loss": 4.9} if i % 2 == 0 else {})}) + "\n"
                                for i in range(1, 6)))
        paths.append(str(path))
    out = tmp_path / "curves.png"
    assert main(["plot", *paths, "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such metrics file" in capsys.readouterr().err


def test_version_and_every_help_shows_defaults(capsys):
    from ptdp import __version__
    from ptdp.cli import build_parser, main
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"ptdp {__version__}"
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub in subparsers.choices.items():
        text = sub.format_help()
        for action in sub._actions:
            shown = action.default not in (None, False, "==SUPPRESS==") and action.option_strings
            if shown and action.dest != "help":
                assert f"default: {action.default}" in " ".join(text.split()), (name, action.dest)


def test_plot_adds_the_expert_load_and_aux_losses_for_a_mixture_of_experts(tmp_path):
    needs("matplotlib")
    from ptdp.metrics.plot import MOE_PANELS, PANELS, _series, panels_for, plot_metrics
    dense = [{"iter": i, "loss": 5.0, "lr": 1e-3} for i in (1, 2)]
    moe = [{**r, "moe/load_max_over_mean": 1.5 - r["iter"] / 10, "aux/moe_aux_loss": 0.01,
            "aux/moe_z_loss": 0.002} for r in dense]
    assert panels_for([dense]) == PANELS
    assert panels_for([dense, moe]) == PANELS + MOE_PANELS
    assert _series(moe, "aux/") == {" moe_aux_loss": [0.01, 0.01], " moe_z_loss": [0.002, 0.002]}
    assert _series(dense, "aux/") == {}
    path = tmp_path / "moe.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in moe))
    out = plot_metrics([path], tmp_path / "moe.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
