"""The block options beyond the presets (docs/models.md): each computes what the model it comes
from computes, written out here by hand, and each is refused in one line where it cannot apply.
Their equivalence in every layout is tests/equivalence.py's "blocks" model."""

import pytest
import torch
import torch.nn.functional as F

from ptdp.config import ConfigError, ModelConfig, load_config
from ptdp.models.norms import LayerNorm, RMSNorm
from ptdp.models.rotary import rotate
from ptdp.models.transformer import ModelContext, ParallelAttention
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from ptdp.parallel.weight_grad import WeightGradQueue


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def gemma_rms_norm(x, weight, eps):
    """Hugging Face's GemmaRMSNorm.forward, written out: fp32 throughout, then cast."""
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rms_norm_is_gemmas(dtype):
    norm = RMSNorm(16, 1e-6, zero_centered=True).to(dtype)
    assert torch.equal(norm.weight, torch.zeros(16, dtype=dtype))   # starts as gain 1
    x = _randn(3, 2, 16, seed=1, dtype=dtype)
    plain = RMSNorm(16, 1e-6).to(dtype)
    assert torch.equal(norm(x), plain(x))
    with torch.no_grad():
        norm.weight.copy_(_randn(16, seed=2, dtype=dtype))
    assert torch.equal(norm(x), gemma_rms_norm(x, norm.weight, 1e-6))


def test_zero_centred_layer_norm_is_megatrons_layernorm_1p():
    norm = LayerNorm(16, 1e-5, zero_centered=True)
    x = _randn(3, 2, 16, seed=3)
    assert torch.equal(norm(x), F.layer_norm(x, (16,), None, None, 1e-5))   # 1 + 0, bias 0
    with torch.no_grad():
        norm.weight.copy_(_randn(16, seed=4))
        norm.bias.copy_(_randn(16, seed=5))
    assert torch.equal(norm(x), F.layer_norm(x, (16,), norm.weight + 1, norm.bias, 1e-5))


@pytest.mark.parametrize("kind", [RMSNorm, LayerNorm])
def test_zero_centred_gain_defers_its_gradient_like_any_weight(kind):
    """zb-h1's split backward reaches w through the gain 1 + w (ptdp/parallel/weight_grad.py)."""
    x = _randn(4, 16, seed=6).requires_grad_()
    norm = kind(16, 1e-5, zero_centered=True)
    with torch.no_grad():
        norm.weight.copy_(_randn(16, seed=7))
    scale = torch.arange(16.0)
    (norm(x) * scale).sum().backward()
    expected = [p.grad.clone() for p in (x, *norm.parameters())]
    for p in (x, *norm.parameters()):
        p.grad = None
    queue = norm.weight_ops = WeightGradQueue()
    with queue.defer("mb"):
        (norm(x) * scale).sum().backward()
    assert norm.weight.grad is None
    queue.run("mb")
    for got, want in zip((x, *norm.parameters()), expected):
        torch.testing.assert_close(got.grad, want, rtol=1e-6, atol=1e-6)


def _attention(**model) -> ParallelAttention:
    cfg = ModelConfig(**{"num_layers": 1, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
                         "seq_length": 8, "vocab_size": 100, "preset": "llama", **model})
    ctx = ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")), 128)
    return ParallelAttention(ctx, 0, causal=True)


def test_qk_norm_normalises_each_head_before_the_rotation():
    """Qwen3's order: q_norm over head_dim on the projected heads, then the rotary angles."""
    plain, normed = _attention(head_dim=12), _attention(head_dim=12, qk_norm=True)
    assert torch.equal(plain.qkv.weight, normed.qkv.weight)    # the same projection
    with torch.no_grad():
        normed.q_norm.weight.copy_(_randn(12, seed=8))
        normed.k_norm.weight.copy_(_randn(12, seed=9))
    x = _randn(8, 2, 32, seed=10)
    plain.rotary = None   # raw Q and K: rotate them here, after the norm
    q_raw, k_raw, v_raw = plain.project(x)
    q, k, v = normed.project(x)
    cos, sin = normed.rotary(torch.arange(8))
    rms = lambda t, w: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w  # noqa: E731
    torch.testing.assert_close(q, rotate(rms(q_raw, normed.q_norm.weight), cos, sin))
    torch.testing.assert_close(k, rotate(rms(k_raw, normed.k_norm.weight), cos, sin))
    assert torch.equal(v, v_raw) and q.shape == (2, 4, 8, 12)


