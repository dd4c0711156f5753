"""train.compile: compiled layers train like eager ones (fp32, to round-off), also under
activation recomputation, with dropout, and with tensor-parallel collectives (graph breaks).

Compilation on CPU costs seconds per graph, so there are only a few tiny cases.
"""

import pytest
import torch
import torch.distributed as dist

from ptdp.models import build_chunk
from ptdp.models.transformer import ModelContext
from ptdp.config import ModelConfig
from ptdp.kernels import should_compile
from ptdp.runtime.local_ranks import run_on_ranks
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from tests.deadline import within
from tests.equivalence import TINY, relative_error

RTOL = 1e-5


def test_should_compile_defaults_to_cuda_only():
    assert should_compile(None, torch.device("cpu")) is False
    assert should_compile(None, torch.device("cuda", 0)) is True
    assert should_compile(True, torch.device("cpu")) is True
    assert should_compile(False, torch.device("cuda", 0)) is False


def test_train_compile_is_true_false_or_null():
    from ptdp.config import ConfigError, load_config
    assert load_config(None, []).train.compile is None
    assert load_config(None, ["train.compile=true"]).train.compile is True
    assert load_config(None, ["train.compile=null"]).train.compile is None
    with pytest.raises(ConfigError, match="train.compile"):
        load_config(None, ["train.compile=fast"])


LLAMA = dict(preset="llama", num_kv_heads=2, ffn_hidden_size=64)


def loss_and_grads(compile: bool, recompute: str, dropout: float = 0.0, **block):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=100,
                      dropout=dropout, **block)
    ctx = ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")),
                       128, recompute, 1, compile=compile)
    chunk = build_chunk(ctx, 0, 1).train()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 100, (2, 16), generator=g)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(2, 16)}
    torch.manual_seed(11)
    loss, _ = chunk(None, batch)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in chunk.named_parameters()}


def assert_close(got, ref):
    assert abs(got[0] - ref[0]) <= RTOL * abs(ref[0]), (got[0], ref[0])
    assert got[1].keys() == ref[1].keys()
    for name, grad in ref[1].items():
        assert relative_error(got[1][name], grad) <= RTOL, name


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiled_layers_match_eager(recompute, monkeypatch):
    """...and a compiled chunk's loss is the fused one (ptdp/parallel/cross_entropy.py), an
    eager chunk's the eager one."""
    import ptdp.models.gpt as gpt
    fused = []
    real = gpt.vocab_parallel_cross_entropy
    monkeypatch.setattr(gpt, "vocab_parallel_cross_entropy",
                        lambda *args, **kw: fused.append(kw["fused"]) or real(*args, **kw))
    assert_close(loss_and_grads(True, recompute), loss_and_grads(False, recompute))
    assert fused == [True, False]


def test_compiled_llama_layers_match_eager():
    """Rotary positions, RMSNorm, SwiGLU and grouped-query attention inside the compiled layer
    (train.compile is on by default on GPUs)."""
    assert_close(loss_and_grads(True, "none", **LLAMA), loss_and_grads(False, "none", **LLAMA))


def test_compiled_dropout_is_replayed_by_recomputation():
    """Inductor draws its own dropout masks (seeded from torch's default generator, which
    torch.utils.checkpoint restores), so a recomputed compiled layer sees the same masks."""
    ref = loss_and_grads(True, "none", dropout=0.1)
    assert_close(loss_and_grads(True, "full", dropout=0.1), ref)
    assert ref[0] != loss_and_grads(False, "none", dropout=0.0)[0]  # dropout really ran


def tensor_parallel_runs() -> list:
    from ptdp.config import load_config
    from ptdp.training import Trainer
    out = []
    for compile in (False, True):
        overrides = TINY + ["model.num_layers=2", "parallel.tensor=2", "train.recompute=full",
                            f"train.compile={str(compile).lower()}"]
        trainer = Trainer(load_config(None, overrides, world_size=dist.get_world_size()))
        step = trainer.step.forward_backward(0)
        trainer.step.reduce_gradients()
        out.append((step.loss, trainer.full_state(grads=True)))
    return out


def test_compiled_layers_with_tensor_parallel_collectives_match_eager():
    eager, compiled = run_on_ranks(2, tensor_parallel_runs, timeout_s=within(240))[0]
    assert_close(compiled, eager)


def test_a_compiled_layer_sums_fc1s_bias_gradient_over_token_rows():
    """The dense MLP runs on [s·b, h] rows (models/transformer.py TransformerLayer), so in the
    backward graph inductor compiles, fc1's bias gradient is one sum over dimension 0 of the
    stored gradient, with no copy of a viewed tensor. On [s, b, h] it was a sum over two
    dimensions, which inductor fused into a reduction recomputing the GeLU backward: five
    times slower on one H200 (docs/performance.md, "Fourth run"); CPU can only check the
    graph."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table
    graphs = []
    backend = aot_autograd(fw_compiler=lambda gm, _: gm,
                           bw_compiler=lambda gm, _: graphs.append(gm) or gm,
                           decompositions=select_decomp_table())
    cfg = ModelConfig(num_layers=1, hidden_size=8, num_heads=2, seq_length=16, vocab_size=100,
                      dropout=0.0)
    ctx = ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")),
                       128)
    from ptdp.models.transformer import TransformerLayer
    layer = TransformerLayer(ctx, 0, causal=True)
    x = torch.randn(16, 2, 8, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(layer, backend=backend)(x).sum().backward()
    torch._dynamo.reset()
    (graph,) = graphs
    shapes = lambda node: [tuple(a.meta["val"].shape) for a in node.args   # noqa: E731
                           if isinstance(a, torch.fx.Node)]
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    fc1_bias = [n for n in calls if n.target == torch.ops.aten.sum.dim_IntList
                and shapes(n)[0][-1] == cfg.ffn_hidden_size]
    assert [(shapes(n)[0], list(n.args[1])) for n in fc1_bias] == [((32, 32), [0])]
    assert not [n for n in calls if n.target in (torch.ops.aten.as_strided_scatter.default,
                                                 torch.ops.aten.new_empty_strided.default)]
