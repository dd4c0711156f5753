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


def loss_and_grads(compile: bool, recompute: str, dropout: float = 0.0, layers: int = 2,
                   compile_layers: int = 1, **block):
    cfg = ModelConfig(num_layers=layers, hidden_size=32, num_heads=4, seq_length=16,
                      vocab_size=100, dropout=dropout, **block)
    ctx = ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")),
                       128, recompute, 1, compile=compile, compile_layers=compile_layers)
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


# ------------------------------------------------------------- train.compile_layers (regions)
def test_compiled_regions_match_eager():
    """A 4-layer chunk compiled in two regions of 2 layers trains like the eager chunk."""
    assert_close(loss_and_grads(True, "none", layers=4, compile_layers=2),
                 loss_and_grads(False, "none", layers=4))


def _stack(layers: int, k: int, recompute: str = "none", group: int = 1, **model):
    from ptdp.models.transformer import TransformerStack
    cfg = ModelConfig(num_layers=layers, hidden_size=16, num_heads=2, seq_length=8,
                      vocab_size=100, **{"dropout": 0.0, **model})
    ctx = ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")),
                       128, recompute, group, compile=True, compile_layers=k)
    return TransformerStack(ctx, 0, layers, causal=True).train()


@pytest.mark.parametrize("layers, k, recompute, group, calls", [
    (7, 3, "none", 1, [3, 3, 1]),
    (4, 8, "none", 1, [4]),          # a chunk shorter than a region: one call
    (7, 3, "full", 2, [2, 2, 2, 1]),  # a region never spans two recomputed groups
    (6, 2, "full", 3, [2, 1, 2, 1]),
])
def test_regions_cut_the_stack(layers, k, recompute, group, calls, monkeypatch):
    """One compiled call per region of k layers: the host cost of a call is paid per region."""
    import ptdp.models.transformer as transformer
    seen = []
    monkeypatch.setattr(transformer, "compiled_run_layers", lambda cuda_graphs: lambda region, *a: (
        seen.append(len(region)) or transformer.run_layers(region, *a)))
    _stack(layers, k, recompute, group)(torch.randn(8, 2, 16, requires_grad=True))
    assert seen == calls


def test_regions_of_equal_length_share_one_graph(monkeypatch):
    """Dynamo traces a region once: the layers' weights are the graph's inputs, so the second
    region of a 4-layer stack reuses the first one's graph, forward and backward."""
    from torch._dynamo.utils import counters
    import ptdp.models.transformer as transformer
    compiled = torch.compile(transformer.run_layers, backend="eager")   # dynamo only
    monkeypatch.setattr(transformer, "compiled_run_layers", lambda cuda_graphs: compiled)
    torch._dynamo.reset()
    counters.clear()
    stack = _stack(4, 2)
    for _ in range(2):
        stack(torch.randn(8, 2, 16, requires_grad=True)).sum().backward()
    torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


@pytest.mark.parametrize("overrides, world, expected", [
    ([], 1, 8),                                               # nothing to overlap: regions
    (["model.num_layers=8", "train.compile_layers=3"], 1, 3),
    (["parallel.data=2"], 2, 1),                              # keeps the reduction's overlap
    (["parallel.data=2", "train.compile_layers=4"], 2, 4),    # the user's trade
    (["parallel.tensor=2"], 2, 1),                            # graph breaks: nothing to gain
    (["model.attention_dropout=0.1"], 1, 8),                  # in the graph at t = 1
    (["train.recompute=selective"], 1, 1),
    (["model.num_experts=4"], 1, 1),
])
def test_the_region_length(overrides, world, expected):
    from ptdp.config import load_config
    from ptdp.config.compilation import region_layers
    assert region_layers(load_config(None, TINY + overrides, world_size=world)) == expected


@pytest.mark.parametrize("overrides, message", [
    (["train.compile_layers=0"], "train.compile_layers must be >= 1 or null, got 0"),
    (["parallel.tensor=2", "train.compile_layers=4"],
     "train.compile_layers=4 needs layers that compile to one graph, and parallel.tensor=2: "
     "the tensor-parallel collectives run eagerly; set train.compile_layers=1 or null"),
])
def test_a_region_length_that_cannot_work_is_refused(overrides, message):
    from ptdp.config import ConfigError, load_config
    with pytest.raises(ConfigError) as err:
        load_config(None, TINY + overrides, world_size=2)
    assert message in err.value.errors


@pytest.mark.parametrize("cuda_graphs, mode", [(False, None), (True, "reduce-overhead")])
def test_cuda_graphs_compile_the_regions_to_replay_them(cuda_graphs, mode, monkeypatch):
    """train.cuda_graphs reaches the stack, whose regions are compiled in torch.compile's
    reduce-overhead mode (CUDA graph trees); without it, in the default mode."""
    import dataclasses
    import ptdp.models.transformer as transformer
    modes = []

    def spy(fn, mode=None):
        modes.append(mode)
        return fn   # eager: what is checked is how the regions were compiled
    monkeypatch.setattr(torch, "compile", spy)
    transformer.compiled_run_layers.cache_clear()
    try:
        stack = _stack(4, 2)
        stack.ctx = dataclasses.replace(stack.ctx, cuda_graphs=cuda_graphs)
        stack(torch.randn(8, 2, 16))
        stack(torch.randn(8, 2, 16))
    finally:
        transformer.compiled_run_layers.cache_clear()
    assert modes == [mode]   # one compiled function, shared by both regions and calls