def test_an_explicit_head_size_sets_the_attention_widths():
    m = load_config(None, ["model.hidden_size=34", "model.head_dim=16"], world_size=1).model
    assert m.head_dim == 16
    assert load_config(None, [], world_size=1).model.head_dim == 64 // 4   # null: h / heads


@pytest.mark.parametrize("overrides,message", [
    (["model.arch=bert", "model.norm_zero_centered=true"],
     "model.norm_zero_centered apply to model.arch=gpt only"),
    (["model.head_dim=0"], "model.head_dim must be positive, got 0"),
    (["model.hidden_size=34"],
     "model.hidden_size (34) must be divisible by model.num_heads (4), or set model.head_dim"),
    (["model.arch=bert", "model.head_dim=8"], "model.head_dim apply to model.arch=gpt only"),
    (["model.arch=bert", "model.qk_norm=true"], "model.qk_norm apply to model.arch=gpt only"),
    (["model.arch=bert", "model.scale_embeddings=true"],
     "model.scale_embeddings apply to model.arch=gpt only"),
    (["model.preset=llama", "model.head_dim=7"],
     "model.position_embedding=rope needs an even head size, got model.head_dim = 7"),
])
def test_bad_values_get_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, world_size=1)
    assert len(err.value.errors) == 1 and message in err.value.errors[0], err.value.errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_embeddings_are_gemmas(dtype):
    """Hugging Face's Gemma: embeddings * torch.tensor(sqrt(h), dtype=the embeddings' dtype)."""
    from ptdp.models.embedding import Embedding
    cfg = ModelConfig(num_layers=1, hidden_size=48, num_heads=4, seq_length=8, vocab_size=100,
                      preset="llama", scale_embeddings=True)
    ctx = ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")), 128)
    embedding = Embedding(ctx).to(dtype)
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(11))
    table = embedding.word.weight
    want = F.embedding(tokens.t(), table) * torch.tensor(48 ** 0.5, dtype=dtype)
    assert torch.equal(embedding(tokens), want)
    if dtype == torch.bfloat16:   # the factor is rounded first: 6.928 -> 6.9375
        assert not torch.equal(want, (F.embedding(tokens.t(), table).float() * 48 ** 0.5).to(dtype))


def test_generation_runs_the_block_options():
    """ptdp generate's cached forward (ptdp/inference/generate.py) takes the scaled
    embeddings and the QK-norms: its logits are the full forward's."""
    from ptdp.inference.generate import KVCache, forward_cached
    from ptdp.inference.local_model import LocalModel, initial_state
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=12,
                      seq_length=16, vocab_size=100, preset="llama", qk_norm=True,
                      norm_zero_centered=True, scale_embeddings=True, init_std=0.3)
    model = LocalModel(cfg, initial_state(cfg, seed=3))
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = KVCache(cfg.num_layers)
    parts = [forward_cached(model, tokens[:, :7], cache)]
    parts += [forward_cached(model, tokens[:, i:i + 1], cache) for i in range(7, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), model.logits(tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["gelu_tanh", "geglu"])
def test_experts_take_the_models_activation(activation):
    """A mixture of experts' experts (models/moe.py) compute the model's activation."""
    from ptdp.kernels import ACTIVATIONS
    from ptdp.models.moe import Expert
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_heads=4, seq_length=8, vocab_size=100,
                      preset="llama", activation=activation, num_experts=4,
                      moe_ffn_hidden_size=16)
    ctx = ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")), 128)
    expert = Expert(ctx, "layers.0.mlp.experts.0", 16)
    x = _randn(6, 32, seed=12)
    hidden = ACTIVATIONS[activation](x @ expert.fc1.weight.t(), None)
    assert expert.fc1.weight.shape[0] == (32 if cfg.gated else 16) and hidden.shape == (6, 16)
    torch.testing.assert_close(expert(x), hidden @ expert.fc2.weight.t())
