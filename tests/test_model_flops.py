"""The FLOP and parameter formulas against the real models: GPT's Eq. 4.2, its generalisation
to Llama-style blocks and BERT's own formula equal what torch's FLOP counter sees in a forward +
backward pass; the parameter counts equal the models' (ptdp's, and Hugging Face's Llama and
Qwen2); the trainer reports TFLOP/s with the model's formula."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ptdp.models import build_chunk
from ptdp.models.transformer import ModelContext
from ptdp.config import ModelConfig, config_from_dict
from ptdp.data.synthetic import synthetic_datasets
from ptdp.metrics.throughput import iteration_tflops
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from ptdp.planner.compute import ModelShape
from ptdp.planner.formulas import (bert_parameter_count, decoder_parameters, iteration_flops,
                                   model_flops)
from ptdp.planner.memory import stage_parameters
from tests.optional import needs

L, H, A, S, V, B = 2, 32, 4, 16, 128, 3
# Model options beyond the sizes: GPT-2's block, BERT, a Llama-style block with 2 K/V heads,
# and one with the other block options (a head size of 12: Q is 48 wide on h = 32).
BLOCKS = {"gpt": {}, "bert": {"arch": "bert"}, "llama": {"preset": "llama", "num_kv_heads": 2},
          "blocks": {"preset": "llama", "num_kv_heads": 2, "head_dim": 12, "qk_norm": True,
                     "activation": "geglu", "norm_zero_centered": True, "scale_embeddings": True}}


def _chunk(arch):
    cfg = ModelConfig(**{"arch": "gpt", **BLOCKS[arch]}, num_layers=L, hidden_size=H,
                      num_heads=A, seq_length=S, vocab_size=V, dropout=0.0)
    ctx = ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")), V)
    return cfg, build_chunk(ctx, 0, 1)


@pytest.mark.parametrize("arch", sorted(BLOCKS))
def test_flop_formula_equals_the_counted_matmuls(arch):
    cfg, chunk = _chunk(arch)
    data = synthetic_datasets(cfg, 3)["train"]
    batch = torch.utils.data.default_collate([data[i] for i in range(B)])
    with FlopCounterMode(display=False) as counter:
        loss = chunk(None, batch)
        (loss[0] if isinstance(loss, tuple) else loss).backward()
    counted = counter.get_total_flops()
    ops = {str(op) for op in counter.get_flop_counts()["Global"]}
    if not any("attention" in op for op in ops):
        # torch's counter does not see the CPU SDPA kernel: add its QK^T and AV matmuls,
        # forward and backward (3 x 4 B s^2 h per layer), as Eq. 4.2 counts them.
        counted += 3 * L * 4 * B * S * S * A * cfg.head_dim
    if arch == "bert":
        # The formula counts BERT's masked-LM head (its dense layer and the logits) on every
        # token, as Megatron's and Hugging Face's models compute it; ptdp's runs it on the
        # masked positions only (models/bert.py): forward and backward of the others skipped.
        unmasked = B * S - int(batch["loss_mask"].sum())
        counted += 3 * unmasked * (2 * H * H + 2 * H * V)
    assert counted == iteration_flops(ModelShape.from_config(cfg), B, V, recompute_forward=False)
    if arch in ("gpt", "bert"):   # the dissertation's block: the arch's own formula, unchanged
        assert counted == model_flops(arch, B, S, L, H, V, recompute_forward=False)


@pytest.mark.parametrize("arch", ["gpt", "llama", "blocks"])
def test_decoder_parameters_equal_the_model(arch):
    cfg, chunk = _chunk(arch)
    shape = ModelShape.from_config(cfg)
    params = sum(p.numel() for p in chunk.parameters())
    assert decoder_parameters(shape) == params
    assert stage_parameters(shape, 1, 1, V, True, True) == params


def test_bert_parameters_equal_the_model():
    cfg, chunk = _chunk("bert")
    params = sum(p.numel() for p in chunk.parameters())
    assert bert_parameter_count(L, H, V, S, cfg.num_tokentypes) == params
    shape = ModelShape("bert", L, H, A, 4 * H, S, V, False)
    assert stage_parameters(shape, 1, 1, V, True, True) == params


def test_trainer_tflops_use_the_bert_formula():
    raw = {"model": {"arch": "bert", "num_layers": L, "hidden_size": H, "num_heads": A,
                     "seq_length": S, "vocab_size": V},
           "train": {"micro_batch_size": 1, "global_batch_size": B}}
    cfg = config_from_dict(raw)
    expected = model_flops("bert", B, S, L, H, cfg.padded_vocab_size, False) / 2.0 / 1 / 1e12
    assert iteration_tflops(cfg, 2.0, 1) == pytest.approx(expected)
    gpt = config_from_dict({**raw, "model": {**raw["model"], "arch": "gpt"}})
    assert iteration_tflops(gpt, 2.0, 1) < iteration_tflops(cfg, 2.0, 1)


def test_trainer_tflops_use_the_block_formula():
    raw = {"model": {"arch": "gpt", "preset": "llama", "num_layers": L, "hidden_size": H,
                     "num_heads": A, "num_kv_heads": 2, "seq_length": S, "vocab_size": V},
           "train": {"micro_batch_size": 1, "global_batch_size": B}}
    cfg = config_from_dict(raw)
    shape = ModelShape.from_config(cfg.model)
    expected = iteration_flops(shape, B, cfg.padded_vocab_size, False) / 2.0 / 1 / 1e12
    assert iteration_tflops(cfg, 2.0, 1) == pytest.approx(expected)
    # not Eq. 4.2's GPT-2 block of the same sizes (K/V narrower, MLP 3 x h x 256 wide)
    eq42 = model_flops("gpt", B, S, L, H, cfg.padded_vocab_size, False) / 2.0 / 1 / 1e12
    assert iteration_tflops(cfg, 2.0, 1) != pytest.approx(eq42)


# Hugging Face's decoders, counted by the general Eq. 4.3: (class, config, its biases).
HF_SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=160, vocab_size=1000, num_hidden_layers=2,
                max_position_embeddings=128)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("model, biases", [
    ("llama", {}),                                                     # Llama: none
    ("llama", {"attention_bias": True, "mlp_bias": True}),             # model.bias
    ("qwen2", {}),                                                     # Q, K, V only
])
def test_general_parameter_count_equals_hugging_face(model, biases, tie):
    transformers = needs("transformers")
    if model == "llama":
        config = transformers.LlamaConfig(**HF_SMALL, tie_word_embeddings=tie, **biases)
        net = transformers.LlamaForCausalLM(config)
        bias = qkv_bias = bool(biases)
    else:
        config = transformers.Qwen2Config(**HF_SMALL, tie_word_embeddings=tie)
        net = transformers.Qwen2ForCausalLM(config)
        bias, qkv_bias = False, True
    shape = ModelShape("gpt", 2, 64, 4, 160, 128, 1000, False, kv_heads=2, activation="swiglu",
                       normalization="rmsnorm", position_embedding="rope", bias=bias,
                       qkv_bias=qkv_bias, tie_embeddings=tie)
    assert decoder_parameters(shape) == sum(p.numel() for p in net.parameters())
