"""The model families beside GPT-2/BERT/Llama's 4-rank test (tests/hf/test_convert.py), in one
process: HF -> ptdp -> HF gives transformers' logits and the same weights, and ptdp -> HF picks
the class from the block options."""

from __future__ import annotations

import pytest
import torch

from tests.optional import needs
transformers = needs("transformers")

from ptdp.cli import main  # noqa: E402
from ptdp.config import load_config  # noqa: E402
from ptdp.hf.convert import from_hf, to_hf  # noqa: E402
from ptdp.inference.local_model import LocalModel, initial_state  # noqa: E402
from tests.hf.hf_models import (MODEL_TYPE, logits_diff, random_hf_model,  # noqa: E402
                                released_configs, same_state)

VOCAB, SEQ = 200, 16
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=SEQ, bos_token_id=None,
               eos_token_id=None)
FAMILIES = {
    # multi-query attention, tied embeddings, no window
    "mistral": (transformers.MistralConfig(**DECODER, num_key_value_heads=1, sliding_window=None,
                                           tie_word_embeddings=True), "LlamaForCausalLM"),
    # q/k/v biases, grouped-query attention, untied
    "qwen2": (transformers.Qwen2Config(**DECODER, num_key_value_heads=2,
                                       tie_word_embeddings=False), "Qwen2ForCausalLM"),
    # a separate lm_head (ptdp's untied output layer), exact GeLU
    "gpt2": (transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=SEQ, activation_function="gelu",
                                     tie_word_embeddings=False, bos_token_id=None,
                                     eos_token_id=None), "GPT2LMHeadModel"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_to_ptdp_to_hf(family, tmp_path):
    config, back_class = FAMILIES[family]
    original = random_hf_model(config, tmp_path / "hf")
    layout = "parallel.pipeline=2" if family == "mistral" else "parallel.tensor=2"  # 1 K/V head
    final, cfg = from_hf(tmp_path / "hf", tmp_path / "ckpt", [layout])
    assert cfg.model.tie_embeddings == config.tie_word_embeddings
    assert logits_diff(LocalModel.from_checkpoint(final), original, VOCAB, SEQ) < 1e-5
    info = to_hf(final, tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert info["class"] == type(back).__name__ == back_class
    if family != "mistral":   # Mistral comes back as Llama: the same names and weights
        assert same_state(original.state_dict(), back.state_dict())
    assert logits_diff(LocalModel.from_checkpoint(final), back, VOCAB, SEQ) < 1e-5


RELEASED = released_configs()


@pytest.mark.parametrize("family", list(RELEASED))
def test_released_shapes_convert_exactly_both_ways_and_generate_alike(family, tmp_path):
    """HF -> (p, t) = (2, 2) checkpoint -> HF: transformers' logits within 1e-5 both ways, the
    same weights under the same class, and greedy decoding gives transformers' tokens."""
    from ptdp.inference.generate import Sampling, generate
    original = random_hf_model(RELEASED[family], tmp_path / "hf", std=0.3)
    final, _ = from_hf(tmp_path / "hf", tmp_path / "ckpt",
                       ["parallel.pipeline=2", "parallel.tensor=2"])
    ours = LocalModel.from_checkpoint(final)
    assert logits_diff(ours, original, 128, 24) < 1e-5
    to_hf(final, tmp_path / "back", model_type=MODEL_TYPE.get(family))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert type(back) is type(original) and same_state(original.state_dict(), back.state_dict())
    prompt = [11, 60, 37, 5, 99, 120, 8, 77]
    with torch.no_grad():
        theirs = original.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10,
                                   attention_mask=torch.ones(1, 8, dtype=torch.long))
    greedy = generate(ours, prompt, 10, Sampling())
    assert greedy == theirs[0, 8:].tolist() and len(set(greedy)) > 1   # not one token repeated


def _checkpoint(tmp_path, *model_keys):
    from ptdp.checkpoint.save import save_full_state
    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
                             f"model.seq_length={SEQ}", f"model.vocab_size={VOCAB}", *model_keys])
    return save_full_state(initial_state(cfg.model, 3), cfg, tmp_path / "ckpt")


def test_a_ptdp_llama_block_with_qkv_biases_is_qwen2(tmp_path):
    final = _checkpoint(tmp_path, "model.preset=llama", "model.qkv_bias=true",
                        "model.num_kv_heads=2", "model.rope_theta=1000")
    assert to_hf(final, tmp_path / "hf")["class"] == "Qwen2ForCausalLM"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert logits_diff(LocalModel.from_checkpoint(final), hf, VOCAB, SEQ) < 1e-5


def test_a_model_no_hf_class_computes_is_refused(tmp_path, capsys):
    final = _checkpoint(tmp_path, "model.normalization=rmsnorm")   # GPT-2 block otherwise
    assert main(["convert", str(final), "--to", "hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("ptdp convert: no Hugging Face class computes this model: "
                          "GPT2LMHeadModel needs model.normalization=layernorm (not rmsnorm);"), err
    assert "LlamaForCausalLM" in err and "model.position_embedding=rope (not learned)" in err
    assert not (tmp_path / "hf").exists()


def test_rope_settings_map_both_ways():
    from ptdp.hf.llama import rope_parameters, rope_settings
    config = transformers.LlamaConfig(**DECODER, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8})
    keys = rope_settings(config)
    assert keys == dict(rope_theta=5e5, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                        rope_high_freq_factor=4.0, rope_original_seq_length=8)
    cfg = load_config(None, ["model.preset=llama"] + [f"model.{k}={v}" for k, v in keys.items()])
    assert rope_parameters(cfg.model) == config.rope_parameters
    plain = transformers.LlamaConfig(**DECODER, rope_parameters={"rope_type": "default",
                                                                  "rope_theta": 1e4})
    assert rope_settings(plain) == dict(rope_theta=1e4, rope_scaling_factor=1.0)


