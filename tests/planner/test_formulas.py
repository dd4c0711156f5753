"""The dissertation's formulas (SPEC item 28 and §4.3), checked against the source's numbers."""

import dataclasses
import math

import pytest

from ptdp.planner import formulas as f


def test_eq42_matches_per_layer_derivation():
    # L4150-4195: 4 * (24Bsh^2 + 4Bs^2h) per layer plus 6BshV for the logits.
    B, s, l, h, V = 8, 2048, 24, 2304, 51200
    expected = l * 4 * (24 * B * s * h**2 + 4 * B * s**2 * h) + 6 * B * s * h * V
    assert f.model_flops_per_iteration(B, s, l, h, V) == pytest.approx(expected, rel=1e-12)
    closed = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert f.model_flops_per_iteration(B, s, l, h, V) == pytest.approx(closed, rel=1e-12)


def test_eq42_without_recompute_counts_three_passes():
    B, s, l, h, V = 2, 128, 4, 256, 1000
    with_rc = f.model_flops_per_iteration(B, s, l, h, V)
    without = f.model_flops_per_iteration(B, s, l, h, V, recompute_forward=False)
    logits = 6 * B * s * h * V
    assert (without - logits) / (with_rc - logits) == pytest.approx(0.75)


@pytest.mark.parametrize("layers,hidden,billions", [
    (96, 12288, 174.6),     # GPT-3 (Table 4.2 lists 174.6B)
    (105, 20480, 529.6),    # Table 4.2's 530B model
    (80, 12288, 145.6),     # Fig. 4.17's 145B model
])
def test_eq43_parameter_counts(layers, hidden, billions):
    p = f.parameter_count(layers, hidden, vocab=51200, seq=2048)
    assert p / 1e9 == pytest.approx(billions, abs=0.1)


def test_eq43_weak_scaling_three_layer_model_is_16_billion():
    # SPEC §2 note: Fig. 4.11 says "15 billion" but Eq. 4.3 gives 16.2B for 3 layers, h=20480.
    assert f.parameter_count(3, 20480, 51200, 2048) / 1e9 == pytest.approx(16.2, abs=0.05)


def test_eq44_training_time_examples():
    # L4310-4318: 175B, 300B tokens, 1024 GPUs at 140 TFLOP/s -> ~34 days;
    # 1T, 450B tokens, 3072 GPUs at 163 TFLOP/s -> ~84 days.
    assert f.training_days(300e9, 175e9, 1024, 140) == pytest.approx(34, abs=0.5)
    assert f.training_days(450e9, 1e12, 3072, 163) == pytest.approx(84, abs=1.0)


def test_eq44_is_eq42_under_its_approximations():
    # With 6h >> s, 16lh >> V: F*I ~ 8TP, so the exact form agrees to within a few percent.
    l, h, V, s, B, T, n, X = 96, 12288, 51200, 2048, 1536, 300e9, 1024, 140
    iters = f.iterations_for_tokens(T, B, s)
    exact_days = iters * f.model_flops_per_iteration(B, s, l, h, V) / (n * X * 1e12) / 86400
    approx_days = f.training_days(T, f.parameter_count(l, h, V, s), n, X)
    assert exact_days == pytest.approx(approx_days, rel=0.05)


def test_training_days_rejects_nonsense():
    with pytest.raises(ValueError):
        f.training_days(1e9, 1e9, 0, 100)


