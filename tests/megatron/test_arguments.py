"""`ptdp config from-megatron` and the Megatron spellings ptdp recognises (ptdp/megatron/
arguments.py, translate.py, launch_script.py; ptdp/commands/config.py; ptdp/cli.py).

Torch-free and in-process: realistic GPT-3 and Llama-style Megatron-LM command lines and a launch
script translate to the exact ptdp keys; Megatron's differing defaults are written when absent;
every argument not mapped exactly is listed with its kind; a translation loads in ptdp's config
loader and validates; a Megatron spelling on `ptdp train`/`ptdp check` gets one line naming ptdp's
key; and docs/migration.md's argument table is the code's table.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import yaml

from ptdp import cli
from ptdp.config import load_config
from ptdp.megatron.arguments import ARGS, docs_table, lookup
from ptdp.megatron.launch_script import read_invocation
from ptdp.megatron.translate import TranslationError, is_config_key, to_yaml, translate

ROOT = Path(__file__).resolve().parents[2]

# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, with its paths filled in, made
# sample-based: the script's --train-iters 500000 and --lr-decay-iters 430000 beside
# --rampup-batch-size fail Megatron's own validate_args ("expected no batch-size rampup for
# iteration-based training", megatron/training/arguments.py at core_v0.16.1), and ptdp refuses
# them the same way (train.rampup_batch_size needs train.train_samples).
GPT3 = """pretrain_gpt.py --num-layers 96 --hidden-size 12288 --num-attention-heads 96
    --seq-length 2048 --max-position-embeddings 2048 --attention-backend auto
    --micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375
    --train-samples 146484375 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
    --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine
    --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-samples 126953125
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
    --data-path /data/gpt_text_document --vocab-file /data/gpt2-vocab.json
    --merge-file /data/gpt2-merges.txt --tokenizer-type GPT2BPETokenizer --split 949,50,1
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --save /ckpt --load /ckpt
    --eval-iters 10 --tensorboard-dir /tb""".split()

GPT3_VALUES = {
    "model.arch": "gpt", "model.num_layers": 96, "model.hidden_size": 12288, "model.num_heads": 96,
    "model.seq_length": 2048, "model.init_std": 0.006,
    "model.dropout": 0.1,                                   # Megatron's default
    "model.activation": "gelu_tanh",                        # its fused bias-GeLU, the default
    "parallel.tensor": 8, "parallel.pipeline": 16,
    "train.micro_batch_size": 1, "train.global_batch_size": 1536,
    "train.rampup_batch_size": [16, 16, 5859375], "train.train_samples": 146484375,
    "train.weight_decay": 0.1, "train.adam_beta1": 0.9, "train.adam_beta2": 0.95,
    "train.clip_grad": 1.0, "train.precision": "fp16", "train.lr": 6.0e-5,
    "train.lr_decay_style": "cosine", "train.min_lr": 6.0e-6, "train.lr_warmup_fraction": 0.001,
    "train.lr_decay_samples": 126953125, "train.eval_interval": 1000, "train.eval_iters": 10,
    "train.initial_loss_scale": 2.0 ** 32,                  # Megatron's default with --fp16
    "data.source": "indexed", "data.paths": ["/data/gpt_text_document"],
    "data.sampling": "megatron", "data.tokenizer": "/data/gpt2-vocab.json",
    "data.split": "949,50,1",
    "log.interval": 100, "log.tensorboard_dir": "/tb",
    "checkpoint.dir": "/ckpt", "checkpoint.save_interval": 10000, "checkpoint.load": "auto",
}

# A Llama-style run (cf. examples/llama/train_llama3_8b_h100_fp8.sh) with an interleaved
# pipeline, GQA, data blending and the end-of-document options.
LLAMA = """--num-layers 8 --hidden-size 4096 --num-attention-heads 32 --group-query-attention
    --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
    --position-embedding-type rope --rotary-base 500000 --use-rope-scaling --normalization RMSNorm
    --norm-epsilon 1e-5 --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0 --bf16 --use-distributed-optimizer
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    --num-layers-per-virtual-pipeline-stage 2 --sequence-parallel
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --micro-batch-size 1 --global-batch-size 64 --train-samples 640000 --lr 3e-4
    --lr-decay-style WSD --lr-wsd-decay-style linear --lr-wsd-decay-samples 64000
    --lr-warmup-samples 6400 --lr-warmup-init 1e-7 --data-path 0.3 /data/a_text_document
    0.7 /data/b_text_document --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model /tok/tokenizer.json --reset-position-ids --reset-attention-mask
    --eod-mask-loss --use-flash-attn --seed 42""".split()


def values(words, **kw) -> dict:
    return translate(words, **kw).values


def lines(words, **kw) -> list[str]:
    return [str(line) for line in translate(words, **kw).lines]


def test_a_gpt3_command_line_translates_to_these_keys():
    t = translate(GPT3)
    assert t.values == GPT3_VALUES
    assert [str(line) for line in t.lines] == [
        "ignored: --attention-backend auto: a kernel choice; ptdp picks its own fused kernels",
        "approximate: --load /ckpt: resumes ptdp's checkpoints in --save; Megatron's own there "
        "must first be converted (ptdp convert --from megatron)",
        "approximate: --hysteresis absent: Megatron's default 2 waits for two overflows before "
        "halving the loss scale; ptdp halves at every overflow (--hysteresis 1)",
        "note: model.vocab_size: Megatron reads it from the tokenizer; set it (ptdp check names "
        "the value)",
    ]


def test_a_llama_command_line_with_interleaving_gqa_and_blending():
    v = values(LLAMA)
    assert {k: v[k] for k in v if k.startswith(("model.", "parallel.", "schedule."))} == {
        "model.arch": "gpt", "model.num_layers": 8, "model.hidden_size": 4096, "model.num_heads": 32,
        "model.num_kv_heads": 8, "model.seq_length": 8192, "model.position_embedding": "rope",
        "model.rope_theta": 500000.0, "model.rope_scaling_factor": 8.0,
        "model.normalization": "rmsnorm", "model.layernorm_eps": 1e-5, "model.activation": "swiglu",
        "model.tie_embeddings": False, "model.bias": False, "model.attention_dropout": 0.0,
        "model.dropout": 0.0,
        "model.ffn_hidden_size": 10880,      # Megatron's SwiGLU default: int(8h/3 / 64) * 64
        "parallel.tensor": 2, "parallel.pipeline": 2, "parallel.sequence_parallel": True,
        "parallel.chunks": 2,                                 # 8 layers / (2 stages * 2)
        "schedule.name": "interleaved",
    }
    assert v["data.paths"] == [0.3, "/data/a_text_document", 0.7, "/data/b_text_document"]
    # (context parallelism on its own: the line below)
    assert values(["--context-parallel-size", "2"])["parallel.context"] == 2
    assert v["data.tokenizer"] == "/tok/tokenizer.json"
    assert (v["data.reset_position_ids"], v["data.reset_attention_mask"], v["data.eod_mask_loss"]) \
        == (True, True, True)
    assert {k: v[k] for k in v if k.startswith("train.") and "lr" in k} == {
        "train.lr": 3e-4, "train.lr_decay_style": "wsd", "train.lr_wsd_decay_style": "linear",
        "train.lr_wsd_decay_samples": 64000, "train.lr_warmup_samples": 6400,
        "train.lr_warmup_init": 1e-7}
    assert (v["train.recompute"], v["train.recompute_num_layers"], v["train.train_samples"],
            v["train.precision"], v["train.distributed_optimizer"]) == ("full", 1, 640000, "bf16", True)
    assert lines(LLAMA) == [
        "ignored: --use-flash-attn: a kernel choice; ptdp picks its own fused kernels",
        "approximate: --seed 42: the same role; ptdp's initialisation draws other numbers",
        "note: model.vocab_size: Megatron reads it from the tokenizer; set it (ptdp check names "
        "the value)",
    ]


def test_megatrons_defaults_are_written_where_they_differ_from_ptdps():
    v = values(["--num-layers", "2"])
    assert v == {"model.arch": "gpt", "model.num_layers": 2, "model.dropout": 0.1,
                 "model.activation": "gelu_tanh",
                 "train.lr_decay_style": "linear", "train.adam_beta2": 0.999,
                 "train.eval_interval": 1000, "train.eval_iters": 100,
                 "log.interval": 100}
    # given arguments win; defaults equal to ptdp's (weight decay 0.01, clip 1.0) are not written
    v = values(["--adam-beta2", "0.95", "--hidden-dropout", "0", "--swiglu", "--hidden-size", "64",
                "--fp16", "--data-path", "/d/x", "--lr-decay-style", "WSD"])
    assert (v["train.adam_beta2"], v["model.dropout"], v["train.initial_loss_scale"]) == (0.95, 0.0, 2.0 ** 32)
    assert v["model.attention_dropout"] == 0.1      # Megatron's 0.1, no longer equal to the hidden
    assert v["model.ffn_hidden_size"] == 128        # int(8 * 64 / 3 / 64) * 64 (ptdp's rule: 256)
    assert v["data.split"] == "969,30,1"             # Megatron's default with --data-path
    assert "train.lr_wsd_decay_style" not in v      # exponential in both: nothing to write
    assert "train.weight_decay" not in v and "train.clip_grad" not in v
    assert "data.split" not in values(["--num-layers", "2"])    # only with --data-path
    assert "model.attention_dropout" not in values(["--num-layers", "2"])   # follows model.dropout


@pytest.mark.parametrize("words, line", [
    (["--moe-router-topk", "2"],
     "ignored: --moe-router-topk 2: Megatron uses it only with --num-experts"),
    (["--apply-residual-connection-post-layernorm"],
     "refused: --apply-residual-connection-post-layernorm: ptdp's blocks are pre-norm"),
    (["--position-embedding-type", "relative"],
     "refused: --position-embedding-type relative: 'relative': ptdp has learned and rotary positions"),
    (["--make-vocab-size-divisible-by", "64"],
     "refused: --make-vocab-size-divisible-by 64: ptdp pads the vocabulary to a multiple of 128 x t"),
    (["--num-layers", "6", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "2"],
     "refused: --num-layers-per-virtual-pipeline-stage 2: 6 layers do not split into 2 stages "
     "of 2-layer virtual stages"),
    (["--no-masked-softmax-fusion"],
     "ignored: --no-masked-softmax-fusion: a kernel choice; ptdp picks its own fused kernels"),
    (["--num-query-groups", "4"],
     "ignored: --num-query-groups 4: Megatron ignores it without --group-query-attention"),
    (["--hysteresis", "2"],
     "approximate: --hysteresis 2: ptdp halves the loss scale at every overflow (--hysteresis 1)"),
    (["--fp32-residual-connection"], "approximate: --fp32-residual-connection: ptdp keeps the "
     "residual in the model's dtype, not fp32"),
    (["--recompute-method", "block"], "approximate: --recompute-method block: ptdp checkpoints every "
     "group of train.recompute_num_layers layers (Megatron's uniform), not only the first ones (block)"),
    (["--data-path", "/d/a", "/d/b"], "approximate: --data-path /d/a /d/b: prefixes without weights: "
     "Megatron weighs them by size, ptdp writes equal weights; set the weights"),
    (["--load", "/megatron/ckpt"], "approximate: --load /megatron/ckpt: a Megatron checkpoint must "
     "first be converted (ptdp convert --from megatron)"),
    (["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", "vocab.txt"],
     "approximate: --tokenizer-type BertWordPieceLowerCase: the WordPiece vocabulary; Case vs "
     "LowerCase is not carried over"),
    (["--tokenizer-type", "TikTokenizer"], "refused: --tokenizer-type TikTokenizer: 'TikTokenizer': "
     "ptdp reads sentencepiece, GPT-2 BPE, WordPiece and Hugging Face tokenizer.json"),
    (["--not-an-argument", "3"],
     "unknown: --not-an-argument 3: not in ptdp's table of Megatron-LM arguments: not translated"),
    (["stray"], "unknown: stray: a word that is not an argument"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe_act"],
     "refused: --recompute-modules moe_act: moe_act: ptdp's activation module recomputes the "
     "dense MLP's and the shared experts' activations, not the routed experts'"),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "attn"],
     "refused: --recompute-modules core_attn attn: 'attn' is no module of Megatron's "
     "--recompute-modules"),
    (["--recompute-granularity", "selective", "--recompute-modules", "layernorm",
      "--sequence-parallel"], "refused: --recompute-modules layernorm: layernorm with "
     "--sequence-parallel: ptdp's linears keep their all-gathered inputs, so recomputing the "
     "norms saves nothing"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp", "--num-experts", "4"],
     "refused: --recompute-modules mlp: mlp with --num-experts: ptdp recomputes the dense MLP "
     "only"),
    (["--recompute-granularity", "full", "--recompute-modules", "mlp"], "ignored: "
     "--recompute-modules mlp: Megatron uses it only with --recompute-granularity selective"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/d/v.json", "--merge-file",
      "/e/m.txt"], "approximate: --merge-file /e/m.txt: ptdp reads the merges beside the "
     "vocabulary (/d/merges.txt); copy or link /e/m.txt there"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json", "--merge-file", "m.txt"],
     "note: model.vocab_size: Megatron reads it from the tokenizer; set it (ptdp check names the value)"),
])
def test_every_argument_not_mapped_exactly_gets_one_line_saying_why(words, line):
    assert line in lines(words, defaults=False)


@pytest.mark.parametrize("words, message", [
    (["--num-layers"], "--num-layers needs 1 value, got 0"),
    (["--num-layers", "many"], "--num-layers many: not a valid value for --num-layers"),
    (["--rampup-batch-size", "16", "16"], "--rampup-batch-size needs 3 values, got 2"),
])
def test_a_command_line_megatron_would_reject_is_one_clear_error(words, message):
    with pytest.raises(TranslationError, match="^" + message.replace("-", r"\-") + "$"):
        translate(words)


def test_the_script_decides_bert_and_torchrun_options_are_not_megatrons():
    words = ["torchrun", "--nproc_per_node", "8", "/m/pretrain_bert.py", "--mask-prob", "0.2"]
    t = translate(words)
    assert (t.values["model.arch"], t.values["data.mask_prob"]) == ("bert", 0.2)
    assert not [line for line in t.lines if "nproc" in line.argument]
    assert translate(words, arch="gpt").values["model.arch"] == "gpt"


SCRIPT = r"""#!/bin/bash
# A launch script as Megatron-LM users write them.
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=8
WORLD_SIZE=$(($GPUS_PER_NODE*2))
CHECKPOINT_PATH=$1   # <path>
DATA=${DATA:-/data/corpus_text_document}
TP=2
GPT_ARGS=(
    --num-layers 4          # tiny
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 32
    --max-position-embeddings 32
    --tensor-model-parallel-size ${TP}
)
GPT_ARGS+=(--use-flash-attn)
TRAIN_ARGS="--micro-batch-size 2 --global-batch-size 16 --train-iters 20 --lr 1e-3"

