"""What cannot be reproduced is refused: one line naming the setting, exit code 2, nothing
written; and `ptdp generate`'s out-of-range arguments are refused by its parser."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.optional import needs
transformers = needs("transformers")

from ptdp.cli import main  # noqa: E402
from tests.deadline import within

GPT2 = dict(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=8, bos_token_id=None,
            eos_token_id=None)
LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=2, max_position_embeddings=8, bos_token_id=None,
             eos_token_id=None)


def _gpt2(**kw):
    return transformers.GPT2Config(**{**GPT2, "activation_function": "gelu", **kw})


def _edit_config(**changes):
    def edit(path: Path):
        config = json.loads((path / "config.json").read_text())
        config.update(changes)
        (path / "config.json").write_text(json.dumps(config))
    return edit


def _write(name: str, text: str | bytes):
    def edit(path: Path):
        (path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return edit


def _integer_tensor(path: Path):
    """One weight stored as int32 (as a quantized or mis-written file has them)."""
    import torch
    from safetensors.torch import load_file, save_file
    weights = load_file(path / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name].to(torch.int32)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def _truncate(path: Path):
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


# name: (config of the saved model, edit of the saved directory, expected part of the message)
CASES = {
    "relu": (_gpt2(activation_function="relu"), None, "activation_function is 'relu'"),
    "inverse_layer_idx": (_gpt2(scale_attn_by_inverse_layer_idx=True), None,
                          "scale_attn_by_inverse_layer_idx=True"),
    "unscaled": (_gpt2(scale_attn_weights=False), None, "scale_attn_weights=False"),
    "cross_attention": (_gpt2(add_cross_attention=True), None, "add_cross_attention=True"),
    "hidden_act": (transformers.LlamaConfig(**LLAMA, hidden_act="gelu"), None,
                   "hidden_act is 'gelu'"),
    "attention_bias": (transformers.LlamaConfig(**LLAMA, attention_bias=True), None,
                       "attention_bias=True"),
    "mlp_bias": (transformers.LlamaConfig(**LLAMA, mlp_bias=True), None, "mlp_bias=True"),
    "rope_linear": (transformers.LlamaConfig(**LLAMA, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), None, "rope_type='linear'"),
    "rope_dynamic": (transformers.LlamaConfig(**LLAMA, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), None, "rope_type='dynamic'"),
    "gemma2_softcapping": (transformers.Gemma2Config(**LLAMA, head_dim=8), None,
                           "Gemma 2's final_logit_softcapping=30.0, attn_logit_softcapping=50.0 "
                           "soft-caps"),
    "gemma3_sandwich": (transformers.Gemma3TextConfig(**LLAMA, head_dim=8), None,
                        "Gemma 3's sandwich norms (post_attention_layernorm and "
                        "post_feedforward_layernorm"),
    "phi3_longrope": (transformers.Phi3Config(**LLAMA, pad_token_id=0, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
        "long_factor": [2.0] * 4, "original_max_position_embeddings": 4}), None,
        "rope_type='longrope'"),
    "phi3_partial_rotary": (transformers.Phi3Config(**LLAMA, pad_token_id=0, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}), None,
        "partial_rotary_factor=0.5 rotates only part of each head"),
    "mixtral_jitter": (transformers.MixtralConfig(**LLAMA, num_local_experts=2,
                                                  router_jitter_noise=0.1), None,
                       "router_jitter_noise=0.1"),
    "qwen2_moe_no_experts": (transformers.Qwen2MoeConfig(**LLAMA, num_experts=2,
                                                         mlp_only_layers=[0]), None,
                             "mlp_only_layers=[0] and decoder_sparse_step=1 leave no mixture"),
    "more_layers": (_gpt2(), _edit_config(n_layer=3),
                    "the weights lack 24 tensor(s) that config.json asks for, the first "
                    "'transformer.h.1.ln_1.weight'"),
    "fewer_layers": (_gpt2(n_layer=2), _edit_config(n_layer=1),
                     "config.json has no place for, the first 'transformer.h.1."),
    "separate_head_missing": (_gpt2(), _edit_config(tie_word_embeddings=False),
                              "lack 1 tensor(s) that config.json asks for, the first "
                              "'lm_head.weight'"),
    "corrupt_weights": (_gpt2(), _write("model.safetensors", b"not a safetensors file"),
                        "cannot read the weights"),
    "truncated_weights": (_gpt2(), _truncate, "cannot read the weights"),
    "integer_weights": (_gpt2(), _integer_tensor, "is I32, not floating point"),
    "no_weights": (_gpt2(), lambda path: (path / "model.safetensors").unlink(),
                   "has no model.safetensors"),
    "config_not_json": (_gpt2(), _write("config.json", "{not json"),
                        "config.json is not valid JSON"),
    "no_model_type": (_gpt2(), _write("config.json", '{"n_layer": 1}'), "has no model_type"),
    "unknown_model_type": (_gpt2(), _write("config.json", '{"model_type": "t5"}'),
                           "model_type 't5' is not one ptdp converts: gpt2, megatron-bert, "
                           "llama, mistral, qwen2, qwen3, gemma, phi3, mixtral, qwen2_moe, qwen3_moe"),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    from transformers.utils import logging
    logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("refused")
    for name, (config, edit, _) in CASES.items():
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(root / name))
        if edit:
            edit(root / name)
    return root


@pytest.mark.parametrize("case", list(CASES))
def test_conversion_from_hf_is_refused_in_one_line(case, hf_dirs, tmp_path, capsys):
    code = main(["convert", str(hf_dirs / case), "--from", "hf", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("ptdp convert: ") and CASES[case][2] in err, err
    assert not (tmp_path / "out").exists()


def test_a_directory_without_tokenizer_files_converts_with_a_note(tmp_path, capsys):
    transformers.AutoModelForCausalLM.from_config(_gpt2()).save_pretrained(str(tmp_path / "hf"))
    assert main(["convert", str(tmp_path / "hf"), "--from", "hf", "--out",
                 str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no tokenizer files" in err[0], err


def test_the_command_line_refuses_without_a_traceback(hf_dirs, tmp_path):
    run = subprocess.run([sys.executable, "-m", "ptdp", "convert", str(hf_dirs / "corrupt_weights"),
                          "--from", "hf", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=within(120))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "cannot read the weights" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "-5"], "argument --max-new-tokens: must be at least 1, got -5"),
    (["--temperature", "-0.5"], "argument --temperature: must be >= 0"),
    (["--top-p", "0"], "argument --top-p: must be in (0, 1]"),
    (["--top-p", "1.5"], "argument --top-p: must be in (0, 1]"),
    (["--top-k", "-1"], "argument --top-k: must be >= 0"),
    (["--top-k", "2.5"], "argument --top-k: must be a whole number"),
])
def test_generate_refuses_out_of_range_arguments(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", str(tmp_path), "--prompt", "x", *args])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("ptdp generate: ") and message in err, err
