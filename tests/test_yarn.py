"""YaRN rotary scaling (model.rope_scaling_type=yarn; models/rotary.py) against transformers 5:
the frequencies and cos/sin tables (also in a bf16-cast module), a Llama converted from
transformers with HF's logits, one latent attention layer with DeepSeek's softmax scale, the
softmax scale through every kernel path, the HF keys both ways, and bad keys in one line each."""

from __future__ import annotations

import math

import pytest
import torch

from ptdp.config import ConfigError, load_config
from ptdp.models.rotary import (RotaryEmbedding, attention_factor, inverse_frequencies,
                                softmax_scale_multiplier)
from tests.optional import needs

# DeepSeek-V3's rotary settings (rope part of 64) and a Qwen2.5-style long context (heads of 128)
DEEPSEEK_V3 = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32.0,
                   beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                   original_max_position_embeddings=4096)
QWEN = dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768)
GPT_OSS = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
               beta_slow=1.0, original_max_position_embeddings=4096, truncate=False)
LLAMA = ["model.arch=gpt", "model.preset=llama", "model.num_heads=4"]


def _keys(params: dict) -> list[str]:
    """ptdp's overrides of a transformers yarn rope_parameters dict (written out here, not
    through ptdp/hf/llama.py, so the rotary tests do not lean on the conversion)."""
    names = dict(rope_theta="rope_theta", factor="rope_scaling_factor",
                 original_max_position_embeddings="rope_original_seq_length",
                 beta_fast="rope_yarn_beta_fast", beta_slow="rope_yarn_beta_slow",
                 mscale="rope_yarn_mscale", mscale_all_dim="rope_yarn_mscale_all_dim",
                 truncate="rope_yarn_truncate")
    return ["model.rope_scaling_type=yarn", "model.max_position_embeddings=163840",
            *(f"model.{names[k]}={str(v).lower() if isinstance(v, bool) else v}"
              for k, v in params.items() if k != "rope_type")]


def _hf_rotary(params: dict, dim: int):
    """transformers' rotary embedding of `params` for rotated size `dim`: DeepSeek-V3's (its
    rotary part) for DeepSeek's settings, else Qwen2's (Llama's)."""
    transformers = needs("transformers")
    positions = int(params["factor"] * params["original_max_position_embeddings"])
    if "mscale" in params:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf
        config = transformers.DeepseekV3Config(
            hidden_size=256, num_attention_heads=4, qk_rope_head_dim=dim, head_dim=dim,
            max_position_embeddings=positions, rope_parameters=dict(params))
        return config, hf.DeepseekV3RotaryEmbedding(config)
    from transformers.models.qwen2 import modeling_qwen2 as hf
    config = transformers.Qwen2Config(hidden_size=4 * dim, num_attention_heads=4, head_dim=dim,
                                      max_position_embeddings=positions,
                                      rope_parameters=dict(params))
    return config, hf.Qwen2RotaryEmbedding(config)


