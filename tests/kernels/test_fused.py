"""The fused elementwise chains and skip_bias_add equal the unfused layer they replace, and
attention calls SDPA in the form that lets GPU flash / memory-efficient kernels run."""

import pytest
import torch
import torch.nn.functional as F

from ptdp.models import build_chunk
from ptdp.models.transformer import ModelContext, TransformerLayer
from ptdp.config import ModelConfig
from ptdp.kernels import ACTIVATIONS, bias_dropout_add, bias_gelu
from ptdp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG

TP = TensorParallel()  # t = 1: no process group needed


def context(**model) -> ModelContext:
    cfg = ModelConfig(**{"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 8,
                         "vocab_size": 100, **model})
    return ModelContext(cfg, TP, 7, TensorParallelRNG(7, 0, torch.device("cpu")), 128)


def test_bias_gelu_equals_gelu_of_biased_input():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=g, requires_grad=True)
    b = torch.randn(16, generator=g, requires_grad=True)
    ours = bias_gelu(x.clone(), b)   # the chain overwrites its input, a GEMM's fresh output
    ours.square().sum().backward()
    grads = x.grad.clone(), b.grad.clone()
    x.grad = b.grad = None
    ref = F.gelu(x + b)
    ref.square().sum().backward()
    assert torch.equal(ours, ref)
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], b.grad)
    assert torch.equal(bias_gelu(x, None), F.gelu(x))


def test_gelu_tanh_is_the_tanh_approximation_of_gpt2_and_megatron():
    """model.activation=gelu_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (GPT-2's
    gelu_new, Megatron-LM's fused bias-GeLU), equal to torch's tanh GeLU bit for bit and
    apart from the exact GeLU."""
    g = torch.Generator().manual_seed(0)
    x, b = torch.randn(5, 3, 16, generator=g, dtype=torch.float64), torch.randn(16, generator=g,
                                                                                 dtype=torch.float64)
    ours = ACTIVATIONS["gelu_tanh"](x.clone(), b)   # the chains overwrite their input
    y = x + b
    formula = 0.5 * y * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (y + 0.044715 * y ** 3)))
    torch.testing.assert_close(ours, formula, rtol=1e-12, atol=1e-12)
    assert torch.equal(ours, F.gelu(y, approximate="tanh"))
    assert (ours - bias_gelu(x.clone(), b)).abs().max() > 1e-5


def test_geglu_is_gemmas_mlp_activation():
    """GeLU_tanh(gate) * up on fc1's output whose columns alternate gate and up (SwiGLU's
    layout): Hugging Face's GemmaMLP, gelu_pytorch_tanh(gate_proj(x)) * up_proj(x)."""
    g = torch.Generator().manual_seed(3)
    x, b = torch.randn(5, 3, 16, generator=g), torch.randn(16, generator=g)
    y = x + b
    want = F.gelu(y[..., 0::2], approximate="tanh") * y[..., 1::2]
    assert torch.equal(ACTIVATIONS["geglu"](x.clone(), b), want)
    assert not torch.equal(ACTIVATIONS["swiglu"](x, b), want)


def test_bias_dropout_add_draws_the_unfused_mask():
    g = torch.Generator().manual_seed(1)
    x, residual = torch.randn(6, 2, 16, generator=g), torch.randn(6, 2, 16, generator=g)
    b = torch.randn(16, generator=g)
    torch.manual_seed(5)
    ours = bias_dropout_add(x.clone(), b, residual, 0.3, training=True)
    torch.manual_seed(5)
    ref = residual + F.dropout(x + b, 0.3, training=True)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, residual + x + b)  # dropout really ran
    assert torch.equal(bias_dropout_add(x.clone(), b, residual, 0.3, training=False),
                       residual + (x + b))
    assert torch.equal(bias_dropout_add(x, None, residual, 0.0, training=True), residual + x)


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_skip_bias_add_returns_the_bias_instead_of_adding_it(cls):
    plain = cls(8, 12, TP, seed=3, key="l", std=0.5)
    skip = cls(8, 12, TP, seed=3, key="l", std=0.5, skip_bias_add=True)
    for layer in (plain, skip):
        torch.nn.init.constant_(layer.bias, 0.25)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    y, bias = skip(x)
    assert bias is skip.bias
    torch.testing.assert_close(y + bias, plain(x), rtol=1e-6, atol=1e-6)


def unfused_layer(layer: TransformerLayer, x, heads: int, causal: bool, approximate="none"):
    """The layer written out without skip_bias_add or the fused helpers (dropout 0)."""
    s, b, h = x.shape
    att, mlp = layer.attention, layer.mlp
    qkv = F.linear(layer.ln1(x), att.qkv.weight, att.qkv.bias).view(s, b, heads, 3, -1)
    q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    x = x + F.linear(out.permute(2, 0, 1, 3).reshape(s, b, h), att.proj.weight, att.proj.bias)
    hidden = F.gelu(F.linear(layer.ln2(x), mlp.fc1.weight, mlp.fc1.bias), approximate=approximate)
    return x + F.linear(hidden, mlp.fc2.weight, mlp.fc2.bias)


@pytest.mark.parametrize("activation,approximate", [("gelu", "none"), ("gelu_tanh", "tanh")])
def test_transformer_layer_equals_the_unfused_layer(activation, approximate):
    ctx = context(activation=activation)
    layer = TransformerLayer(ctx, 0, causal=True)
    g = torch.Generator().manual_seed(4)
    for p in layer.parameters():  # non-zero biases, so adding them in another place matters
        p.data.normal_(0, 0.3, generator=g)
    x = torch.randn(8, 2, 32, generator=g)
    torch.testing.assert_close(layer(x), unfused_layer(layer, x, 4, True, approximate),
                               rtol=1e-6, atol=1e-6)


def test_attention_passes_sdpa_what_flash_and_mem_efficient_kernels_need(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append({"mask": attn_mask, "causal": is_causal, "stride": q.stride(-1)})
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    tokens = torch.randint(0, 100, (2, 8))
    batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 8),
             "types": torch.zeros(2, 8, dtype=torch.long), "sop_label": torch.zeros(2, dtype=torch.long),
             "padding_mask": torch.tensor([[1] * 8, [1] * 5 + [0] * 3])}
    build_chunk(context(arch="gpt"), 0, 1)(None, batch)
    gpt, calls[:] = list(calls), []
    build_chunk(context(arch="bert"), 0, 1)(None, batch)
    assert len(gpt) == 2 and all(c["causal"] and c["mask"] is None for c in gpt)  # flash
    for c in calls:  # a boolean keep-mask broadcast over heads and queries
        assert not c["causal"] and c["mask"].dtype == torch.bool
        assert c["mask"].shape == (2, 1, 1, 8)
        assert c["mask"][1, 0, 0].tolist() == [True] * 5 + [False] * 3
    assert all(c["stride"] == 1 for c in gpt + calls)  # head_dim contiguous, as kernels need


def test_the_kernels_cover_the_catalogues_activations_exactly():
    """A name added to the model catalogue without its chain here (or the reverse) would fail
    only when a model is built, after launch."""
    from ptdp.config.models import ACTIVATIONS as NAMES, GATED_ACTIVATIONS
    from ptdp.kernels.fused import GATES
    assert set(ACTIVATIONS) == set(NAMES) and set(GATES) == set(GATED_ACTIVATIONS)
