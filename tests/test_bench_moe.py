"""tools/bench_moe.py: the per-token loop reference computes the mixture it claims to (checked
against the same mixture computed per expert), and the benchmark runs end to end."""

import json

import pytest
import torch

import tools.bench_moe as tool


@pytest.mark.parametrize("gated", [True, False])
def test_the_per_token_loop_is_the_mixture(gated):
    ref = tool.PerTokenMoE(hidden=16, ffn=24, experts=4, top_k=2, gated=gated)
    x = torch.randn(10, 16)
    weights, experts = ref.route(x)
    assert torch.allclose(weights.sum(-1), torch.ones(10))
    assert (experts[:, 0] != experts[:, 1]).all()
    torch.testing.assert_close(ref(x), ref.batched(x), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_the_benchmark_writes_its_table(tmp_path, capsys):
    assert tool.main(["--hidden", "32", "--heads", "2", "--moe-ffn", "16", "--seq", "8",
                      "--batch", "2", "--steps", "2", "--warmup", "1",
                      "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert [r["case"] for r in result["rows"]] == ["moe", "dense", "dense-halves", "per-token"]
    assert result["rows"][1]["vs_dense"] == 1.0
    assert all(r["seconds"] > 0 for r in result["rows"])
    assert result["rows"][3]["timed_tokens"] == 16   # all 16 tokens: fewer than --loop-tokens
    assert "per-token" in capsys.readouterr().out


def test_the_dense_with_its_halves_apart_is_the_dense_mlp():
    from tools import harness
    args = tool.argparse.Namespace(hidden=32, heads=2, top_k=2, moe_ffn=16, seq=8,
                                   activation="swiglu")
    x = torch.randn(8, 2, 32)
    with harness.world_of_one():
        dense = tool.layer_mlp(tool.model_config(args, 0, 32))
        torch.testing.assert_close(tool.DenseHalves(dense)(x), tool._output(dense(x)))