@pytest.mark.parametrize("params, dim", [(DEEPSEEK_V3, 64), (QWEN, 128), (GPT_OSS, 64)],
                         ids=["deepseek-v3", "qwen2.5", "untruncated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frequencies_and_tables_are_transformers(params, dim, dtype):
    """The frequencies and attention factor of `_compute_yarn_parameters`, and the cos/sin of
    transformers' rotary embedding at positions up to 160k (measured: bit-identical), also
    after a module cast (whose frequencies stay fp32)."""
    needs("transformers")
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    config, theirs = _hf_rotary(params, dim)
    cfg = load_config(None, LLAMA + [f"model.hidden_size={4 * dim}"] + _keys(params)).model
    inv_freq, factor = _compute_yarn_parameters(config)
    assert (inverse_frequencies(cfg, dim) - inv_freq).abs().max().item() < 1e-6
    assert attention_factor(cfg) == pytest.approx(factor, abs=1e-12)
    assert factor != 1.0 or params is DEEPSEEK_V3   # (V3's mscales cancel: 1)
    ours = RotaryEmbedding(cfg, dim).to(dtype)
    positions = torch.arange(0, 163840, 13)
    cos, sin = theirs(torch.zeros(1), positions[None])
    got_cos, got_sin = ours(positions)
    assert got_cos.dtype == torch.float32
    assert (got_cos - cos[0]).abs().max().item() < 1e-6
    assert (got_sin - sin[0]).abs().max().item() < 1e-6


def test_unscaled_and_llama3_tables_are_unchanged_by_the_yarn_keys():
    """Without YaRN the attention factor is 1 and the softmax scale untouched."""
    for keys in ([], ["model.rope_scaling_factor=8"]):
        cfg = load_config(None, LLAMA + ["model.hidden_size=64"] + keys).model
        assert attention_factor(cfg) == 1.0 and softmax_scale_multiplier(cfg) == 1.0
    qwen = load_config(None, LLAMA + ["model.hidden_size=512"] + _keys(QWEN)).model
    assert softmax_scale_multiplier(qwen) == 1.0   # no mscale_all_dim: 1/sqrt(d)
    deepseek = load_config(None, LLAMA + ["model.hidden_size=256"] + _keys(DEEPSEEK_V3)).model
    assert softmax_scale_multiplier(deepseek) == pytest.approx((0.1 * math.log(40) + 1) ** 2)


# --- a Llama with YaRN converted from transformers ------------------------------------------


@pytest.mark.parametrize("extra", [{}, {"mscale": 1.0, "mscale_all_dim": 0.5}],
                         ids=["qwen-style", "mscales"])
def test_a_llama_with_yarn_converts_with_transformers_logits(extra, tmp_path):
    """HF -> ptdp -> HF for a tiny LlamaForCausalLM whose 64 positions are 4 times its original
    16: transformers' logits both ways (measured: 2e-6 to 3e-6) and the same rope_parameters back.
    Llama's attention keeps 1/sqrt(d) whatever mscale_all_dim says (transformers' too)."""
    transformers = needs("transformers")
    from ptdp.hf.convert import from_hf, to_hf
    from ptdp.inference.local_model import LocalModel
    from tests.hf.hf_models import logits_diff, random_hf_model
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                original_max_position_embeddings=16, **extra)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_parameters=rope, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    original = random_hf_model(config, tmp_path / "hf", std=0.3)
    final, cfg = from_hf(tmp_path / "hf", tmp_path / "ckpt", ["model.seq_length=64"])
    assert cfg.model.rope_scaling_type == "yarn" and cfg.model.rope_scaling_factor == 4.0
    assert logits_diff(LocalModel.from_checkpoint(final), original, 128, 64) < 1e-5
    to_hf(final, tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    written = {k: v for k, v in back.config.rope_parameters.items() if k != "type"}
    assert written == dict(rope, beta_fast=32.0, beta_slow=1.0)
    assert logits_diff(LocalModel.from_checkpoint(final), back, 128, 64) < 1e-5


def test_a_llama_with_yarn_differs_from_one_without():
    """(What the test above compares is sensitive: YaRN moves the tables.)"""
    plain = load_config(None, LLAMA + ["model.hidden_size=32"]).model
    yarn = load_config(None, LLAMA + ["model.hidden_size=32"] + _keys(QWEN)).model
    positions = torch.arange(64)
    moved = RotaryEmbedding(yarn)(positions)[0] - RotaryEmbedding(plain)(positions)[0]
    assert moved.abs().max() > 0.1


# --- latent attention's softmax scale --------------------------------------------------------


@pytest.mark.parametrize("mscales", [dict(mscale=1.0, mscale_all_dim=1.0),
                                     dict(mscale=0.707, mscale_all_dim=0.707),
                                     dict(mscale_all_dim=1.0), {}],
                         ids=["deepseek-v3", "deepseek-v2-lite", "all-dim-only", "none"])
def test_a_latent_attention_layer_computes_hugging_faces_with_yarn(mscales):
    """One layer of models/latent_attention.py against DeepseekV3Attention with DeepSeek-V3's
    YaRN (factor 40 on 4,096 positions) at positions up to ~160k: the rotary part's tables and
    the softmax scale times mscale(40, mscale_all_dim)^2 (1.874 for V3)."""
    from tests.test_latent_attention import _attention, hugging_face_copy
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32.0, beta_slow=1.0,
                original_max_position_embeddings=4096, **mscales)
    ours, m = _attention("model.layernorm_eps=1e-6", *_keys(rope))
    theirs, rotary = hugging_face_copy(ours, rms_norm_eps=m.layernorm_eps,
                                       max_position_embeddings=163840, rope_parameters=rope)
    assert ours.softmax_scale == (None if "mscale_all_dim" not in mscales
                                  else pytest.approx(theirs.scaling, rel=1e-15))
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16) * 10_000 + 7   # past the original 4,096: the ramp matters
    out, _ = ours(x, positions=positions)
    causal = torch.full((16, 16), float("-inf")).triu(1)[None, None].expand(2, 1, -1, -1)
    tables = rotary(x, positions[None].expand(2, -1))
    expected, _ = theirs(x.transpose(0, 1), tables, causal)
    # (outputs ~4e-3; measured differences ~2e-10)
    torch.testing.assert_close(out.transpose(0, 1), expected, rtol=1e-5, atol=1e-8)


