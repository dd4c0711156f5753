"""Every checkpoint `ptdp convert --to megatron` writes passes Megatron-LM's own load checks,
reproduced from its source in tests/megatron/megatron_lm.py: `check_checkpoint_args` with
the run's values from the load command ptdp prints, and every argument
`load_args_from_checkpoint` reads present in the written args. Pure functions over GPT-2-,
Llama- and BERT-style models and a mixture of experts, every tokenizer kind, both formats
and several splits; test_checkpoint_convert.py applies the same check to the files written.
"""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

from ptdp.config import ModelConfig
from ptdp.megatron.arguments import lookup
from ptdp.megatron.load_command import load_flags
from ptdp.megatron.model_args import megatron_args, model_config
from ptdp.megatron.tokenizer_args import tokenizer_args
from tests.megatron import megatron_lm
from tests.optional import skip_without

MODELS = {
    "gpt2": dict(arch="gpt", preset="gpt", vocab_size=50304),
    "llama": dict(arch="gpt", preset="llama", num_kv_heads=2, vocab_size=32000,
                  rope_theta=500000.0, rope_scaling_factor=8.0, max_position_embeddings=8192),
    "bert": dict(arch="bert", vocab_size=30592),
    "gpt2_tanh_1p": dict(arch="gpt", preset="gpt", vocab_size=50257, activation="gelu_tanh",
                         norm_zero_centered=True),
    "moe": dict(arch="gpt", preset="llama", vocab_size=32000, num_experts=4, moe_top_k=2,
                moe_ffn_hidden_size=48, moe_shared_ffn_hidden_size=32,
                moe_shared_expert_gate=True, moe_first_dense_layers=1, moe_aux_loss_coeff=0.01,
                moe_z_loss_coeff=0.001, moe_expert_bias_rate=0.001, moe_score_function="sigmoid",
                num_layers=3),
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """A file of each tokenizer kind ptdp reads (None: token ids, no tokenizer)."""
    root = tmp_path_factory.mktemp("tok")
    (root / "gpt2-vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
    (root / "gpt2-merges.txt").write_text("#version: 0.2\na b\n")
    (root / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\n")
    (root / "hf").mkdir()
    (root / "hf" / "tokenizer.json").write_text("{}")
    (root / "spm.model").write_bytes(b"")
    return {"null": None, "gpt2": root / "gpt2-vocab.json", "wordpiece": root / "vocab.txt",
            "hf": root / "hf" / "tokenizer.json", "spm": root / "spm.model"}


def _written(model: str, tokenizer, fmt: str, tensor: int, pipeline: int) -> tuple:
    from ptdp.megatron.checkpoint import padded_vocab
    cfg = ModelConfig(**MODELS[model])
    args = megatron_args(cfg, {"tensor": tensor, "pipeline": pipeline},
                         padded_vocab(cfg.vocab_size, tensor),
                         {"iteration": 7, "consumed_samples": 56, "global_batch_size": 8},
                         "transformer_engine", fmt,
                         tokenizer_args(None if tokenizer is None else str(tokenizer),
                                        cfg.vocab_size))
    return cfg, args, load_flags(args, split=fmt == "torch")


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("kind", ["null", "gpt2", "wordpiece", "hf", "spm"])
@pytest.mark.parametrize("fmt, tensor, pipeline", [("torch", 1, 1), ("torch", 2, 2),
                                                   ("torch", 4, 1), ("torch_dist", 1, 1)])
def test_megatron_lm_accepts_what_ptdp_writes(tokenizers, model, kind, fmt, tensor, pipeline):
    cfg, args, words = _written(model, tokenizers[kind], fmt, tensor, pipeline)
    missing = [n for n in megatron_lm.LOADED + megatron_lm.PROGRESS if not hasattr(args, n)]
    assert missing == []
    flags = [w for w in words if w.startswith("--")]
    assert [f for f in flags if lookup(f) is None] == []   # all Megatron-LM's spellings
    run = megatron_lm.run_args(words, cfg.vocab_size)
    assert bool(run.vocab_file) == (kind in ("gpt2", "wordpiece"))   # then it compares more
    megatron_lm.check_checkpoint_args(args, run, 3.0)
    same = dict(vars(cfg), vocab_size=args.padded_vocab_size,
                attention_dropout=cfg.attention_dropout_rate)
    assert model_config(args, cfg.arch) == ModelConfig(**same)   # read back: the same model


def test_the_reproduced_check_fails_where_megatron_lm_failed(tokenizers):
    """Issue 33's two failures, on the args ptdp wrote before: a rotary model loaded without
    --no-position-embedding, and a --vocab-file tokenizer with no tokenizer_type saved."""
    _, args, words = _written("llama", tokenizers["gpt2"], "torch", 1, 1)
    run = megatron_lm.run_args([w for w in words if w != "--no-position-embedding"], 32000)
    with pytest.raises(AssertionError, match="add_position_embedding value from checkpoint "
                                             r"\(False\) is not equal to the input argument "
                                             r"value \(True\)"):
        megatron_lm.check_checkpoint_args(args, run, 3.0)
    old = Namespace(**{k: v for k, v in vars(args).items() if k != "tokenizer_type"})
    with pytest.raises(AttributeError, match="tokenizer_type"):
        megatron_lm.check_checkpoint_args(old, megatron_lm.run_args(words, 32000), 3.0)


# The checkpoint keeps the vocabulary as a tokenizer.json, which `tokenizers` builds.
@pytest.mark.parametrize("kind, megatron_type", [
    pytest.param("gpt2", "GPT2BPETokenizer", marks=skip_without("tokenizers")),
    pytest.param("wordpiece", "BertWordPieceLowerCase", marks=skip_without("tokenizers")),
    ("null", "NullTokenizer")])
def test_written_files_pass_with_the_printed_command(tokenizers, kind, megatron_type, tmp_path):
    """A ptdp checkpoint trained with each tokenizer kind, written as legacy files split
    (2, 2): every file's args pass Megatron-LM's check against the printed command."""
    from ptdp.checkpoint.save import conversion_config, save_full_state
    from ptdp.inference.local_model import initial_state
    from ptdp.megatron.checkpoint import to_megatron_checkpoint
    model = ModelConfig(arch="gpt", preset="llama", num_layers=2, hidden_size=32, num_heads=4,
                        num_kv_heads=2, vocab_size=64, seq_length=16)
    tokenizer = tokenizers[kind]
    cfg = conversion_config(model, [], None if tokenizer is None else str(tokenizer))
    save_full_state(initial_state(model, 0), cfg, tmp_path / "ptdp", iteration=3)
    info = to_megatron_checkpoint(tmp_path / "ptdp", tmp_path / "meg", 2, 2, ckpt_format="torch")
    assert info["args"].tokenizer_type == megatron_type
    assert ("--vocab-file" in info["load_flags"]) == (kind != "null")
    assert megatron_lm.assert_loads(info["directory"], info["load_flags"], 64) == 4
