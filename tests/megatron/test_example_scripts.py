"""Megatron-LM's own example launch scripts (tests/megatron/examples/, copied from Megatron-LM
0.16.1 and main) through `ptdp config from-megatron --script`: each translates with exit 0 into
the keys below, passes `ptdp check` once shrunk to four CPU ranks, and trains a few iterations
(one spawned job of two ranks for all four). The Mixtral script becomes a mixture of experts
with expert parallelism; Megatron's run-time adjustments, the scripts' conditional branches and
BERT's sample order are noted.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from ptdp import cli
from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within

EXAMPLES = Path(__file__).resolve().parent / "examples"
BERT, LLAMA, MIXTRAL, GPT3 = ("train_bert_340m_distributed", "train_llama3_8b_h100_fp8",
                              "train_mixtral_8x7b_distributed", "train_gpt3_175b_distributed")
GPT3_STEPS = "train_gpt3_175b_distributed.step_schedule"   # main's: --step-batch-size-schedule

# What each translation must hold (a subset of its keys), and the lines it must print.
EXPECTED = {
    BERT: ({"model.arch": "bert", "model.num_layers": 24, "model.hidden_size": 1024,
            "parallel.tensor": 8, "parallel.pipeline": 16, "train.precision": "fp16",
            "data.source": "indexed", "data.paths": ["$4"]},
           ["note: --data-path $4: bert keeps ptdp's sample order (data.sampling: ptdp)"]),
    LLAMA: ({"model.norm_zero_centered": True, "model.activation": "swiglu",
             "model.num_kv_heads": 8, "model.ffn_hidden_size": 14336, "model.vocab_size": 128257,
             "train.precision": "bf16", "train.grad_reduce_dtype": "bf16",
             "data.source": "synthetic", "parallel.tensor": 1},
            ["note: --sequence-parallel: not written: Megatron-LM turns sequence parallelism "
             "off when --tensor-model-parallel-size is 1",
             "approximate: --fp8-format hybrid: ptdp has no FP8 matrix multiplications: trains "
             "in bf16",
             "conditional: if [[ \"$DTYPE\" == \"fp8\" ]]: only the 'then' branch applied: it "
             "tests DTYPE=fp8",
             "conditional: if [[ \"$TOKENIZER_ARG\" == \"MOCK\" ]] || [[ \"$DATA_ARG\" == \"MOCK\" ]]"
             " || [[ -z \"$TOKENIZER_ARG\" ]]: only the 'then' branch applied: it tests "
             "TOKENIZER_ARG=MOCK (the default of $3), DATA_ARG=MOCK (the default of $4)"]),
    MIXTRAL: ({"model.num_experts": 8, "model.moe_top_k": 2, "model.moe_aux_loss_coeff": 0.01,
               "parallel.expert": 8, "parallel.pipeline": 4, "model.bias": False,
               "train.distributed_optimizer": True},
              ["conditional: if [ -n \"${WANDB_API_KEY}\" ]: no branch applied: it tests "
               "WANDB_API_KEY (not set in the script)",
               "ignored: --moe-grouped-gemm: a kernel or communication choice"]),
    GPT3: ({"train.rampup_batch_size": [16, 16, 5859375], "train.global_batch_size": 1536,
            "train.lr_decay_samples": 430000 * 1536, "model.activation": "gelu_tanh"},
           ["note: --train-iters 500000: a batch ramp in an iteration-based run"]),
    GPT3_STEPS: ({"train.rampup_batch_size": [16, 304, 12 * 10 ** 9 // 2048],
                  "train.global_batch_size": 1536, "train.lr_decay_samples": 430000 * 1536},
                 ["note: --train-iters 500000: a batch ramp in an iteration-based run"]),
}


def _translate(name: str, tmp_path, capsys) -> tuple[dict, list[str]]:
    out = tmp_path / f"{name}.yaml"
    rc = cli.main(["config", "from-megatron", "--script", str(EXAMPLES / f"{name}.sh"),
                   "--out", str(out)])
    err = capsys.readouterr().err.splitlines()
    assert rc == 0, err
    raw = yaml.safe_load(out.read_text())
    return {f"{s}.{k}": v for s, keys in raw.items() for k, v in keys.items()}, err


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_example_script_translates_with_exit_0(name, tmp_path, capsys):
    values, err = _translate(name, tmp_path, capsys)
    keys, lines = EXPECTED[name]
    assert {k: values.get(k) for k in keys} == keys
    for line in lines:
        assert any(got.strip().startswith(line) for got in err), (line, err)
    assert not any(got.strip().startswith("refused") for got in err if "--decoupled" not in got
                   and "per-token" not in got and "exit-duration" not in got), err
    assert "parallel.sequence_parallel" not in values   # (every script has t = 1 or no flag)
    assert name == BERT or "data.sampling" not in values or values["data.source"] == "indexed"


# Shrunk to a few CPU ranks: a tiny model, synthetic tokens (the scripts' data and tokenizer
# are arguments), the script's structure kept (MoE, expert parallelism, the ramp, the norm).
TINY = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
        "model.ffn_hidden_size=64", "model.seq_length=16", "model.vocab_size=128",
        "data.source=synthetic", "data.paths=[]", "data.tokenizer=null", "data.sampling=ptdp",
        "log.tensorboard_dir=null", "train.micro_batch_size=1", "train.global_batch_size=8",
        "train.timeout_s=60"]
SHRUNK = {   # name: (the check's layout on 4 ranks, the training's on 2, the run's length)
    BERT: (["parallel.tensor=2", "parallel.pipeline=2"], ["parallel.tensor=1",
                                                          "parallel.pipeline=2"],
           ["train.iters=2", "train.lr_decay_iters=2"]),
    LLAMA: (["model.num_kv_heads=2"], ["model.num_kv_heads=2"],
            ["train.train_samples=16", "train.lr_decay_samples=16", "train.lr_warmup_samples=8"]),
    MIXTRAL: (["model.num_kv_heads=2", "model.num_experts=4", "parallel.pipeline=2",
               "parallel.expert=2"], ["model.num_kv_heads=2", "model.num_experts=4",
                                      "parallel.pipeline=1", "parallel.expert=2"],
              ["train.iters=2", "train.lr_decay_iters=2", "train.lr_warmup_iters=1"]),
    GPT3: (["parallel.tensor=2", "parallel.pipeline=2"], ["parallel.tensor=2",
                                                          "parallel.pipeline=1"],
           ["train.global_batch_size=4", "train.rampup_batch_size=[2,2,4]",
            "train.train_samples=12", "train.lr_decay_samples=12"]),
}


def _shrunk(name: str, values: dict, tmp_path, layout: list[str]) -> list[str]:
    return TINY + layout + SHRUNK[name][2] + [f"checkpoint.dir={tmp_path / name}"]


@pytest.mark.parametrize("name", list(SHRUNK))
def test_each_translation_shrunk_to_four_cpu_ranks_passes_ptdp_check(name, tmp_path, capsys):
    values, _ = _translate(name, tmp_path, capsys)
    overrides = _shrunk(name, values, tmp_path, SHRUNK[name][0])
    rc = cli.main(["check", str(tmp_path / f"{name}.yaml"), "--world-size", "4", *overrides])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "is ready to train on 4 rank(s)" in out.out


def _train_each(configs: list[tuple[str, str, list[str]]]) -> dict:
    """On every rank: a few iterations of each shrunk translation."""
    from ptdp.config import load_config
    from ptdp.training import Trainer

    out = {}
    for name, path, overrides in configs:
        cfg = load_config(path, overrides, world_size=dist.get_world_size())
        trainer = Trainer(cfg)
        records = [trainer.train_step(it) for it in range(cfg.train.iters)]
        out[name] = {"losses": [r.loss for r in records], "aux": records[0].aux_losses,
                     "batches": [trainer.state.batches.batch_size(it)
                                 for it in range(cfg.train.iters)],
                     "experts": (cfg.model.num_experts, cfg.parallel.expert),
                     "zero_centred": cfg.model.norm_zero_centered}
    return out


def test_a_tiny_version_of_each_trains_a_few_iterations(tmp_path, capsys):
    configs = []
    for name in SHRUNK:
        values, _ = _translate(name, tmp_path, capsys)
        configs.append((name, str(tmp_path / f"{name}.yaml"),
                        _shrunk(name, values, tmp_path, SHRUNK[name][1])))
    rank0 = run_on_ranks(2, _train_each, configs, timeout_s=within(240))[0]
    for name, result in rank0.items():
        assert result["losses"] and all(math.isfinite(x) for x in result["losses"]), name
    assert rank0[MIXTRAL]["experts"] == (4, 2) and rank0[MIXTRAL]["aux"]["moe_aux_loss"] > 0
    assert rank0[LLAMA]["zero_centred"] is True
    assert rank0[GPT3]["batches"] == [2, 2, 4, 4]   # the ramp [2, 2, 4] up to B = 4: 12 samples
