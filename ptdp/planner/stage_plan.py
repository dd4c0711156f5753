"""Stage sizes for a planned layout: the partitioner's split against the even one.

The cost model (ptdp/planner/cost_model.py) prices even stages, L / (p*v) layers each, with
the embedding on the first and the output layer and loss on the last. With a large vocabulary
those two stages are the slowest, and the steady state runs at the slowest rank's pace. Here
the per-layer costs [embedding, layer 1..L, output layer and loss] of the layout's (t, b, c,
recompute) (`transformer_layer_profiles`) go through the partitioner's program
(`split_stages`, ptdp/planner/partitioner.py), and the split is kept only where its slowest
pipeline rank is predicted faster than the even split's: the saving is m micro-batches times
the difference (the fill and drain run every stage once either way), and only where every
rank still fits in memory (`rank_memory`: the memory model priced at each rank's own layers).
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ptdp.config.catalogue import schedule_spec
from ptdp.planner.formulas import context_shape
from ptdp.planner.partitioner import (LayerProfile, split_stages, stage_times,
                                      transformer_layer_profiles)

MIN_GAIN = 0.01   # an uneven split must save at least this share of the step to be proposed


@dataclass(frozen=True)
class StagePlan:
    """Layers and predicted forward+backward seconds per micro-batch of every virtual stage."""

    even: tuple[int, ...] | None          # None when p*v does not divide the layers
    even_times: tuple[float, ...] | None
    planned: tuple[int, ...]              # the partitioner's split
    planned_times: tuple[float, ...]
    even_slowest_rank: float | None       # a pipeline rank's seconds per micro-batch (its chunks)
    planned_slowest_rank: float
    saving_s: float                       # predicted seconds per iteration saved by `planned`
    step_time_s: float                    # the even layout's predicted step

    @property
    def uneven_wins(self) -> bool:
        """Propose the split: it differs from the even one and saves enough of the step."""
        return (self.planned != self.even
                and (self.even is None or self.saving_s >= MIN_GAIN * self.step_time_s))

    @property
    def chosen(self) -> tuple[int, ...] | None:
        return self.planned if self.uneven_wins else self.even


def layer_profiles(hw, work, lay, attention: str | None = None) -> list[LayerProfile]:
    """[embedding, layers.., head] for one rank of the layout: its t, micro-batch, s/c tokens,
    recomputation (added to every transformer layer's time)."""
    from ptdp.planner.compute import attention_kernel, layer_times, recompute_seconds
    shape = context_shape(work.shape, lay.context)
    attention = attention_kernel(attention or hw.attention, lay.context)   # as cost_model's
    profiles = transformer_layer_profiles(hw, shape, lay.micro_batch, work.precision,
                                          attention, t=lay.tensor)
    if lay.recompute != "none":
        lt = layer_times(hw, work.precision, shape, lay.micro_batch, lay.tensor, attention)
        extra = recompute_seconds(hw, work.precision, shape, lay.micro_batch, lay.tensor,
                                  attention, lt, lay.recompute, lay.recompute_modules,
                                  lay.sequence_parallel)
        body = replace(profiles[1], compute=profiles[1].compute + extra)
        head = replace(profiles[-1], compute=profiles[-1].compute + shape.mtp_layers * extra)
        profiles = [profiles[0]] + [body] * shape.layers + [head]   # (the MTP depths' layers)
    return profiles


def _slowest_rank(times: tuple[float, ...], lay) -> float:
    return max(per_rank(times, lay))


def plan_stages(hw, work, pred, attention: str | None = None) -> StagePlan | None:
    """The stage plan of a predicted layout; None without a pipeline (p = 1)."""
    lay = pred.layout
    if lay.pipeline == 1:
        return None
    n = lay.pipeline * lay.chunks
    profiles = layer_profiles(hw, work, lay, attention)
    layers = work.shape.layers
    planned = tuple(split_stages(profiles, n).stage_layers())
    planned_times = stage_times(profiles, list(planned))
    even = even_times = even_slowest = None
    if layers % n == 0:
        even = (layers // n,) * n
        even_times = stage_times(profiles, list(even))
        even_slowest = _slowest_rank(even_times, lay)
    planned_slowest = _slowest_rank(planned_times, lay)
    if even_slowest is not None and (planned_slowest >= even_slowest or not _fits(
            hw, work, lay, planned, attention)):
        planned, planned_times, planned_slowest = even, even_times, even_slowest
    m = lay.micro_batches(work.global_batch)
    saving = m * (even_slowest - planned_slowest) if even_slowest is not None else 0.0
    return StagePlan(even, even_times, planned, planned_times, even_slowest, planned_slowest,
                     saving, pred.step_time_s)


def per_rank(values, lay) -> list:
    """Each pipeline rank's sum of its virtual stages' `values` (layers, times)."""
    stages = schedule_spec(lay.schedule).stage_map(lay.pipeline, lay.chunks)
    return [sum(values[s] for s in stages.stages_of(r)) for r in range(lay.pipeline)]


def rank_shapes(shape, cfg) -> list:
    """For `ptdp check`'s memory per rank: the shape each pipeline rank is priced with, the
    one whose even share is its own layers (`rank_memory`); the model's shape when even."""
    par = cfg.parallel
    if par.stage_layers is None:
        return [shape] * par.pipeline
    stages = schedule_spec(cfg.schedule.name).stage_map(par.pipeline, par.chunks)
    return [replace(shape, layers=sum(par.stage_layers[s] for s in stages.stages_of(r))
                    * par.pipeline) for r in range(par.pipeline)]


def rank_memory(hw, work, lay, counts, attention: str | None = None) -> list:
    """The memory model's MemoryBreakdown of every pipeline rank holding its layers of
    `counts`: ptdp/planner/memory.py prices a rank's layers as shape.layers // p, so each rank
    is priced with the shape whose even share is its own."""
    from ptdp.config import padded_vocab_size
    from ptdp.planner.memory import gpu_memory
    p = lay.pipeline
    kwargs = dict(p=p, t=lay.tensor, v=lay.chunks, m=lay.micro_batches(work.global_batch),
                  b=lay.micro_batch, d=lay.data, schedule=lay.schedule, recompute=lay.recompute,
                  precision=work.precision, attention=attention or hw.attention,
                  vocab_padded=padded_vocab_size(work.shape.vocab, lay.tensor),
                  reserved_gb=hw.memory_reserved_gb, hw=hw,
                  distributed_optimizer=lay.distributed_optimizer,
                  sequence_parallel=lay.sequence_parallel, c=lay.context,
                  recompute_modules=lay.recompute_modules)
    return [gpu_memory(replace(work.shape, layers=n * p), rank=r, **kwargs)
            for r, n in enumerate(per_rank(counts, lay))]


def _fits(hw, work, lay, counts, attention) -> bool:
    return max(mb.total for mb in rank_memory(hw, work, lay, counts, attention)) \
        <= hw.usable_memory_bytes


def head_in_layers(profiles: list[LayerProfile]) -> tuple[float, float]:
    """The embedding's and the output layer and loss's time, in transformer layers."""
    layer = profiles[1].compute if len(profiles) > 2 else 0.0
    return ((profiles[0].compute / layer, profiles[-1].compute / layer) if layer else (0.0, 0.0))


def stage_lines(cfg, hardware=None) -> list[str]:
    """`ptdp check`'s lines for uneven stages (parallel.stage_layers set): each virtual stage's
    layers, and with a hardware profile its predicted forward+backward time per micro-batch."""
    from ptdp.config.stages import layer_ranges
    from ptdp.planner.compute import ModelShape
    from ptdp.planner.cost_model import Layout, Workload
    par, tr = cfg.parallel, cfg.train
    if par.stage_layers is None:
        return []
    n = par.pipeline * par.chunks
    ranges = layer_ranges(cfg.model.num_layers, n, par.stage_layers)
    times = None
    if hardware is not None:
        work = Workload(ModelShape.from_config(cfg.model), tr.global_batch_size, tr.precision,
                        hardware.gpus_per_node)
        lay = Layout(pipeline=par.pipeline, tensor=par.tensor, chunks=par.chunks,
                     micro_batch=tr.micro_batch_size, schedule=cfg.schedule.name,
                     recompute=tr.recompute, context=par.context,
                     recompute_modules=tr.recompute_modules)
        times = stage_times(layer_profiles(hardware, work, lay), list(par.stage_layers))
    lines = [f"stages (parallel.stage_layers = {list(par.stage_layers)}):"]
    for s, layers in enumerate(ranges):
        held = ([f"layers {layers.start}-{layers.stop - 1}"] if layers else []) \
            + (["embedding"] if s == 0 else []) + (["output layer and loss"] if s == n - 1 else [])
        held += [f"{cfg.model.mtp_layers} MTP depth(s)"] if s == n - 1 and cfg.model.mtp_layers else []
        time = f", {times[s] * 1e3:.2f} ms per micro-batch ({hardware.name})" if times else ""
        lines.append(f"  stage {s}: {' + '.join(held)}{time}")
    return lines