# --- the softmax scale through the kernels ---------------------------------------------------


def _reference(q, k, v, keep, scale):
    scores = (q @ k.transpose(-1, -2)) * scale
    return scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("masked", [False, True])
def test_attention_takes_a_softmax_scale(masked):
    """SDPA's is_causal path and the keep-mask path both apply `scale` (values of another
    size than queries and keys, as latent attention's)."""
    from ptdp.models.attention import attention, window_mask
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, d, generator=g) for d in (6, 6, 5))
    keep = window_mask(8, 3)[:, None] if masked else torch.ones(8, 8, dtype=torch.bool).tril()
    out = attention(q, k, v, keep if masked else None, causal=True, scale=0.9)
    torch.testing.assert_close(out, _reference(q, k, v, keep, 0.9))
    assert not torch.allclose(out, attention(q, k, v, keep if masked else None, causal=True))


@pytest.mark.gpu
def test_flex_attention_takes_a_softmax_scale():
    """On CUDA the documents' mask is a FlexAttention BlockMask; it applies `scale` too."""
    from ptdp.models.attention import attention, flex_block_mask, keep_mask
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 16, generator=g).cuda() for _ in range(3))
    documents = (torch.arange(128) >= 50).long()[None].expand(2, -1).cuda()
    out = attention(q, k, v, flex_block_mask(documents, None, 128, "cuda"), scale=0.7)
    keep = keep_mask(documents)[:, None]
    torch.testing.assert_close(out, _reference(q, k, v, keep, 0.7), rtol=1e-4, atol=1e-4)


# --- transformers' keys both ways ------------------------------------------------------------


def test_yarn_rope_settings_map_both_ways():
    transformers = needs("transformers")
    from ptdp.hf.llama import rope_parameters, rope_settings
    shape = dict(hidden_size=32, num_attention_heads=4, max_position_embeddings=163840)
    config = transformers.LlamaConfig(**shape, rope_parameters=dict(DEEPSEEK_V3))
    keys = rope_settings(config)
    assert keys == dict(rope_theta=1e4, rope_scaling_factor=40.0, rope_scaling_type="yarn",
                        rope_original_seq_length=4096, rope_yarn_beta_fast=32.0,
                        rope_yarn_beta_slow=1.0, rope_yarn_truncate=True, rope_yarn_mscale=1.0,
                        rope_yarn_mscale_all_dim=1.0, rope_yarn_attention_factor=None)
    cfg = load_config(None, LLAMA + ["model.hidden_size=32"]
                      + [f"model.{k}={'null' if v is None else v}" for k, v in keys.items()])
    assert rope_parameters(cfg.model) == {k: v for k, v in DEEPSEEK_V3.items()}
    untruncated = transformers.LlamaConfig(**shape, rope_parameters=dict(GPT_OSS))
    assert rope_settings(untruncated)["rope_yarn_truncate"] is False


@pytest.mark.parametrize("given, expected", [
    # no factor: max / original positions, as transformers computes it
    (dict(factor=None), dict(rope_scaling_factor=40.0)),
    # mscale without mscale_all_dim (or beside attention_factor): transformers ignores it
    (dict(mscale=0.707), dict(rope_yarn_mscale=None)),
    (dict(mscale=1.0, mscale_all_dim=1.0, attention_factor=1.2),
     dict(rope_yarn_mscale=None, rope_yarn_mscale_all_dim=1.0, rope_yarn_attention_factor=1.2)),
    # 0 mscales and betas are unset (transformers reads them with `or`)
    (dict(mscale=0, mscale_all_dim=0, beta_fast=0), dict(rope_yarn_mscale_all_dim=None,
                                                         rope_yarn_beta_fast=32.0)),
])
def test_yarn_settings_read_missing_values_as_transformers_does(given, expected):
    from ptdp.hf.llama import rope_settings

    class Config:   # a config as read from config.json (transformers' own would validate)
        max_position_embeddings = 163840
        rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0,
                           "original_max_position_embeddings": 4096, **given}
    keys = rope_settings(Config())
    assert {k: keys[k] for k in expected} == expected


