"""The dissertation's formulas (SPEC item 28 and §4.3), checked against the source's numbers."""

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
