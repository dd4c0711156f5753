"""The block options beyond the presets (docs/models.md): each computes what the model it comes
from computes, written out here by hand, and each is refused in one line where it cannot apply.
Their equivalence in every layout is tests/equivalence.py's "blocks" model."""

import pytest
import torch
import torch.nn.functional as F

from ptdp.config import ConfigError, load_config
from ptdp.models.norms import LayerNorm, RMSNorm
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
    (["model.preset=llama", "model.head_dim=7"],
     "model.position_embedding=rope needs an even head size, got model.head_dim = 7"),
])
def test_bad_values_get_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, world_size=1)
    assert len(err.value.errors) == 1 and message in err.value.errors[0], err.value.errors