@pytest.mark.parametrize("overrides, world, needs", [
    (["train.compile=false"], 1, "compiled layers (it replays their regions), and "
                                 "train.compile=false"),
    (["train.device=cpu"], 1, "a CUDA device, and train.device=cpu"),
    (["parallel.pipeline=2", "model.num_layers=2"], 2,
     "one micro-batch in flight (a replay overwrites the last one's activations), and "
     "schedule.name=1f1b with parallel.pipeline=2, parallel.chunks=1 holds up to 2"),
    (["schedule.name=gpipe"], 1, "schedule.name=gpipe with parallel.pipeline=1, "
                                 "parallel.chunks=1 holds up to 4"),   # every forward first
    (["schedule.name=zb-h1"], 1, "a schedule that finishes each backward on one copy of the "
                                 "weights, and schedule.name=zb-h1 defers weight gradients"),
    (["train.recompute=full"], 1,
     "train.recompute=none (full recomputation re-runs the regions in the backward)"),
    (["parallel.tensor=2"], 2, "layers that compile to one graph, and parallel.tensor=2: the "
                               "tensor-parallel collectives run eagerly"),
])
def test_cuda_graphs_that_cannot_replay_are_refused(overrides, world, needs):
    """One line naming the key and what it lacks, before any process group starts."""
    from ptdp.config import ConfigError, load_config
    with pytest.raises(ConfigError) as err:
        load_config(None, TINY + ["train.cuda_graphs=true"] + overrides, world_size=world)
    lines = [line for line in err.value.errors if line.startswith("train.cuda_graphs")]
    assert len(lines) == 1 and needs in lines[0] and \
        lines[0].endswith("; set train.cuda_graphs=false"), err.value.errors
    for ok in ([], ["schedule.name=gpipe", "train.global_batch_size=2"]):   # GPipe with m = 1
        cfg = load_config(None, TINY + ["train.cuda_graphs=true"] + ok, world_size=1)
        assert cfg.train.cuda_graphs is True


def test_attention_dropout_is_in_the_compiled_graph_with_one_tensor_rank(monkeypatch):
    """With one tensor rank a compiled layer draws its attention dropout in the graph (no eager
    island swapping generator states: models/attention.py), so the layer stays one graph, and
    the masks are drawn afresh at every call. (Recomputation replays them:
    test_compiled_dropout_is_replayed_by_recomputation, whose dropout is also attention's.)"""
    from torch._dynamo.utils import counters
    import ptdp.models.transformer as transformer
    compiled = torch.compile(transformer.run_layers, backend="eager")   # dynamo only
    monkeypatch.setattr(transformer, "compiled_run_layers", lambda cuda_graphs: compiled)
    torch._dynamo.reset()
    counters.clear()
    stack = _stack(2, 2, attention_dropout=0.5)
    x = torch.randn(8, 2, 16)
    first, second = stack(x), stack(x)
    torch._dynamo.reset()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert not torch.equal(first, second)


def test_ptdp_check_says_the_regions_are_replayed_as_cuda_graphs():
    from ptdp.config import load_config
    from ptdp.job_summary import compile_line
    cfg = load_config(None, TINY + ["train.cuda_graphs=true"], world_size=1)
    assert compile_line(cfg) == (
        "compile: on when training on CUDA (train.compile=null), in regions of up to 8 layers "
        "(train.compile_layers=null), each replayed as a CUDA graph (train.cuda_graphs=true)")


def test_every_region_variant_of_a_job_stays_compiled(monkeypatch):
    """A job's regions are one compiled function with a graph per variant: each region length,
    grad mode (a fully recomputed forward runs without), train or eval mode, and binding to
    the weight-gradient queue (the cooldown's split micro-batches). Uneven stages can make
    more than dynamo's default of 8 per function, after which it would run the rest eagerly
    without an error; here 2 lengths x 2 x 2 x 2 = 16 variants are 16 graphs."""
    import contextlib
    import itertools

    from torch._dynamo.utils import counters

    import ptdp.models.transformer as transformer
    from ptdp.parallel.weight_grad import weight_grads_of
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **options: real_compile(
        fn, backend="eager", **options))   # dynamo's graphs, without inductor's compile time
    transformer.compiled_run_layers.cache_clear()
    try:
        torch._dynamo.reset()
        counters.clear()
        stack = _stack(3, 2)   # regions of 2 and 1 layers
        queue = weight_grads_of(stack)
        for grad, train, bound in itertools.product((True, False), repeat=3):
            stack.train(train)
            with torch.set_grad_enabled(grad), queue.bound() if bound else contextlib.nullcontext():
                stack(torch.randn(8, 2, 16, requires_grad=grad))
        graphs = counters["stats"]["unique_graphs"]
        torch._dynamo.reset()
    finally:
        transformer.compiled_run_layers.cache_clear()
    assert graphs == 16


def test_a_torch_without_a_per_function_limit_gets_the_global_one_raised(monkeypatch):
    """Where torch.compile takes no recompile_limit, the regions raise dynamo's global limit
    instead (never lowering one the user set higher)."""
    import ptdp.models.transformer as transformer
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    real_compile = torch.compile

    def old_compile(fn, mode=None, **options):
        if options:
            raise TypeError(f"compile() got an unexpected keyword argument {next(iter(options))!r}")
        return real_compile(fn, mode=mode)
    monkeypatch.setattr(torch, "compile", old_compile)
    before = getattr(config, name)
    for start, expected in ((8, transformer.REGION_GRAPHS), (1000, 1000)):
        # config.patch, not monkeypatch: pytest 9.2's monkeypatch deletes an attribute it did
        # not find in a module's __dict__, and dynamo's config then hides the key for good
        with config.patch(**{name: start}):
            transformer.compiled_run_layers.cache_clear()
            try:
                assert callable(transformer.compiled_run_layers(False))
            finally:
                transformer.compiled_run_layers.cache_clear()
            assert getattr(config, name) == expected
    assert getattr(config, name) == before