torchrun --nproc_per_node $GPUS_PER_NODE --nnodes 1 pretrain_gpt.py \
    "${GPT_ARGS[@]}" \
    $TRAIN_ARGS \
    --data-path $DATA --split 98,2,0 \
    --save $CHECKPOINT_PATH --world-size $WORLD_SIZE 2>&1 | tee train.log
"""


def test_a_launch_script_is_read_with_its_variables_and_arrays(tmp_path):
    path = tmp_path / "train.sh"
    path.write_text(SCRIPT)
    inv = read_invocation(path)
    assert inv.words[:6] == ["torchrun", "--nproc_per_node", "8", "--nnodes", "1", "pretrain_gpt.py"]
    assert inv.words[5:] == [
        "pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--tensor-model-parallel-size", "2",
        "--use-flash-attn", "--micro-batch-size", "2", "--global-batch-size", "16",
        "--train-iters", "20", "--lr", "1e-3", "--data-path", "/data/corpus_text_document",
        "--split", "98,2,0", "--save", "$1", "--world-size", "$WORLD_SIZE"]
    assert inv.unresolved == ["$1", "$WORLD_SIZE"]


def test_from_megatron_script_writes_yaml_and_lists_what_it_could_not_map(tmp_path, capsys):
    path = tmp_path / "train.sh"
    path.write_text(SCRIPT)
    out = tmp_path / "gpt.yaml"
    assert cli.main(["config", "from-megatron", "--script", str(path), "--out", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"ptdp config from-megatron: wrote {out} (22 keys)"
    assert err[1:] == [
        "  ignored: --use-flash-attn: a kernel choice; ptdp picks its own fused kernels",
        "  unknown: --world-size $WORLD_SIZE: not in ptdp's table of Megatron-LM arguments: not translated",
        "  unresolved: $1: not set in the script; written as it stands",
        "  unresolved: $WORLD_SIZE: not set in the script; written as it stands"]
    raw = yaml.safe_load(out.read_text())
    assert raw["parallel"] == {"tensor": 2}
    assert raw["train"]["micro_batch_size"] == 2 and raw["checkpoint"] == {"dir": "$1"}
    assert "  num_layers: 4" in out.read_text() and "# --num-layers 4" in out.read_text()


@pytest.mark.parametrize("words, world", [(GPT3, 128), (LLAMA, 8)])
def test_a_translation_loads_in_ptdps_config_loader_and_validates(words, world, tmp_path, capsys):
    out = tmp_path / "cfg.yaml"
    assert cli.main(["config", "from-megatron", "--out", str(out), "--", *words]) == 0
    raw = yaml.safe_load(out.read_text())
    assert raw == translate(words).nested()
    cfg = load_config(out, world_size=world)   # every key it writes is ptdp's
    assert (cfg.parallel.tensor, cfg.train.global_batch_size) == (raw["parallel"]["tensor"],
                                                                 raw["train"]["global_batch_size"])


def test_a_small_translation_loads_with_megatrons_defaults(tmp_path):
    words = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
             "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "5",
             "--bf16", "--lr", "1e-3", "--lr-warmup-iters", "2", "--save", "/tmp/run"]
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(translate(words)))
    cfg = load_config(path, world_size=8)
    assert (cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.chunks, cfg.parallel.data) == (2, 2, 2, 2)
    assert (cfg.schedule.name, cfg.train.precision, cfg.train.lr_decay_style) == ("interleaved", "bf16", "linear")
    assert (cfg.model.dropout, cfg.train.adam_beta2, cfg.train.eval_iters, cfg.log.interval) == (0.1, 0.999, 100, 100)


def test_every_key_the_table_writes_is_ptdps():
    keys = {arg.key for arg in ARGS if arg.key}
    keys |= {k for words in (GPT3, LLAMA) for k in translate(words).values}
    assert sorted(k for k in keys if not is_config_key(k)) == []


@pytest.mark.parametrize("argv, line", [
    (["train", "CFG", "--tensor-model-parallel-size", "2"],
     "ptdp train: --tensor-model-parallel-size 2 is Megatron-LM's spelling of parallel.tensor=2; "
     "`ptdp config from-megatron -- ARGS` translates a whole Megatron command line"),
    (["check", "CFG", "--world-size", "1", "--num-layers=4"],
     "ptdp check: --num-layers 4 is Megatron-LM's spelling of model.num_layers=4; "
     "`ptdp config from-megatron -- ARGS` translates a whole Megatron command line"),
    (["train", "CFG", "pipeline_model_parallel_size=2"],
     "ptdp train: pipeline_model_parallel_size=2: --pipeline-model-parallel-size 2 is Megatron-LM's "
     "spelling of parallel.pipeline=2; `ptdp config from-megatron -- ARGS` translates a whole "
     "Megatron command line"),
    (["check", "CFG", "--use-flash-attn"],
     "ptdp check: --use-flash-attn is a Megatron-LM argument that ptdp ignores: a kernel choice; "
     "ptdp picks its own fused kernels"),
    (["train", "CFG", "--apply-residual-connection-post-layernorm"],
     "ptdp train: --apply-residual-connection-post-layernorm is a Megatron-LM argument that ptdp has no "
     "counterpart for: ptdp's blocks are pre-norm"),
])
def test_a_megatron_spelling_on_ptdps_command_line_gets_one_line(argv, line, capsys):
    argv = [str(ROOT / "configs" / "gpt_tiny.yaml") if w == "CFG" else w for w in argv]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [line] and captured.out == ""


def test_a_megatron_key_in_a_yaml_file_gets_the_hint(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text("parallel:\n  tensor_model_parallel_size: 2\n")
    assert cli.main(["check", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ptdp check: unknown key 'parallel.tensor_model_parallel_size'; --tensor-model-parallel-size "
        "is Megatron-LM's spelling of parallel.tensor; write parallel.tensor=VALUE "
        "(`ptdp config from-megatron -- ARGS` translates a whole Megatron command line)"]


def test_ptdps_own_keys_that_look_like_megatrons_are_left_alone():
    from ptdp.megatron.translate import command_line_hints, explain_config_errors
    assert is_config_key("train.micro_batch_size") and lookup("--micro-batch-size")
    assert command_line_hints(["train.micro_batch_size=2"], ["train.micro_batch_size=2"]) == []
    # an unknown key that is no Megatron spelling gets no Megatron hint
    assert command_line_hints(["train.warmup_ratio=0.1"], ["train.warmup_ratio=0.1"]) == []
    line = "unknown key 'train.warmup_ratio'"
    assert explain_config_errors([line]) == [line]


def test_the_docs_argument_table_is_the_codes(capsys):
    doc = (ROOT / "docs" / "migration.md").read_text()
    assert docs_table() in doc, ("docs/migration.md's argument table differs from "
                                 "ptdp/megatron/arguments.py: paste `ptdp config from-megatron --table`")
    assert cli.main(["config", "from-megatron", "--table"]) == 0
    assert capsys.readouterr().out == docs_table()
    flags = [arg.flag for arg in ARGS]
    assert len(flags) == len(set(flags))


def test_bad_input_to_from_megatron_is_one_line_naming_what(tmp_path, capsys):
    script = tmp_path / "train.sh"
    script.write_text("echo hello\n")
    cases = [
        (["--script", str(script)], f"{script}: no line runs Megatron-LM's pretrain_*.py"),
        (["--", "--num-layers"], "--num-layers needs 1 value, got 0"),
        (["--num-layers", "2"], "put Megatron's arguments after `--`: ptdp config from-megatron "
                                "[--out FILE] -- ARGS"),
        ([], "give either --script FILE or -- ARGS"),
    ]
    for argv, message in cases:
        assert cli.main(["config", "from-megatron", *argv]) == 2
        assert capsys.readouterr().err.splitlines() == [f"ptdp config from-megatron: {message}"]


def test_what_megatron_requires_is_noted_when_absent():
    assert lines(["--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "1",
                  "--lr", "1e-3", "--train-samples", "100"])[-2:] == [
        "note: --num-layers / --encoder-num-layers absent: Megatron requires it; ptdp's default applies",
        "note: --seq-length / --encoder-seq-length absent: Megatron requires it; ptdp's default applies"]


def _dataclass_defaults(relative: str, cls: str, names) -> dict:
    """The defaults of some fields of a megatron-core dataclass, read from its installed source:
    parsing is enough, and importing megatron.core (torch, apex warnings) would cost seconds."""
    try:   # find_spec raises, rather than answering None, when the parent `megatron` is absent
        spec = importlib.util.find_spec("megatron.core")
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        pytest.skip("megatron-core is not installed")
    tree = ast.parse((Path(spec.submodule_search_locations[0]) / relative).read_text())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls).body
    out = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) in names:
            value = node.value
            if isinstance(value, ast.Call):   # field(default=...)
                value = next(k.value for k in value.keywords if k.arg == "default")
            out[node.target.id] = eval(compile(ast.Expression(value), cls, "eval"), {})
    assert set(out) == set(names), f"{cls} lacks {set(names) - set(out)}"
    return out


# megatron-core field -> (the Megatron argument, ptdp's key)
CORE_DEFAULTS = {
    ("transformer/transformer_config.py", "TransformerConfig"): {
        "hidden_dropout": ("--hidden-dropout", "model.dropout"),
        "init_method_std": ("--init-method-std", "model.init_std"),
        "layernorm_epsilon": ("--norm-epsilon", "model.layernorm_eps")},
    ("optimizer/optimizer_config.py", "OptimizerConfig"): {
        "adam_beta1": ("--adam-beta1", "train.adam_beta1"),
        "adam_beta2": ("--adam-beta2", "train.adam_beta2"),
        "adam_eps": ("--adam-eps", "train.adam_eps"),
        "weight_decay": ("--weight-decay", "train.weight_decay"),
        "clip_grad": ("--clip-grad", "train.clip_grad"),
        "initial_loss_scale": ("--initial-loss-scale", "train.initial_loss_scale")},
}


def test_the_defaults_written_are_megatron_cores_where_ptdps_differ():
    from ptdp.config import Config
    ptdp = Config().to_dict()
    for (relative, cls), fields in CORE_DEFAULTS.items():
        core = _dataclass_defaults(relative, cls, fields)
        for name, (flag, key) in fields.items():
            section, option = key.split(".")
            written = values(["--fp16"]).get(key)
            if core[name] == ptdp[section][option]:
                assert written is None, f"{flag}: ptdp's default equals Megatron's, nothing to write"
            else:
                assert written == core[name], f"{flag}: Megatron's default {core[name]} is not written"
    optimizer = _dataclass_defaults("optimizer/optimizer_config.py", "OptimizerConfig",
                                    ("hysteresis", "loss_scale_window", "min_loss_scale"))
    assert optimizer["hysteresis"] == 2 and any("--hysteresis absent" in line for line in lines(["--fp16"]))
    assert (lookup("--loss-scale-window").convert(optimizer["loss_scale_window"], {}),
            lookup("--min-loss-scale").convert(optimizer["min_loss_scale"], {})) == ({}, {})
    core = _dataclass_defaults("transformer/transformer_config.py", "TransformerConfig",
                               ("attention_dropout", "add_bias_linear"))
    assert core["attention_dropout"] == 0.1 and core["add_bias_linear"] is True


def test_under_torchrun_rank_zero_says_it_once_and_the_restart_loop_is_told_not_to_retry(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PTDP_EXIT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["train", str(ROOT / "configs" / "gpt_tiny.yaml"), "--seq-length", "64"]) == 2
    assert capsys.readouterr().err == ""
    assert (tmp_path / "rank1").read_text() == "2\n"


def test_recompute_modules_translate_with_megatrons_selective_default():
    """Megatron's selective granularity recomputes core_attn unless --recompute-modules says
    otherwise; ptdp's default differs (ptdp/config/recompute.py), so it is written in."""
    v = translate(["--recompute-granularity", "selective"]).values
    assert (v["train.recompute"], v["train.recompute_modules"]) == ("selective", ["core_attn"])
    v = translate(["--recompute-activations", "--recompute-modules", "layernorm", "mlp"]).values
    assert v["train.recompute_modules"] == ["layernorm", "mlp"]
    assert "train.recompute_modules" not in translate(["--recompute-granularity", "full"]).values


@pytest.mark.parametrize("pattern, layout", [([1, 1, 1, 1], (1, 0)), ([0, 1, 0, 1], (2, 1)),
                                             ([0, 0, 1, 1], (1, 2)), ([1, 1, 0, 1], None),
                                             ([0, 0, 0, 0], None)])
def test_a_moe_layer_pattern_is_read_one_way_from_flags_and_checkpoints(pattern, layout):
    """--moe-layer-freq as a list, on a command line and in a checkpoint's args: one reading
    (moe_args.pattern_layout); what ptdp cannot place is refused by both."""
    from ptdp.megatron.moe_args import _layer_pattern, pattern_layout
    from ptdp.megatron.errors import MegatronConversionError
    assert pattern_layout(pattern) == layout
    words = ["--num-experts", "4", "--num-layers", "4", "--moe-layer-freq", str(pattern)]
    if layout is None:
        assert any(line.startswith("refused: --moe-layer-freq") for line in lines(words))
        with pytest.raises(MegatronConversionError, match="--moe-layer-freq"):
            _layer_pattern(pattern, 4)
    else:
        assert _layer_pattern(pattern, 4) == layout
        assert values(words)["model.moe_layer_freq"] == layout[0]