def test_qkv_layout_is_group_major():
    """ptdp rows [group, (q heads of the group, k, v), d] <-> HF's separate q, k, v."""
    from ptdp.hf.base import fuse_qkv, split_qkv
    n, g, d = 4, 2, 3
    q = torch.arange(n * d).float().reshape(n * d, 1)
    k, v = 100 + torch.arange(g * d).float()[:, None], 200 + torch.arange(g * d).float()[:, None]
    fused = fuse_qkv(q, k, v, n, g)
    groups = fused.view(g, n // g + 2, d)
    assert torch.equal(groups[1, 0], q[2 * d:3 * d, 0]) and torch.equal(groups[1, 2], k[d:, 0])
    assert torch.equal(groups[0, 3], v[:d, 0])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, n, g), (q, k, v)))


@pytest.mark.parametrize("arch, preset, hidden, attention", [
    ("gpt", "gpt", 0.1, 0.2), ("gpt", "llama", 0.0, 0.2), ("bert", "gpt", 0.1, 0.3)])
def test_hidden_and_attention_dropout_map_both_ways(arch, preset, hidden, attention):
    """Hugging Face keeps the two rates apart (GPT-2's resid/attn_pdrop, BERT's hidden/attention
    probs, Llama's attention only): model.dropout and model.attention_dropout go to their own."""
    from ptdp.config import ModelConfig
    from ptdp.hf.registry import family_of

    cfg = ModelConfig(arch=arch, preset=preset, dropout=hidden, attention_dropout=attention)
    family = family_of(cfg)
    back = family.model_config(family.hf_config(cfg, {}))
    assert (back.dropout, back.attention_dropout_rate) == (hidden, attention)


def test_a_named_model_type_that_cannot_compute_the_model_is_refused(tmp_path, capsys):
    final = _checkpoint(tmp_path, "model.activation=gelu_tanh")   # GPT-2 as released
    assert main(["convert", str(final), "--to", "hf", str(tmp_path / "hf"),
                 "--model-type", "phi3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        "ptdp convert: model_type phi3 (Phi3ForCausalLM) does not compute this model: it needs "
        "model.position_embedding=rope (not learned), model.normalization=rmsnorm (not "
        "layernorm), model.activation=swiglu (not gelu_tanh), model.bias=false (not true), "
        "model.qkv_bias=false (not true)"], err
    assert to_hf(final, tmp_path / "gpt2")["class"] == "GPT2LMHeadModel"
    written = transformers.AutoConfig.from_pretrained(str(tmp_path / "gpt2"))
    assert written.activation_function == "gelu_new"


@pytest.mark.parametrize("step, mlp_only, expected", [
    (1, [], (0, 1)), (1, [0, 1], (2, 1)), (2, [], (1, 2)), (1, [1, 3], (0, 2)),
    (1, [1], r"puts experts in layers \[0, 2, 3\]")])
def test_qwen_moe_layers_map_both_ways_or_are_refused(step, mlp_only, expected):
    """Qwen's MoE layers (i + 1) % decoder_sparse_step == 0, not in mlp_only_layers <-> ptdp's
    every moe_layer_freq-th layer after moe_first_dense_layers."""
    from ptdp.config import ModelConfig
    from ptdp.hf.base import ConversionError
    from ptdp.hf.moe import qwen_moe_config, qwen_moe_layers
    config = transformers.Qwen2MoeConfig(num_hidden_layers=4, num_experts=4,
                                         decoder_sparse_step=step, mlp_only_layers=mlp_only)
    if isinstance(expected, str):
        with pytest.raises(ConversionError, match=expected):
            qwen_moe_layers(config)
        return
    keys = qwen_moe_layers(config)
    assert (keys["moe_first_dense_layers"], keys["moe_layer_freq"]) == expected
    cfg = ModelConfig(arch="gpt", preset="llama", num_layers=4, num_experts=4, **keys)
    back = transformers.Qwen2MoeConfig(num_hidden_layers=4, **qwen_moe_config(cfg))
    assert qwen_moe_layers(back) == keys


def test_node_limited_routing_has_no_mixtral_or_qwen_moe_form():
    """Mixtral's and Qwen's routers choose among all experts: a model with node-limited routing
    is not theirs (ptdp/hf/moe.py)."""
    from ptdp.config import ModelConfig
    from ptdp.hf.moe import Mixtral, Qwen3Moe
    cfg = ModelConfig(preset="llama", num_layers=2, num_kv_heads=2, num_experts=4, moe_top_k=2,
                      moe_router_groups=2, moe_router_group_top_k=1)
    for family in (Mixtral(), Qwen3Moe()):
        assert "model.moe_router_groups=1 (not 2)" in family.mismatches(cfg), family


def test_latent_attention_converts_as_deepseek_v3_or_says_what_it_lacks():
    """Latent attention is DeepSeek-V3's class's only (its latent norms' eps fixed at 1e-6): a
    model it cannot compute is refused in one line naming what that class needs."""
    from ptdp.config import ModelConfig
    from ptdp.hf.registry import ConversionError, family_of
    keys = dict(preset="llama", num_layers=2, head_dim=8, mla_kv_lora_rank=12, mla_rope_head_dim=4)
    assert family_of(ModelConfig(**keys, layernorm_eps=1e-6)).hf_class == "DeepseekV3ForCausalLM"
    with pytest.raises(ConversionError) as err:
        family_of(ModelConfig(**keys, layernorm_eps=1e-5))
    assert str(err.value) == ("no Hugging Face class computes this model: DeepseekV3ForCausalLM "
                              "needs model.layernorm_eps=1e-06 (not 1e-05)")
