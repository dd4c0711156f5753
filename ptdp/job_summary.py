"""What `ptdp check` prints about a job that passes its checks (ptdp/checks.py): the model,
the layout, the micro-batches and the bubble, compilation (train.compile and its regions of
layers), and the planner's memory estimate for every pipeline rank (ptdp/planner/memory.py),
with the modules the trainer recomputes."""

from __future__ import annotations

from ptdp.config import Config
from ptdp.config.models import DEFAULT_PRESET
from ptdp.config.recompute import selective_modules


def memory_per_stage(cfg: Config, hardware=None) -> list:
    """The planner's memory model for every pipeline rank: [MemoryBreakdown per stage]."""
    from ptdp.planner.compute import ModelShape
    from ptdp.planner.memory import gpu_memory
    from ptdp.planner.stage_plan import rank_shapes
    par, tr = cfg.parallel, cfg.train
    kwargs = dict(p=par.pipeline, t=par.tensor, v=par.chunks, m=cfg.num_micro_batches,
                  b=tr.micro_batch_size, d=par.data, schedule=cfg.schedule.name,
                  recompute=tr.recompute,   # with the trainer's modules, not the plan's default
                  recompute_modules=selective_modules(tr.recompute_modules, par.sequence_parallel),
                  precision=tr.precision, attention=hardware.attention if hardware else "flash",
                  vocab_padded=cfg.padded_vocab_size, vertical_sync=cfg.schedule.vertical_sync,
                  reserved_gb=hardware.memory_reserved_gb if hardware else 0.0, hw=hardware,
                  distributed_optimizer=tr.distributed_optimizer,
                  sequence_parallel=par.sequence_parallel, c=par.context, expert=par.expert)
    shapes = rank_shapes(ModelShape.from_config(cfg.model), cfg)   # uneven: each rank's layers
    return [gpu_memory(shapes[r], rank=r, **kwargs) for r in range(par.pipeline)]


def compile_line(cfg: Config) -> str:
    """train.compile and the layers one compiled call holds (ptdp/config/compilation.py)."""
    from ptdp.config.compilation import region_layers, why_one_layer
    tr = cfg.train
    if tr.compile is False:
        return "compile: off (train.compile=false)"
    when = "on" if tr.compile else "on when training on CUDA (train.compile=null)"
    k = region_layers(cfg)
    setting = "null" if tr.compile_layers is None else tr.compile_layers
    why = why_one_layer(cfg) if tr.compile_layers is None else None   # the default's reason
    graphs = ", each replayed as a CUDA graph (train.cuda_graphs=true)" if tr.cuda_graphs else ""
    return (f"compile: {when}, in regions of up to {k} layer{'s' * (k > 1)} "
            f"(train.compile_layers={setting}{f'; {why}' if why else ''}){graphs}")


def summary(cfg: Config, world_size: int, hardware=None) -> list[str]:
    """Lines describing the resolved job: layout, micro-batches, bubble, memory per rank."""
    from ptdp.config.catalogue import schedule_spec
    from ptdp.planner.formulas import ModelShape, decoder_parameters, parameter_count
    from ptdp.planner.memory import GB
    from ptdp.planner.moe_report import layout_text, moe_lines
    from ptdp.planner.stage_plan import stage_lines

    m, par, tr = cfg.model, cfg.parallel, cfg.train
    mb = cfg.num_micro_batches
    shape = ModelShape.from_config(m)
    if shape.bert_heads or shape.dissertation_block:
        formula = "Eq. 4.3"
        params = parameter_count(m.num_layers, m.hidden_size, cfg.padded_vocab_size, m.seq_length)
    else:   # Llama-style and other blocks: counted exactly (ptdp/planner/formulas.py)
        formula, params = "Eq. 4.3 generalised", decoder_parameters(shape, cfg.padded_vocab_size)
    block = f" ({m.preset} block)" if m.preset != DEFAULT_PRESET else ""
    lines = [
        f"model: {m.arch}{block}, {m.num_layers} layers, h={m.hidden_size}, {m.heads_text()}"
        f", ffn {m.ffn_hidden_size}, s={m.seq_length}, vocab {m.vocab_size} (padded "
        f"{cfg.padded_vocab_size}){_mtp_text(m)}, {params / 1e6:,.2f} M parameters ({formula})",
        layout_text(par, m.seq_length, shape.experts > 0)
        + f", v = {par.chunks}, schedule {cfg.schedule.name}, world size {world_size}",
        f"micro-batches: m = {mb} of {tr.micro_batch_size} per pipeline per iteration "
        f"(global batch {tr.global_batch_size}); "
        + _bubble_line(schedule_spec(cfg.schedule.name), par.pipeline, par.chunks, mb),
        *moe_lines(cfg, cfg.padded_vocab_size), compile_line(cfg)]
    lines += stage_lines(cfg, hardware)   # uneven stages: each one's layers (and time)
    stages = memory_per_stage(cfg, hardware)
    where = f"log.hardware {hardware.name}" if hardware else "analytic, flash attention"
    sharded = ((f", optimizer state sharded over d = {par.data}" if par.context == 1 else
                f", optimizer state sharded over d*c = {par.data * par.context}")
               if tr.distributed_optimizer else "")
    if tr.distributed_optimizer and m.num_experts:
        sharded += f" (experts' over d*c/e = {par.data * par.context // par.expert})"
    lines.append(f"memory per rank (estimate, {where}, {tr.precision}{sharded}):")
    shown = range(len(stages)) if len(stages) <= 4 else sorted(
        {0, len(stages) - 1, max(range(len(stages)), key=lambda r: stages[r].total)})
    for r in shown:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in stages[r].as_gb().items() if k != "total")
        lines.append(f"  pipeline rank {r}: {stages[r].total / GB:.3f} GiB ({parts})")
    if hardware is not None:
        worst = max(stages, key=lambda s: s.total)
        if worst.total > hardware.usable_memory_bytes:
            lines.append(f"  warning: the estimate exceeds {hardware.name}'s usable "
                         f"{hardware.usable_memory_bytes / GB:.1f} GiB")
    return lines


def _bubble_line(spec, p: int, v: int, m: int) -> str:
    """The idle share of an iteration (Eq. 4.1 and its zero-bubble form)."""
    from ptdp.planner.formulas import bubble_fraction
    if not spec.flushing:
        return "bubble 0 (no flush: the pipeline fills once per job)"
    if spec.split_backward:
        return (f"bubble (p-1)/(3m) = {bubble_fraction(p, m, 1) / 3:.3f} (zero bubble: "
                f"t_F = t_B = t_W)")
    if spec.split_cooldown:
        return (f"bubble 2(p-1)/(3v*m) = {2 * bubble_fraction(p, m, v) / 3:.3f} (the cooldown "
                f"sends input gradients first: t_F = t_B = t_W)")
    return f"bubble (p-1)/(v*m) = {bubble_fraction(p, m, v):.3f}"


def _mtp_text(m) -> str:
    """The multi-token-prediction depths (models/mtp.py), or nothing."""
    if not m.mtp_layers:
        return ""
    depths = "depth" if m.mtp_layers == 1 else "depths"
    return f", {m.mtp_layers} multi-token-prediction {depths} (λ = {m.mtp_loss_scale:g})"