def test_bubble_fractions():
    assert f.bubble_fraction(8, 64) == pytest.approx(7 / 64)        # (p-1)/m, L3548
    assert f.bubble_fraction(8, 64, chunks=4) == pytest.approx(7 / 256)  # /v, L3633
    assert f.bubble_fraction(1, 5) == 0
    # L3771: with d = 1, p = n/t so the bubble is (n/t - 1)/m and falls as t grows.
    n, m = 64, 32
    bubbles = [f.bubble_fraction(n // t, m) for t in (1, 2, 4, 8)]
    assert bubbles == sorted(bubbles, reverse=True)
    assert bubbles[-1] == pytest.approx((n / 8 - 1) / m)
    # L3851: with t = 1, m = b'/d and p = n/d, so the bubble is (n - d)/b'.
    b_prime = 512
    for d in (1, 2, 8, 32):
        assert f.bubble_fraction(n // d, b_prime // d) == pytest.approx((n - d) / b_prime)


def test_communication_volumes():
    b, s, h = 2, 2048, 12288
    assert f.tensor_parallel_elements_per_layer(b, s, h, 1) == 0
    assert f.tensor_parallel_elements_per_layer(b, s, h, 8) == pytest.approx(8 * b * s * h * 7 / 8)
    assert f.pipeline_elements_per_boundary(b, s, h) == b * s * h
    assert f.pipeline_elements_per_boundary(b, s, h, 8, scatter_gather=True) == b * s * h / 8


def test_eq41_and_checkpoint_count():
    # (b'/b + p - 1)(t_f + t_b): 64 micro-batches + 7 bubble slots of 3 time units.
    assert f.eq41_batch_time(128, 2, 8, 1.0, 2.0) == pytest.approx((64 + 7) * 3)
    c = f.optimal_checkpoints(16, a_intermediate=34.0, a_input=2.0)
    assert c == pytest.approx(math.sqrt(16 * 17))
    cost = lambda c: c * 2.0 + 16 / c * 34.0  # noqa: E731 - the source's memory function
    assert cost(c) <= min(cost(c * 0.9), cost(c * 1.1))


# --------------------------------------------------------------------------------------------
# Eq. 4.2 and 4.3 generalised (Llama-style blocks)
# --------------------------------------------------------------------------------------------

def llama(layers, hidden, heads, kv_heads, ffn, seq=8192, vocab=128256, **block):
    options = dict(activation="swiglu", normalization="rmsnorm", position_embedding="rope",
                   bias=False, tie_embeddings=False)
    return f.ModelShape("gpt", layers, hidden, heads, ffn, seq, vocab, False, kv_heads,
                        **{**options, **block})


LLAMA3_8B = llama(32, 4096, 32, 8, 14336)
LLAMA3_70B = llama(80, 8192, 64, 8, 28672)


def test_llama3_parameter_counts_are_metas():
    by_hand = (128256 * 4096 * 2                       # word table + untied output layer
               + 32 * (4096 * (4096 + 2 * 1024)        # QKV: 8 K/V heads of 128
                       + 4096 * 4096                   # output projection
                       + 3 * 4096 * 14336              # SwiGLU gate, up, down
                       + 2 * 4096)                     # two RMSNorm gains
               + 4096)                                 # final RMSNorm
    assert by_hand == 8_030_261_248                    # Meta-Llama-3-8B
    assert f.decoder_parameters(LLAMA3_8B) == 8_030_261_248
    assert f.parameter_total(LLAMA3_8B) == 8_030_261_248
    assert f.decoder_parameters(LLAMA3_70B) == 70_553_706_496    # Meta-Llama-3-70B


def test_gemma_7b_parameter_count_is_googles():
    """An explicit head size (16 heads of 256 on h = 3072: h_q = 4096 != h), counted by hand."""
    gemma = llama(28, 3072, 16, 16, 24576, vocab=256000, head_dim=256, tie_embeddings=True,
                  activation="geglu")
    by_hand = (256000 * 3072                            # word table, tied to the output
               + 28 * (3072 * 3 * 4096                  # Q, K, V: 16 heads of 256 each
                       + 4096 * 3072                    # output projection h_q -> h
                       + 3 * 3072 * 24576               # GeGLU: gate, up, down
                       + 2 * 3072)                      # two RMSNorm gains
               + 3072)                                  # final RMSNorm
    assert by_hand == 8_537_680_896                     # google/gemma-7b
    assert f.decoder_parameters(gemma) == by_hand
    assert not gemma.dissertation_block


def test_each_block_option_changes_the_count_by_its_own_parameters():
    l, h, a, s, V, ff = 3, 256, 8, 128, 1000, 704
    base = llama(l, h, a, a, ff, s, V)
    count = f.decoder_parameters
    change = lambda **kw: count(dataclasses.replace(base, **kw)) - count(base)  # noqa: E731
    assert change(tie_embeddings=True) == -V * h                   # no output layer of its own
    assert change(position_embedding="learned") == s * h           # a position table
    assert change(normalization="layernorm") == (2 * l + 1) * h    # a bias per norm
    assert change(kv_heads=2) == -l * 2 * h * (h - h // 4)         # K, V narrowed to h/4
    assert change(activation="gelu") == -l * h * ff                # no gate projection
    assert change(bias=True, qkv_bias=True) == l * (3 * h + h + 2 * ff + h)  # + gate+up, down
    assert change(bias=True) == l * (h + 2 * ff + h)               # base.qkv_bias stays False
    assert change(qkv_bias=True) == l * 3 * h                      # Qwen2: Q, K, V only
    d = 48                                                          # h_q = 384 = 1.5 h
    assert change(head_dim=d) == l * (3 * h * a * d + a * d * h - 4 * h * h)
    assert change(qk_norm=True) == l * 2 * (h // a)                # Q and K gains of size d
    assert change(qk_norm=True, normalization="layernorm") == l * (4 * (h // a) + 2 * h) + h


def test_general_flops_equal_a_gemm_by_gemm_count():
    # GQA (8 query heads, 2 K/V heads) + SwiGLU: count every GEMM of a layer as 2*m*n*k.
    B, s, l, h, a, kv, ff, V = 3, 128, 5, 256, 8, 2, 704, 1000
    shape = llama(l, h, a, kv, ff, s, V)
    T, d = B * s, h // a
    gemms = [(T, h + 2 * kv * d, h),            # QKV
             (T, h, h),                         # output projection
             (T, 2 * ff, h),                    # gate and up
             (T, h, ff)]                        # down
    layer = sum(2 * m * n * k for m, n, k in gemms)
    layer += a * B * (2 * s * s * d + 2 * s * d * s)   # Q K^T and (scores) V per query head
    logits = 2 * T * h * V
    for passes, recompute in ((3, False), (4, True)):
        expected = passes * l * layer + 3 * logits
        assert f.iteration_flops(shape, B, recompute_forward=recompute) == expected
    # Fewer K/V heads and a narrower MLP do fewer FLOPs; the output layer's tying does not
    # change them.
    mha = dataclasses.replace(shape, kv_heads=a)
    qkv_saving = 2 * T * h * 2 * (h - kv * d)           # the QKV GEMM's narrower K and V
    assert f.iteration_flops(mha, B) - f.iteration_flops(shape, B) == 4 * l * qkv_saving
    tied = dataclasses.replace(shape, tie_embeddings=True)
    assert f.iteration_flops(tied, B) == f.iteration_flops(shape, B)
    # An explicit head size d' widens Q, the scores, the attention output and the projection.
    wide, d2 = dataclasses.replace(shape, head_dim=48), 48
    gemms = [(T, (a + 2 * kv) * d2, h), (T, h, a * d2), (T, 2 * ff, h), (T, h, ff)]
    layer = sum(2 * m * n * k for m, n, k in gemms) + a * B * 4 * s * s * d2
    assert f.iteration_flops(wide, B, recompute_forward=False) == 3 * l * layer + 3 * logits


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("B,s,l,h,a,V", [(1536, 2048, 96, 12288, 96, 51200),
                                         (8, 2048, 24, 2304, 24, 51200),
                                         (3, 16, 2, 32, 4, 128)])
def test_general_forms_are_the_dissertations_for_its_block(B, s, l, h, a, V, recompute):
    # Bit for bit: every GPT and BERT number the trainer and planner printed before stays.
    gpt = f.ModelShape("gpt", l, h, a, 4 * h, s, V, True)
    assert gpt.dissertation_block
    assert f.iteration_flops(gpt, B, recompute_forward=recompute) == \
        f.model_flops_per_iteration(B, s, l, h, V, recompute)
    assert f.parameter_total(gpt) == f.parameter_count(l, h, V, s)
    # Counted exactly, the GPT block has the final LayerNorm Eq. 4.3 leaves out.
    assert f.decoder_parameters(gpt) == 12 * l * h * h + 13 * l * h + (V + s) * h + 2 * h
    bert = f.ModelShape("bert", l, h, a, 4 * h, s, V, True)
    assert f.iteration_flops(bert, B, recompute_forward=recompute) == \
        f.model_flops("bert", B, s, l, h, V, recompute)
    assert f.parameter_total(bert) == f.model_parameters("bert", l, h, V, s)
