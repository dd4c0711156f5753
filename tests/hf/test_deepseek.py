"""DeepSeek-V3 <-> ptdp (ptdp/hf/deepseek.py): a tiny `DeepseekV3ForCausalLM` (latent attention
with DeepSeek's interleaved rotary rows, a dense first layer, then 8 experts in 4 groups with
selection biases and a shared expert) converts to a ptdp checkpoint of (p, t) = (2, 2) with
transformers' logits, and back into a model transformers loads with the same logits; a dense one too."""

from __future__ import annotations

import pytest
import torch

from tests.optional import needs
transformers = needs("transformers")

from tests.hf.hf_models import logits_diff, random_hf_model  # noqa: E402

DEEPSEEK = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=6, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
                n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, rope_interleave=True, max_position_embeddings=64,
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)
DENSE = dict(DEEPSEEK, first_k_dense_replace=4, q_lora_rank=None)
# DeepSeek-V3's own rotary scaling (its config.json): YaRN, which also scales the softmax
YARN = dict(DEEPSEEK, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                                           original_max_position_embeddings=4096, beta_fast=32,
                                           beta_slow=1, mscale=1.0, mscale_all_dim=1.0))


def _hf_dir(path, **keys):
    """A random DeepseekV3ForCausalLM saved in `path`, with random selection biases."""
    model = random_hf_model(transformers.DeepseekV3Config(**keys))
    generator = torch.Generator().manual_seed(5)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("keys", [DEEPSEEK, DENSE, YARN], ids=["moe", "dense", "yarn"])
def test_deepseek_v3_converts_both_ways_with_its_logits(keys, tmp_path):
    from ptdp.hf.convert import from_hf, to_hf
    from ptdp.inference.local_model import LocalModel
    theirs = _hf_dir(tmp_path / "hf", **keys)
    _, cfg = from_hf(tmp_path / "hf", tmp_path / "ptdp", ["parallel.tensor=2",
                                                          "parallel.pipeline=2"])
    m = cfg.model
    assert (m.mla_kv_lora_rank, m.mla_q_lora_rank, m.head_dim, m.mla_rope_head_dim,
            m.mla_v_head_dim) == (12, keys["q_lora_rank"] or 0, 8, 4, 6)
    assert m.rope_scaling_factor == (40.0 if keys is YARN else 1.0)
    if keys is not DENSE:
        assert (m.num_experts, m.moe_top_k, m.moe_router_groups, m.moe_router_group_top_k,
                m.moe_first_dense_layers, m.moe_shared_ffn_hidden_size, m.moe_score_function,
                m.moe_routed_scaling_factor) == (8, 4, 4, 2, 1, 16, "sigmoid", 2.5)
    ours = LocalModel.from_checkpoint(tmp_path / "ptdp")
    assert logits_diff(ours, theirs, 128, 16) < 1e-5
    info = to_hf(tmp_path / "ptdp", tmp_path / "back")
    assert info["class"] == "DeepseekV3ForCausalLM"
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert not back.config.rope_interleave   # ptdp's rotary rows, in halves
    assert logits_diff(ours, back, 128, 16) < 1e-5
    for name, buffer in theirs.named_buffers():
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(back.get_buffer(name), buffer)


@pytest.mark.parametrize("change, line", [
    (dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05: HF's latent norms use 1e-06"),
    (dict(num_experts_per_tok=2), "n_group=4, topk_group=2, num_experts_per_tok=2: HF scores "
                                  "a group by its best 2 experts, ptdp by its best k / "
                                  "topk_group = 1"),
])
def test_what_ptdp_would_compute_otherwise_is_refused(change, line, tmp_path):
    from ptdp.hf.base import ConversionError
    from ptdp.hf.convert import read_hf_config
    transformers.DeepseekV3Config(**{**DEEPSEEK, **change}).save_pretrained(str(tmp_path))
    with pytest.raises(ConversionError) as err:
        read_hf_config(tmp_path)
    assert str(err.value).startswith(line), err.value
