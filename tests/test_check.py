"""Bad jobs fail before anything starts: `ptdp check` and `ptdp train` print one line per
problem, naming the key or the file, exit with code 2, print no traceback and write nothing.

Most rows run in-process (`ptdp.cli.main`, output captured at the file-descriptor level, so
library messages would show too), through both `ptdp check` and `ptdp train` (with the
Trainer replaced by a stub that fails the test if it is ever built). One test runs a real
`ptdp train` under torchrun on 2 ranks.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from ptdp import checks, cli
from ptdp.config import load_config
from tests.data.tokenised import write_tokenised
from tests.background import end, finish, start
from tests.deadline import within
from tests.optional import needs

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512
BASE = """\
model: {{num_layers: 2, hidden_size: 32, num_heads: 4, seq_length: 16, vocab_size: {vocab}}}
train: {{micro_batch_size: 2, global_batch_size: 4, iters: 2, timeout_s: 60}}
data: {{source: indexed, paths: ["{data}"], tokenizer: "{tok}"}}
log: {{metrics_file: "{out}/metrics.jsonl", progress: false}}
checkpoint: {{dir: "{out}/checkpoints"}}
"""


# --------------------------------------------------------------------------------------------
# Assets: a tokenizer, datasets and a checkpoint, made once
# --------------------------------------------------------------------------------------------

def _make_corpus(path: Path, docs: int) -> None:
    spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "tools" / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--output", str(path), "--max-docs", str(docs)]) == 0


def _write_dataset(prefix: Path, tok, documents: list[list[int]]) -> None:
    from ptdp.data.indexed import IndexedDatasetWriter
    meta = {"tokenizer_fingerprint": tok.fingerprint, "special_ids": tok.special_ids(),
            "sentences": False}
    with IndexedDatasetWriter(prefix, tok.vocab_size, meta) as writer:
        for doc in documents:
            writer.add_document([doc])


def save_job(config: str, directory: str) -> None:
    """One rank trains one iteration of the base model and saves it."""
    from ptdp.training import Trainer
    cfg = load_config(config, ["data.source=synthetic", "data.tokenizer=null", "train.iters=1",
                               f"checkpoint.dir={directory}", "log.metrics_file=null"],
                      world_size=1)
    Trainer(cfg).train()


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from ptdp.data.tokenizer import train_tokenizer
    from ptdp.runtime.local_ranks import run_on_ranks

    root = tmp_path_factory.mktemp("check-assets")
    _make_corpus(root / "corpus.jsonl", 120)
    tok = train_tokenizer(root / "corpus.jsonl", root / "tok", VOCAB)
    other = train_tokenizer(root / "corpus.jsonl", root / "other", VOCAB + 88)
    write_tokenised(root / "corpus.jsonl", tok.path, root / "gpt")   # no `datasets` needed
    _write_dataset(root / "short", tok, [[5, 6, 7, 8, 9]])   # 5 tokens: shorter than s + 1
    _write_dataset(root / "empty", tok, [])
    paths = {"data": str(root / "gpt"), "tok": tok.path, "other_tok": other.path,
             "short": str(root / "short"), "empty": str(root / "empty"), "ckpt": str(root / "ckpt")}
    base = root / "base.yaml"
    base.write_text(BASE.format(vocab=VOCAB, out=root / "unused", **paths))
    run_on_ranks(1, save_job, str(base), paths["ckpt"], timeout_s=within(120))
    return paths


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------

@dataclass
class Row:
    id: str
    overrides: list[str]
    expect: list[str]                     # one substring per error line
    world: int = 1
    config: str | None = None             # replaces the base YAML
    setup: Callable[[Path, dict], None] | None = None   # makes broken files under tmp
    vocab: int = VOCAB


def _copy_data(tmp: Path, assets: dict, name: str = "bad") -> tuple[Path, Path]:
    for ext in (".bin", ".idx"):
        shutil.copy(assets["data"] + ext, tmp / f"{name}{ext}")
    return tmp / f"{name}.bin", tmp / f"{name}.idx"


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def idx_truncated_header(tmp, assets):
    _truncate(_copy_data(tmp, assets)[1], 20)


def idx_truncated_arrays(tmp, assets):
    idx = _copy_data(tmp, assets)[1]
    _truncate(idx, idx.stat().st_size - 4)


def idx_garbage(tmp, assets):
    _copy_data(tmp, assets)[1].write_bytes(os.urandom(300))


def idx_missing(tmp, assets):
    _copy_data(tmp, assets)[1].unlink()


def bin_truncated(tmp, assets):
    bin_path = _copy_data(tmp, assets)[0]
    _truncate(bin_path, bin_path.stat().st_size // 2)


def garbage_tokenizer(tmp, assets):
    (tmp / "garbage.model").write_bytes(b"this is not a sentencepiece model\n" * 10)


def ckpt_copy(tmp, assets) -> Path:
    shutil.copytree(assets["ckpt"], tmp / "ck")
    return tmp / "ck" / "iter_0000001"


def ckpt_truncated_shard(tmp, assets):
    shard = ckpt_copy(tmp, assets) / "model_pp000_tp000.pt"
    _truncate(shard, shard.stat().st_size // 2)


def ckpt_garbage_shard(tmp, assets):
    (ckpt_copy(tmp, assets) / "model_pp000_tp000.pt").write_bytes(os.urandom(4096))


def ckpt_truncated_rng(tmp, assets):
    rng = ckpt_copy(tmp, assets) / "rng_rank00000.pt"
    _truncate(rng, rng.stat().st_size // 2)


def ckpt_missing_shard(tmp, assets):
    (ckpt_copy(tmp, assets) / "model_pp000_tp000.pt").unlink()


def ckpt_garbage_metadata(tmp, assets):
    (ckpt_copy(tmp, assets) / "metadata.json").write_text("{not json")


def ckpt_latest_names_nothing(tmp, assets):
    (tmp / "ck").mkdir()
    (tmp / "ck" / "latest").write_text("iter_0000009\n")


def empty_dir(tmp, assets):
    (tmp / "ck").mkdir()


def a_file(tmp, assets):
    (tmp / "afile").write_text("I am a file\n")


def a_dir(tmp, assets):
    (tmp / "adir").mkdir()


MODEL_2BW = ["schedule.name=2bw", "parallel.pipeline=2", "train.global_batch_size=2",
             "train.micro_batch_size=2"]
ROWS = [
    # The config file itself
    Row("yaml-list-top-level", [], ["top level must be a mapping of sections"],
        config="- model\n- train\n"),
    Row("yaml-syntax", [], ["not valid YAML: line 2, column 1"], config="model: [unclosed\n"),
    Row("yaml-scalar-section", [], ["model: expected a mapping of keys"], config="model: 3\n"),
    Row("unknown-section", ["modle.arch=gpt"], ["unknown section 'modle'"]),
    Row("unknown-key", ["parallel.tensr=2"], ["unknown key 'parallel.tensr' (did you mean 'tensor'?)"]),
    Row("not-an-integer", ["train.iters=ten"], ["train.iters: expected an integer, got 'ten'"]),
    Row("not-a-bool", ["parallel.scatter_gather=maybe"], ["parallel.scatter_gather: expected true or false"]),
    Row("override-without-value", ["train.iters"], ["'train.iters' must look like section.key=value"]),
    Row("two-schema-errors", ["train.lr=fast", "model.hidden=3"],
        ["train.lr: expected a number", "unknown key 'model.hidden'"]),
    # Ranges of numeric keys
    Row("negative-lr", ["train.lr=-0.1"], ["train.lr must be >= 0, got -0.1"]),
    Row("min-lr-above-lr", ["train.min_lr=0.1", "train.lr=0.01"], ["train.min_lr (0.1) must not exceed train.lr"]),
    Row("beta1-above-one", ["train.adam_beta1=1.5"], ["train.adam_beta1 must be in [0, 1), got 1.5"]),
    Row("beta2-negative", ["train.adam_beta2=-0.1"], ["train.adam_beta2 must be in [0, 1)"]),
    Row("eps-zero", ["train.adam_eps=0"], ["train.adam_eps must be positive"]),
    Row("negative-weight-decay", ["train.weight_decay=-1"], ["train.weight_decay must be >= 0"]),
    Row("negative-clip-grad", ["train.clip_grad=-1"], ["train.clip_grad must be >= 0"]),
    Row("negative-warmup", ["train.lr_warmup_iters=-5"], ["train.lr_warmup_iters must be >= 0"]),
    Row("zero-decay-iters", ["train.lr_decay_iters=0"], ["train.lr_decay_iters must be positive"]),
    Row("zero-loss-scale", ["train.initial_loss_scale=0"], ["train.initial_loss_scale must be positive"]),
    Row("zero-global-batch", ["train.global_batch_size=0"], ["train.global_batch_size must be >= 1"]),
    Row("zero-micro-batch", ["train.micro_batch_size=0"], ["train.micro_batch_size must be >= 1"]),
    Row("eval-iters-zero", ["train.eval_interval=2", "train.eval_iters=0"],
        ["train.eval_iters must be >= 1 when train.eval_interval > 0"]),
    Row("negative-iters", ["train.iters=-1"], ["train.iters must be >= 0"]),
    Row("zero-timeout", ["train.timeout_s=0"], ["train.timeout_s must be positive"]),
    Row("dropout-above-one", ["model.dropout=1.5"], ["model.dropout must be in [0, 1)"]),
    Row("zero-heads", ["model.num_heads=0"], ["model.num_heads must be positive"]),
    Row("negative-save-interval", ["checkpoint.save_interval=-2"], ["checkpoint.save_interval must be >= 0"]),
    Row("precision", ["train.precision=fp8"], ["train.precision: 'fp8' is not one of fp32, bf16, fp16"]),
    Row("split-not-numbers", ["data.split=abc"], ["data.split must be comma-separated numbers"]),
    Row("split-negative", ["data.split=1,-1,0"], ["data.split must be up to three non-negative ratios"]),
    Row("split-four-parts", ["data.split=1,1,1,1"], ["data.split must be up to three"]),
    Row("split-no-train", ["data.split=0,1,1"], ["data.split='0,1,1' leaves nothing to train on"]),
    Row("several-ranges", ["train.lr=-1", "train.adam_beta1=1.5", "train.weight_decay=-1"],
        ["train.lr must be", "train.adam_beta1 must be", "train.weight_decay must be"]),
    # Layout against the world size
    Row("world-not-divisible", ["parallel.tensor=4"], ["world size 6 is not divisible by"], world=6),
    Row("heads-not-divisible", ["parallel.tensor=3", "train.global_batch_size=2", "train.micro_batch_size=1"],
        ["model.num_heads (4) must be divisible by parallel.tensor (3)",
         "model.hidden_size (32) must be divisible by parallel.tensor (3)",
         "model.ffn_hidden_size (128) must be divisible by parallel.tensor (3)"], world=3),
    Row("batch-not-divisible", ["train.global_batch_size=6"],
        ["train.global_batch_size (6) must be divisible by train.micro_batch_size * parallel.data"], world=2),
    Row("interleaved-one-chunk", ["parallel.pipeline=2", "schedule.name=interleaved"],
        ["set parallel.chunks=2 or more, or use schedule.name=1f1b"], world=2),
    Row("2bw-too-few-micro-batches", MODEL_2BW,
        ["schedule.name=2bw needs at least 2 micro-batches per pipeline"], world=2),
    Row("pipedream-clipping", ["schedule.name=pipedream", "train.precision=fp16"],
        ["schedule.name=pipedream needs train.clip_grad=0",
         "schedule.name=pipedream does not support train.precision=fp16"]),
    # Data files
    Row("idx-missing-prefix", ["data.paths=[{tmp}/nowhere]"], ["data.paths: {tmp}/nowhere.idx: not found"]),
    Row("idx-missing", ["data.paths=[{tmp}/bad]"], ["{tmp}/bad.idx: not found"], setup=idx_missing),
    Row("idx-truncated-header", ["data.paths=[{tmp}/bad]"], ["{tmp}/bad.idx: file is 20 bytes, shorter than"],
        setup=idx_truncated_header),
    Row("idx-truncated-arrays", ["data.paths=[{tmp}/bad]"], ["{tmp}/bad.idx: file is"], setup=idx_truncated_arrays),
    Row("idx-garbage", ["data.paths=[{tmp}/bad]"], ["{tmp}/bad.idx: bad magic"], setup=idx_garbage),
    Row("bin-truncated", ["data.paths=[{tmp}/bad]"], ["data.paths: {tmp}/bad.bin: "], setup=bin_truncated),
    Row("empty-corpus", ["data.paths=[{empty}]"], ["{empty}.idx holds no tokens"]),
    Row("seq-longer-than-corpus", ["data.paths=[{short}]"],
        ["model.seq_length=16 needs 17 tokens per sample, but the train split of {short}.idx"]),
    Row("vocab-below-data", ["model.vocab_size=100"],
        ["model.vocab_size=100 is smaller than the vocabulary of {data}.idx (512)"]),
    Row("bert-without-sentences", ["model.arch=bert"], ["{data}.idx has no sentence boundaries"]),
    Row("paths-odd-blend", ["data.paths=[0.5,{data},{short}]"], ["data.paths must be [prefix] or [weight, prefix"]),
    Row("indexed-without-paths", ["data.paths=[]"], ["data.source=indexed needs data.paths"]),
    # Tokenizer
    Row("tokenizer-missing", ["data.tokenizer={tmp}/nothing.model"],
        ["data.tokenizer: tokenizer model not found: {tmp}/nothing.model"]),
    Row("tokenizer-garbage", ["data.tokenizer={tmp}/garbage.model"],
        ["data.tokenizer: {tmp}/garbage.model: not a sentencepiece model"], setup=garbage_tokenizer),
    Row("tokenizer-not-the-datas", ["data.tokenizer={other_tok}", f"model.vocab_size={VOCAB + 88}"],
        ["data.tokenizer: {other_tok} (vocab_size 600) is not the tokenizer {data}.idx was made with"]),
    Row("vocab-below-tokenizer", ["data.source=synthetic", "model.vocab_size=256"],
        ["model.vocab_size=256 is smaller than the vocabulary of the tokenizer {tok} (512)"]),
    # Hardware profile and packages
    Row("hardware-typo", ["log.hardware=a100"], ["log.hardware: unknown hardware 'a100' (did you mean"]),
    Row("tensorboard-missing", ["log.tensorboard_dir={tmp}/out/tb"],
        ["log.tensorboard_dir is set but the tensorboard package is not installed"]),
    # Output folders
    Row("checkpoint-dir-is-a-file", ["checkpoint.dir={tmp}/afile"],
        ["checkpoint.dir: {tmp}/afile is a file, not a directory"], setup=a_file),
    Row("checkpoint-dir-under-a-file", ["checkpoint.dir={tmp}/afile/ckpt"],
        ["checkpoint.dir: {tmp}/afile/ckpt cannot be created: {tmp}/afile is a file"], setup=a_file),
    Row("metrics-folder-under-a-file", ["log.metrics_file={tmp}/afile/m/metrics.jsonl"],
        ["log.metrics_file: {tmp}/afile/m (the folder of {tmp}/afile/m/metrics.jsonl) cannot be created"],
        setup=a_file),
    Row("metrics-file-is-a-dir", ["log.metrics_file={tmp}/adir"], ["log.metrics_file: {tmp}/adir is a directory"],
        setup=a_dir),
    Row("trace-folder-is-a-file", ["log.trace_file={tmp}/afile/trace.json"],
        ["log.trace_file: {tmp}/afile (the folder of {tmp}/afile/trace.json) is a file"], setup=a_file),
    # The checkpoint to load
    Row("load-missing", ["checkpoint.load={tmp}/nowhere"], ["checkpoint.load: checkpoint path {tmp}/nowhere does not exist"]),
    Row("load-empty-dir", ["checkpoint.load={tmp}/ck"], ["checkpoint.load: {tmp}/ck holds no checkpoint: no 'latest' file"],
        setup=empty_dir),
    Row("load-latest-names-nothing", ["checkpoint.load={tmp}/ck"], ["names 'iter_0000009', but"],
        setup=ckpt_latest_names_nothing),
    Row("load-a-file", ["checkpoint.load={tmp}/afile"], ["checkpoint.load: checkpoint path {tmp}/afile is a file"],
        setup=a_file),
    Row("load-other-model", ["checkpoint.load={ckpt}", "model.hidden_size=64", "model.ffn_hidden_size=128",
                             "model.head_dim=8"],
        ["checkpoint.load: {ckpt}/iter_0000001 was saved for a different model: model.hidden_size=32 in "
         "the checkpoint but 64 in the config"]),
    Row("load-truncated-shard", ["checkpoint.load={tmp}/ck"],
        ["checkpoint.load: cannot read {tmp}/ck/iter_0000001/model_pp000_tp000.pt"], setup=ckpt_truncated_shard),
    Row("load-garbage-shard", ["checkpoint.load={tmp}/ck"],
        ["checkpoint.load: cannot read {tmp}/ck/iter_0000001/model_pp000_tp000.pt"], setup=ckpt_garbage_shard),
    Row("load-truncated-rng", ["checkpoint.load={tmp}/ck/iter_0000001"],
        ["checkpoint.load: cannot read {tmp}/ck/iter_0000001/rng_rank00000.pt"], setup=ckpt_truncated_rng),
    Row("load-missing-shard", ["checkpoint.load={tmp}/ck/iter_0000001"],
        ["{tmp}/ck/iter_0000001 is an incomplete checkpoint: missing model_pp000_tp000.pt"],
        setup=ckpt_missing_shard),
    Row("load-garbage-metadata", ["checkpoint.load={tmp}/ck/iter_0000001"],
        ["checkpoint.load: cannot read {tmp}/ck/iter_0000001/metadata.json"], setup=ckpt_garbage_metadata),
    # Independent problems are all reported
    Row("everything-at-once", ["train.lr=-1", "data.paths=[{tmp}/nowhere]", "checkpoint.dir={tmp}/afile",
                               "log.hardware=a100", "checkpoint.load={tmp}/nowhere"],
        ["train.lr must be", "{tmp}/nowhere.idx: not found", "checkpoint.dir: {tmp}/afile is a file",
         "log.hardware: unknown hardware", "checkpoint.load: checkpoint path {tmp}/nowhere"], setup=a_file),
]


ROW = {row.id: row for row in ROWS}


def _prepare(row: Row, tmp: Path, assets: dict) -> tuple[str, list[str], list[str], Path]:
    """(config path, overrides, expected substrings, output folder) for a row."""
    if row.setup:
        row.setup(tmp, assets)
    values = {**assets, "tmp": str(tmp)}
    out = tmp / "out"
    config = tmp / "job.yaml"
    config.write_text(row.config if row.config is not None
                      else BASE.format(vocab=row.vocab, out=out, **assets))
    return (str(config), [o.format(**values) for o in row.overrides],
            [e.format(**values) for e in row.expect], out)


def _assert_one_line_per_problem(text: str, prefix: str, expect: list[str]) -> None:
    lines = text.splitlines()
    assert "Traceback" not in text
    assert len(lines) == len(expect), text
    for line in lines:
        assert line.startswith(prefix), line
    for want in expect:
        assert sum(want in line for line in lines) == 1, f"{want!r} not on exactly one line of:\n{text}"


class TrainerStarted(AssertionError):
    pass


@pytest.fixture
def no_trainer(monkeypatch):
    """`ptdp train` must stop before building a Trainer; the stub fails the test if not."""
    import ptdp.training

    def refuse(*_):
        raise TrainerStarted("ptdp train got past its checks")
    monkeypatch.setattr(ptdp.training, "Trainer", refuse)
    monkeypatch.setattr(checks, "package_installed", lambda name: name != "tensorboard")


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_a_bad_job_is_refused_in_one_line_per_problem(row, assets, tmp_path, capfd, monkeypatch,
                                                      no_trainer):
    config, overrides, expect, out = _prepare(row, tmp_path, assets)

    rc = cli.main(["check", config, *overrides, "--world-size", str(row.world)])
    captured = capfd.readouterr()
    assert rc == 2 and captured.out == ""
    _assert_one_line_per_problem(captured.err, "ptdp check: ", expect)

    monkeypatch.setenv("WORLD_SIZE", str(row.world))
    monkeypatch.delenv("RANK", raising=False)
    rc = cli.main(["train", config, *overrides])
    captured = capfd.readouterr()
    assert rc == 2 and captured.out == ""
    _assert_one_line_per_problem(captured.err, "ptdp train: ", expect)
    assert not out.exists()   # no checkpoint folder, no metrics file


def test_the_table_is_large_enough():
    assert len(ROWS) >= 40 and len({r.id for r in ROWS}) == len(ROWS)


def test_only_rank_zero_prints(assets, tmp_path, capfd, monkeypatch, no_trainer):
    config, overrides, _, _ = _prepare(ROW["negative-lr"], tmp_path, assets)
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["train", config, *overrides]) == 2
    assert capfd.readouterr().err == ""


# --------------------------------------------------------------------------------------------
# A good job
# --------------------------------------------------------------------------------------------

def test_a_good_job_prints_its_layout_micro_batches_and_memory(assets, tmp_path, capfd):
    from ptdp.planner.compute import ModelShape
    from ptdp.planner.memory import GB, gpu_memory

    config, _, _, out = _prepare(Row("good", [], []), tmp_path, assets)
    overrides = ["parallel.pipeline=2", "train.global_batch_size=8", f"checkpoint.load={assets['ckpt']}"]
    rc = cli.main(["check", config, *overrides, "--world-size", "4"])
    text = capfd.readouterr().out
    assert rc == 0, text
    assert "(p, t, d) = (2, 1, 2), v = 1, schedule 1f1b" in text
    assert "m = 2 of 2 per pipeline" in text          # 8 / (2 * 2)
    assert ("compile: on when training on CUDA (train.compile=null), in regions of up to 1 "
            "layer (train.compile_layers=null; parallel.data=2: the gradient reduction "
            "overlaps each layer's backward)") in text
    cfg = load_config(config, overrides, world_size=4)
    for rank in (0, 1):   # the planner's memory model, for each pipeline rank
        mem = gpu_memory(ModelShape.from_config(cfg.model), p=2, t=1, v=1, m=2, b=2, d=2,
                         schedule="1f1b", recompute="none", precision="fp32", attention="flash",
                         vocab_padded=cfg.padded_vocab_size, reserved_gb=0.0, rank=rank)
        assert f"pipeline rank {rank}: {mem.total / GB:.3f} GiB" in text
    assert not out.exists()


def test_a_broken_latest_is_a_note_not_an_error(assets, tmp_path, capfd):
    config, _, _, _ = _prepare(Row("good", [], []), tmp_path, assets)
    shutil.copytree(assets["ckpt"], tmp_path / "ck")
    (tmp_path / "ck" / "latest").write_text("iter_0000007\n")
    rc = cli.main(["check", config, f"checkpoint.load={tmp_path / 'ck'}", "--world-size", "1"])
    text = capfd.readouterr().out
    assert rc == 0, text
    assert re.search(r"note: checkpoint.load: .*names 'iter_0000007'.*loading the newest complete "
                     r"checkpoint, .*iter_0000001", text)


# --------------------------------------------------------------------------------------------
# Real processes: torchrun, the launch script, preprocess
# --------------------------------------------------------------------------------------------

def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module", autouse=True)
def launched(assets, tmp_path_factory):
    """The two real launches the last tests below read, started as the module's assets are
    ready: they run (the torchrun job's ranks wait seconds for rank 0 to speak, the launch
    script's `ptdp check` is one core's work) while the tests before them run in this process.
    {name: (process, expected substrings, output folder)}."""
    started = {}
    try:
        tmp = tmp_path_factory.mktemp("torchrun")
        config, overrides, expect, out = _prepare(ROW["everything-at-once"], tmp, assets)
        started["torchrun"] = (start(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", "-m", "ptdp", "train", config, *overrides], cwd=tmp, env=_env()), expect, out)
        tmp = tmp_path_factory.mktemp("script")
        config, overrides, expect, out = _prepare(ROW["everything-at-once"], tmp, assets)
        env = {**_env(), "PYTHON": sys.executable, "NPROC": "2", "CUDA_VISIBLE_DEVICES": "",
               "TORCHRUN": "false"}   # a launcher that would fail the test if it ran
        started["script"] = (start(["bash", str(ROOT / "tools" / "pretrain_gpt.sh"), config,
                                    *overrides], env=env), expect, out)
        yield started
    finally:
        end(proc for proc, _, _ in started.values())


@pytest.mark.parametrize("content,message", [
    ("", "is empty: no documents to tokenise"),
    ("\n   \n", "is empty: no documents to tokenise"),
    ('{"text": ""}\n{"text": ""}\n', "every document is empty, nothing to write"),
])
def test_preprocess_refuses_an_empty_input_in_one_line(assets, tmp_path, capfd, content, message):
    needs("datasets")
    source = tmp_path / "input.jsonl"
    source.write_text(content)
    rc = cli.main(["preprocess", "--input", str(source), "--tokenizer", assets["tok"],
                   "--output-prefix", str(tmp_path / "out"), "--quiet", "--workers", "1"])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and "Traceback" not in err
    assert len(lines) == 1 and message in lines[0] and str(source) in lines[0], err
    assert not list(tmp_path.glob("out*"))


def test_check_models_what_the_trainer_recomputes_whatever_the_profile_says():
    """`ptdp check`'s memory estimate is the trainer's: plain recompute=selective resolves as the
    trainer resolves it (layernorm, activation), even with a profile modelling materialized
    attention, where the planner's own default would add core_attn."""
    import dataclasses

    from ptdp.job_summary import memory_per_stage
    from ptdp.config import load_config
    from ptdp.hardware import load_hardware

    hw = dataclasses.replace(load_hardware("a100-80gb"), attention="materialized")
    base = ["model.num_layers=4", "model.hidden_size=64", "model.num_heads=4",
            "parallel.pipeline=2", "train.recompute=selective"]
    plain = memory_per_stage(load_config(None, base, world_size=2), hw)
    pinned = memory_per_stage(load_config(
        None, base + ["train.recompute_modules=[layernorm,activation]"], world_size=2), hw)
    with_scores = memory_per_stage(load_config(
        None, base + ["train.recompute_modules=[core_attn,layernorm,activation]"],
        world_size=2), hw)
    assert plain == pinned != with_scores


