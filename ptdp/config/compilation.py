"""`train.compile_layers`: how many consecutive transformer layers one compiled region holds.

With `train.compile` each region is one `torch.compile`d call (models/transformer.py
`TransformerStack`). Every call pays the same host work whatever its size: dynamo's guard
check, AOTAutograd's forward and backward wrappers, the autograd node. Per layer that is ~0.2
ms of host time per micro-batch, forward and backward, which a small model on a GPU cannot hide
(BERT-large at micro-batch 16 waits on its host: docs/performance.md). A region of k layers
pays it once for k; regions of the same length share one compiled graph, so compilation grows
with k, not with the number of layers.

The cost of a long region: its weight gradients all appear when its backward ends, so the
data-parallel buckets launch later and overlap less of the backward. The default (`null`)
therefore takes regions of up to `AUTO_REGION_LAYERS` layers only where there is nothing to
overlap (one data-parallel replica) and the layer compiles to a single graph; otherwise one
layer per region, as before. A layer with a graph break (eager islands: collectives,
mixture-of-experts blocks, selectively recomputed modules) gains nothing from longer regions,
so an explicit `train.compile_layers` > 1 is refused there. (Attention dropout is in the graph
with one tensor rank, models/attention.py; with more, the collectives break it anyway.)

`train.cuda_graphs` goes one step further: each region is compiled with torch.compile's
"reduce-overhead" mode, whose CUDA graph trees capture the region's kernels once and replay
them with one launch, forward and backward. What a region's call still costs on the host is
then the replay's bookkeeping, not one launch per kernel. A replay writes its outputs and
saved activations where the capture did, so one micro-batch may be in flight at a time
(the catalogue's count: one pipeline stage with 1F1B, forward, backward, forward, ...), each
backward finished on one copy of the weights (no deferred weight gradients, no weight
versions), no full recomputation (which re-runs regions inside the backward), and layers
that are one graph. Regions of equal length
share their compiled graph, and the trees record one CUDA graph per region (their weights
are static inputs, at fixed addresses).
"""

from __future__ import annotations

AUTO_REGION_LAYERS = 8   # most of the host saving (8x fewer calls) at a bounded compile time


def graph_break(cfg) -> str | None:
    """Why a training layer of `cfg` is not one compiled graph, or None when it is."""
    par, model, train = cfg.parallel, cfg.model, cfg.train
    if par.tensor > 1:
        return f"parallel.tensor={par.tensor}: the tensor-parallel collectives run eagerly"
    if par.context > 1:
        return f"parallel.context={par.context}: the attention ring runs eagerly"
    if model.num_experts > 0:
        return "model.num_experts > 0: the mixture-of-experts blocks run eagerly"
    if train.recompute == "selective":
        return "train.recompute=selective: the recomputed modules run eagerly"
    return None


def why_one_layer(cfg) -> str | None:
    """Why the default (train.compile_layers=null) compiles one layer per region, or None
    when it takes regions of AUTO_REGION_LAYERS."""
    if (cfg.parallel.data or 1) > 1:
        return (f"parallel.data={cfg.parallel.data}: the gradient reduction overlaps each "
                f"layer's backward")
    return graph_break(cfg)


def region_layers(cfg) -> int:
    """Layers per compiled region: `train.compile_layers`, or the default described above.
    With recompute=full a region never spans two recomputed groups (models/transformer.py)."""
    if cfg.train.compile_layers is not None:
        return cfg.train.compile_layers
    return 1 if why_one_layer(cfg) else AUTO_REGION_LAYERS


def check_compile_layers(cfg, out) -> None:
    """An explicit train.compile_layers (an integer, as the loader checks): >= 1, and > 1 only
    for layers that are one graph."""
    k = cfg.train.compile_layers
    if k is None or not out.require(k >= 1, f"train.compile_layers must be >= 1 or null, "
                                            f"got {k}"):
        return
    reason = graph_break(cfg) if k > 1 else None
    out.require(reason is None, f"train.compile_layers={k} needs layers that compile to one "
                                f"graph, and {reason}; set train.compile_layers=1 or null")


def check_cuda_graphs(cfg, out) -> None:
    """train.cuda_graphs: compiled layers, one micro-batch in flight, one-graph layers."""
    if not cfg.train.cuda_graphs:
        return
    reason = cuda_graphs_refusal(cfg)
    out.require(reason is None, f"train.cuda_graphs=true needs {reason}; set "
                                f"train.cuda_graphs=false")


def cuda_graphs_refusal(cfg) -> str | None:
    """What train.cuda_graphs lacks in `cfg`, or None when it can replay the regions."""
    train = cfg.train
    if train.compile is False:
        return "compiled layers (it replays their regions), and train.compile=false"
    if train.device == "cpu":
        return "a CUDA device, and train.device=cpu"
    if (conflict := _replay_conflict(cfg)) is not None:
        return conflict
    if train.recompute == "full":
        return "train.recompute=none (full recomputation re-runs the regions in the backward)"
    if (broken := graph_break(cfg)) is not None:
        return f"layers that compile to one graph, and {broken}"
    return None


def _replay_conflict(cfg) -> str | None:
    """Why a replay could overwrite what a micro-batch still needs under cfg's schedule, read
    off its catalogue entry (ptdp/config/catalogue.py): weight gradients deferred past the
    backward, weight versions, or more than one micro-batch's activations held at once."""
    from ptdp.config.catalogue import SCHEDULES
    spec, name, par = SCHEDULES.get(cfg.schedule.name), cfg.schedule.name, cfg.parallel
    if spec is None:
        return None   # an unknown schedule is its own error (validation)
    if spec.split_backward or not spec.flushing:
        kept = "defers weight gradients" if spec.split_backward else "keeps weight versions"
        return (f"a schedule that finishes each backward on one copy of the weights, and "
                f"schedule.name={name} {kept}")
    held = spec.in_flight(par.pipeline, par.chunks, cfg.num_micro_batches, rank=0)
    if held > 1:
        return (f"one micro-batch in flight (a replay overwrites the last one's activations), "
                f"and schedule.name={name} with parallel.pipeline={par.pipeline}, "
                f"parallel.chunks={par.chunks} holds up to {held:g}")
    return None
