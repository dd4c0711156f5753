"""train.recompute_modules (models/recompute.py, ptdp/config/recompute.py): each module set
gives the gradients of recompute=none bit for bit, keeps less for backward, and by what the
planner's memory model says (ptdp/planner/memory.py selective_saving)."""

import pytest
import torch

from ptdp.config import ConfigError, ModelConfig, load_config
from ptdp.models.transformer import ModelContext, TransformerStack
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from ptdp.planner.formulas import ModelShape
from ptdp.planner.memory import selective_saving
from ptdp.profiler.timing import param_storages, saved_bytes

S, B, H = 16, 2, 32
BLOCKS = {"gpt": {}, "llama": dict(preset="llama", num_kv_heads=2, ffn_hidden_size=64)}
SETS = [None, ("core_attn",), ("layernorm",), ("activation",), ("mlp",), ("layernorm", "mlp"),
        ("core_attn", "layernorm", "activation")]


def _layer(block: str, recompute: str, modules, dropout: float = 0.0, layers: int = 1):
    cfg = ModelConfig(num_layers=layers, hidden_size=H, num_heads=4, seq_length=S,
                      vocab_size=100, dropout=dropout, **BLOCKS[block])
    ctx = ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")),
                       128, recompute, 1, recompute_modules=modules)
    return cfg, TransformerStack(ctx, 0, layers, causal=True).train()


def _run(block: str, recompute: str, modules, dropout: float = 0.0, layers: int = 1):
    """(saved bytes, output, input and parameter gradients) of one forward and backward."""
    cfg, stack = _layer(block, recompute, modules, dropout, layers)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(5)   # the hidden dropout's masks
    out, nbytes = saved_bytes(lambda: stack(x), param_storages(stack))
    out.square().sum().backward()
    grads = {"input": x.grad, **{n: p.grad for n, p in stack.named_parameters()}}
    return cfg, nbytes, out.detach(), grads


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_each_module_set_saves_what_the_planner_counts(block):
    cfg, none, _, _ = _run(block, "none", None)
    shape = ModelShape.from_config(cfg)
    table = {}
    for modules in SETS:
        _, kept, _, _ = _run(block, "selective", modules)
        table[modules] = none - kept
        expected = selective_saving(shape, B, 1, "fp32", "flash",
                                    modules or ("layernorm", "activation"))
        if block == "llama" and "mlp" in (modules or ()):
            # an eager SwiGLU also keeps SiLU(gate), sbf/t, which the count leaves to fusion
            expected += S * B * cfg.ffn_hidden_size * 4
        assert 0 < table[modules] == expected, (block, modules, table)


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_each_module_set_is_exact_with_dropout(block):
    """Hidden and attention dropout on: every recomputation replays the same masks."""
    _, _, out, grads = _run(block, "none", None, dropout=0.1, layers=2)
    for modules in SETS[1:]:
        _, _, got, got_grads = _run(block, "selective", modules, dropout=0.1, layers=2)
        assert torch.equal(got, out), modules
        for name, grad in grads.items():
            assert torch.equal(got_grads[name], grad), (modules, name)


def test_selective_in_a_compiled_layer_matches_eager():
    """The recomputed modules are eager islands inside a compiled layer (dynamo's graphs run
    eagerly here: the numbers are the eager ones) and both layers reuse the same graphs."""
    from torch._dynamo.utils import counters
    _, eager = _layer("llama", "selective", ("core_attn", "layernorm", "activation"), layers=2)
    _, compiled = _layer("llama", "selective", ("core_attn", "layernorm", "activation"), layers=2)
    for layer in compiled.layers:
        layer.compile(backend="eager")
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    for stack in (eager, compiled):
        stack(x).square().sum().backward()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    compiled(x).square().sum().backward()   # again: no recompilation
    assert counters["stats"]["unique_graphs"] == graphs
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad, 2 * q.grad), name   # twice backpropagated


@pytest.mark.parametrize("overrides, message", [
    (["train.recompute_modules=[mlp]"], "train.recompute_modules is used only with "
                                        "train.recompute=selective"),
    (["train.recompute=selective", "train.recompute_modules=[attn]"],
     "train.recompute_modules: unknown module 'attn'"),
    (["train.recompute=selective", "train.recompute_modules=[]"], "non-empty list"),
    (["train.recompute=selective", "train.recompute_modules=[layernorm]", "parallel.tensor=2",
      "parallel.sequence_parallel=true"], "layernorm saves nothing"),
    (["train.recompute=selective", "train.recompute_modules=[mlp]", "model.num_experts=4"],
     "mlp recomputes the dense MLP"),
])
def test_bad_recompute_modules_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides, world_size=2)