def test_yarn_with_factor_one_is_unscaled_and_other_types_are_refused():
    from ptdp.hf.base import ConversionError
    from ptdp.hf.llama import rope_settings

    class Config:
        max_position_embeddings = 4096
        rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 1.0,
                           "original_max_position_embeddings": 4096}
    assert rope_settings(Config()) == dict(rope_theta=1e4, rope_scaling_factor=1.0)
    Config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ConversionError, match="rope_type='dynamic'.*YaRN"):
        rope_settings(Config())


# --- validation: one line each ---------------------------------------------------------------


def _errors(*overrides: str) -> list[str]:
    try:
        load_config(None, LLAMA + ["model.hidden_size=64", *overrides])
    except ConfigError as err:
        return err.errors
    return []


YARN = ["model.rope_scaling_factor=40", "model.rope_scaling_type=yarn"]


@pytest.mark.parametrize("overrides, line", [
    (["model.rope_scaling_type=yarn"],
     "model.rope_scaling_type apply with model.rope_scaling_factor > 1 only (1 = no scaling)"),
    (["model.rope_yarn_mscale_all_dim=1", "model.rope_yarn_truncate=false"],
     "model.rope_yarn_mscale_all_dim, model.rope_yarn_truncate apply with "
     "model.rope_scaling_factor > 1 only (1 = no scaling)"),
    (["model.rope_scaling_factor=8", "model.rope_yarn_beta_fast=16"],
     "model.rope_yarn_beta_fast apply to model.rope_scaling_type=yarn only (this model's is "
     "llama3)"),
    ([*YARN, "model.rope_low_freq_factor=2"],
     "model.rope_low_freq_factor apply to model.rope_scaling_type=llama3 only (YaRN's ramp is "
     "set by model.rope_yarn_beta_fast/beta_slow)"),
    ([*YARN, "model.rope_yarn_beta_fast=1"],
     "model.rope_yarn_beta_fast (1.0) must exceed model.rope_yarn_beta_slow (1.0) > 0"),
    ([*YARN, "model.rope_yarn_beta_slow=0", "model.rope_yarn_beta_fast=32"],
     "model.rope_yarn_beta_fast (32.0) must exceed model.rope_yarn_beta_slow (0.0) > 0"),
    ([*YARN, "model.rope_yarn_mscale_all_dim=-1"],
     "model.rope_yarn_mscale_all_dim must be positive, got -1.0 (null = unset)"),
    ([*YARN, "model.rope_yarn_attention_factor=0"],
     "model.rope_yarn_attention_factor must be positive, got 0.0 (null = unset)"),
    ([*YARN, "model.rope_yarn_mscale=1"],
     "model.rope_yarn_mscale does nothing without model.rope_yarn_mscale_all_dim or beside "
     "model.rope_yarn_attention_factor (the cos/sin factor is then 0.1 ln(factor) + 1, or the "
     "attention factor): remove it"),
    ([*YARN, "model.rope_original_seq_length=0"],
     "model.rope_original_seq_length must be positive, got 0"),
    (["model.rope_scaling_factor=4", "model.rope_scaling_type=ntk"],
     "model.rope_scaling_type: 'ntk' is not one of llama3, yarn"),
    (["model.position_embedding=learned", "model.rope_yarn_truncate=false"],
     "model.rope_yarn_truncate apply to model.position_embedding=rope only (this model has "
     "learned positions)"),
])
def test_bad_yarn_keys_get_one_line(overrides, line):
    errors = _errors(*overrides)
    assert len(errors) == 1 and errors[0].startswith(line), errors


def test_yarn_configs_load():
    assert _errors(*YARN, "model.rope_yarn_mscale=1", "model.rope_yarn_mscale_all_dim=1",
                   "model.rope_original_seq_length=4096", "model.max_position_embeddings=163840",
                   "model.rope_yarn_truncate=false") == []
    assert _errors(*YARN, "model.rope_yarn_attention_factor=1.2",
                   "model.rope_yarn_mscale_all_dim=0.707") == []