@pytest.mark.parametrize("rank, world, waits", [("1", "2", True), ("0", "2", False),
                                                ("0", "1", False)])
def test_ranks_other_than_0_leave_after_rank_0_had_time_to_say_why(monkeypatch, rank, world,
                                                                   waits):
    """torchrun ends every worker once one exits: a rank that found the same problem as rank 0,
    and prints nothing, must not leave first, or rank 0 may be killed before its line is out
    (test_torchrun_ranks_exit_2_before_any_process_group lost that race under load)."""
    import time

    from ptdp.commands import train
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    assert train._after_rank_0_said_why(2) == 2
    assert slept == ([train.SAID_WHY_GRACE_S] if waits else [])


# ---- the real launches (started by `launched` above, as the module's assets were ready)

def test_torchrun_ranks_exit_2_before_any_process_group(launched):
    proc, expect, out = launched["torchrun"]
    res = finish(proc, within(120))
    text = res.stdout + res.stderr
    assert res.returncode != 0
    ours = [line for line in text.splitlines() if line.startswith("ptdp train: ")]
    assert len(ours) == len(expect), text            # rank 0 only: each problem once
    for want in expect:
        assert sum(want in line for line in ours) == 1, text
    # The workers exited with code 2 (torchrun may stop the slower one with SIGTERM first);
    # the only traceback is torchrun's own report.
    codes = re.findall(r"exitcode\s+: (-?\d+)", text)
    assert "2" in codes and set(codes) <= {"2", "-15"}, text
    assert not re.search(r'File ".*/ptdp/', text), text
    assert not out.exists()


def test_launch_script_stops_before_torchrun(launched):
    proc, expect, out = launched["script"]
    res = finish(proc, within(120))
    assert res.returncode == 2, res.stderr
    for want in expect:
        assert want in res.stderr
    assert "fix the job or launch a different number of ranks" in res.stderr
    assert "--nnodes" not in res.stderr and not out.exists()
