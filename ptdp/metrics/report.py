"""Console lines of a training job: the start-up summary (each rank's role) and the end
summary. Only rank 0 prints them; every rank computes the same numbers."""

from __future__ import annotations

import torch
import yaml

from ptdp.config import Config
from ptdp.config.models import DEFAULT_PRESET
from ptdp.metrics.log import aux_loss_text, config_path, format_tflops
from ptdp.planner.formulas import ModelShape, decoder_parameters, parameter_count


def startup_report(cfg: Config, grid, local_params: int, total_params: int,
                   device: torch.device | None = None) -> str:
    """A few lines: model size, layout with each rank's role, batch, precision, outputs.

    The full resolved config goes to a file (`config_path`) and, with log.verbose, here too.
    """
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    shape = ModelShape.from_config(m)
    if shape.bert_heads or shape.dissertation_block:   # the dissertation's formula
        formula = "Eq. 4.3"
        eq43 = parameter_count(m.num_layers, m.hidden_size, cfg.padded_vocab_size, m.seq_length)
    else:   # Llama-style blocks: counted exactly (ptdp/planner/formulas.py)
        formula, eq43 = "Eq. 4.3 generalised", decoder_parameters(shape, cfg.padded_vocab_size)
    name = m.arch.upper() + (f" ({m.preset} block)" if m.preset != DEFAULT_PRESET else "")
    heads = m.heads_text()
    world = grid.p * grid.t * par.context * grid.d
    lines = []
    if cfg.log.verbose:
        lines += ["ptdp: resolved config", yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip()]
    lines += [
        f"ptdp: {name} with {total_params / 1e6:.3g} M parameters ({m.num_layers} "
        f"layers, hidden {m.hidden_size}, {heads}, sequence {m.seq_length}, "
        f"vocabulary {m.vocab_size} padded to {cfg.padded_vocab_size}; {formula}: "
        f"{eq43 / 1e6:.3g} M); {local_params:,} on rank 0",
        (f"layout: (p, t, d) = ({par.pipeline}, {par.tensor}, {par.data}), " if par.context == 1 else
         f"layout: (p, t, c, d) = ({par.pipeline}, {par.tensor}, {par.context}, {par.data}), ")
        + f"v = {par.chunks}, "
        f"schedule {cfg.schedule.name}, {world} rank(s):",
        *rank_roles(cfg, grid),
        f"batch: {tr.global_batch_size} sequences x {m.seq_length} tokens per iteration = "
        f"{cfg.num_micro_batches} micro-batches of {tr.micro_batch_size} per pipeline x "
        f"{par.data} data replica(s); {tr.iters} iterations" + _ramp_text(tr),
        f"precision: {tr.precision} on {device.type if device is not None else tr.device}"
        + (" (gloo)" if device is not None and device.type == "cpu" else ""),
        "output: " + outputs_text(cfg),
    ]
    return "\n".join(lines)


MAX_ROLE_LINES = 16


def rank_roles(cfg: Config, grid) -> list[str]:
    """One line per rank (the first MAX_ROLE_LINES): its pipeline stage(s) with their layers,
    its tensor shard and its data replica."""
    from ptdp.parallel.grid import coordinates_of
    from ptdp.config.catalogue import schedule_spec
    from ptdp.config.stages import layer_ranges
    par = cfg.parallel
    placed = schedule_spec(cfg.schedule.name).stage_map(par.pipeline, par.chunks)
    world = grid.p * grid.t * par.context * grid.d
    last = par.pipeline * par.chunks - 1
    ranges = layer_ranges(cfg.model.num_layers, last + 1, par.stage_layers)
    lines = []
    for rank in range(min(world, MAX_ROLE_LINES)):
        c = coordinates_of(rank, grid.p, grid.d, grid.t, par.context)
        stages = placed.stages_of(c.pipeline)
        parts = []
        for s in stages:
            extra = (" + embedding" if s == 0 else "") + (" + head and loss" if s == last else "")
            parts.append(f"{_layers_text(ranges[s])}{extra}")
        lines.append(f"  rank {rank}: pipeline stage {c.pipeline} ({'; '.join(parts)}), "
                     f"tensor shard {c.tensor + 1}/{grid.t}, "
                     + (f"sequence chunks {c.context} and {2 * par.context - 1 - c.context} of "
                        f"{2 * par.context}, " if par.context > 1 else "")
                     + f"data replica {c.data + 1}/{grid.d}")
    if world > MAX_ROLE_LINES:
        ring = f" x {par.context} + context rank)" if par.context > 1 else ""
        lines.append(f"  ... {world - MAX_ROLE_LINES} more: rank = {'(' if ring else ''}"
                     f"(pipeline stage x {grid.d} + data replica){ring} x {grid.t} + tensor shard")
    return lines


def _layers_text(layers: range) -> str:
    return f"layers {layers.start}-{layers.stop - 1}" if layers else "no layers"


def outputs_text(cfg: Config) -> str:
    ck, log = cfg.checkpoint, cfg.log
    out = []
    if log.metrics_file:
        out.append(f"metrics {log.metrics_file} (config {config_path(cfg)})")
    else:
        out.append("no metrics file (set log.metrics_file)")
    if log.tensorboard_dir:
        out.append(f"TensorBoard {log.tensorboard_dir}")
    if ck.dir:
        when = f"every {ck.save_interval} iterations and at the end" if ck.save_interval else "at the end"
        out.append(f"checkpoints {ck.dir} ({when})")
    else:
        out.append("no checkpoints (set checkpoint.dir)")
    if ck.load:
        out.append(f"resuming from {ck.load}")
    return "; ".join(out)


def format_bytes(n: float) -> str:
    """Binary units: 1023 B, 4.0 KiB, 1.50 MiB, 2.00 GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _ramp_text(tr) -> str:
    if not tr.rampup_batch_size:
        return ""
    start, increment, samples = tr.rampup_batch_size
    return (f" (ramped up from {start} by {increment} over the first {samples:,} samples, "
            f"train.rampup_batch_size)")


def end_summary(history: list[dict], cfg: Config, seconds: float, device: torch.device,
                checkpoint: str | None, resume_command: str | None) -> str:
    """What a finished run did, in a few lines (rank 0 prints it)."""
    if not history:
        return f"ptdp: nothing to do: the run was already at train.iters={cfg.train.iters}"
    tr, m = cfg.train, cfg.model
    first, last = history[0]["iter"], history[-1]["iter"]
    tokens = sum(r.get("global_batch_size", tr.global_batch_size) for r in history) * m.seq_length
    step_time = sum(r["step_time_s"] for r in history)
    mean_tflops = sum(r["tflops_per_gpu"] * r["step_time_s"] for r in history) / step_time
    valid = [(r["valid_loss"], r["iter"]) for r in history if "valid_loss" in r]
    lines = [f"ptdp: done: iterations {first}-{last} ({len(history)}) in {seconds:.1f} s, "
             f"{tokens:,} tokens",
             f"  loss: final train {history[-1]['loss']:.4f}{aux_loss_text(history[-1])}"]
    if valid:
        best = min(valid)
        lines[-1] += (f", final validation {valid[-1][0]:.4f} (iteration {valid[-1][1]}), best "
                      f"validation {best[0]:.4f} (iteration {best[1]})")
    else:
        lines[-1] += " (no validation: set train.eval_interval)"
    lines.append(f"  throughput: {tokens / step_time:,.0f} tokens/s, "
                 f"{format_tflops(mean_tflops)} TFLOP/s per rank (model FLOPs), mean step "
                 f"{step_time / len(history) * 1e3:.0f} ms")
    lines.append(f"  peak memory: {max(r['mem_gb'] for r in history):.2f} GiB on rank 0 "
                 f"({'allocated on the GPU' if device.type == 'cuda' else 'resident, CPU'})")
    if checkpoint:
        lines.append(f"  last checkpoint: {checkpoint}")
        if resume_command:
            lines.append(f"  resume (raise train.iters to go further): {resume_command}")
    else:
        lines.append("  no checkpoint written (set checkpoint.dir)")
    return "\n".join(lines)


class SaveTiming:
    """What a save costs training and how long an iteration takes, for the advice on how often
    to save (checkpoint.mtbf_hours; Young/Daly, ptdp/planner/formulas.py
    `checkpoint_interval_s`). The figures travel in each checkpoint's metadata ("timing"), so a
    resumed job's start-up report can give the advice before its own first save."""

    FAR = 2.0   # advise when save_interval is off the optimum by more than this factor

    def __init__(self):
        self.steps: list[float] = []
        self.stall_s: float | None = None
        self.advised = False

    def iteration(self, seconds: float) -> None:
        self.steps.append(seconds)

    def saved(self, stall_s: float) -> float:
        self.stall_s = stall_s
        return stall_s

    def resumed(self, directory) -> None:
        """Take the figures the loaded checkpoint's job measured."""
        import json
        from pathlib import Path
        timing = json.loads((Path(directory) / "metadata.json").read_text()).get("timing") or {}
        self.stall_s = timing.get("save_stall_s")
        self.steps = [timing["iteration_s"]] if timing.get("iteration_s") else []

    def metadata(self) -> dict:
        return {"save_stall_s": self.stall_s, "iteration_s": self._iteration_s()}

    def _iteration_s(self) -> float | None:
        """The median iteration, the first left out (start-up and compilation) when others ran."""
        steps = sorted(self.steps[1:] or self.steps)
        return steps[len(steps) // 2] if steps else None

    def advice(self, ck) -> str | None:
        """Once per job: the Young/Daly interval, when checkpoint.save_interval is far from it."""
        from ptdp.planner.formulas import checkpoint_interval_s
        step = self._iteration_s()
        if self.advised or ck.mtbf_hours is None or self.stall_s is None or not step:
            return None
        self.advised = True
        best_s = checkpoint_interval_s(self.stall_s, ck.mtbf_hours * 3600.0)
        best = max(1, round(best_s / step))
        text = (f"checkpoint: a save stalls training {self.stall_s:.2f} s and an iteration takes "
                f"{step:.2f} s; with failures every {ck.mtbf_hours:g} h (checkpoint.mtbf_hours) "
                f"the least work is lost saving every sqrt(2 x save x MTBF) = {best_s:,.0f} s, "
                f"about {best} iterations")
        current = ck.save_interval
        if current and max(current / best, best / current) <= self.FAR:
            return None
        now = f"checkpoint.save_interval={current}" if current else "saving only at the end"
        return f"{text}; {now} is far from it: consider checkpoint.save_interval={best}"


def expert_load_summary(layers: list[int], totals) -> str | None:
    """The run's most and least loaded experts: `totals` [MoE layers, E] tokens routed to each
    expert of each MoE layer (`layers`, global indices) over the run (ptdp/training/experts.py),
    each as its share of its layer's choices."""
    shares = totals / totals.sum(1, keepdim=True).clamp(min=1)
    if not layers or not float(totals.sum()):
        return None
    where = lambda flat: divmod(int(flat), shares.shape[1])   # noqa: E731
    (hi_layer, hi), (lo_layer, lo) = where(shares.argmax()), where(shares.argmin())
    fair = 1 / shares.shape[1]
    return (f"  experts: most loaded layer {layers[hi_layer]} expert {hi} "
            f"({shares[hi_layer, hi]:.1%} of its layer's choices), least loaded layer "
            f"{layers[lo_layer]} expert {lo} ({shares[lo_layer, lo]:.1%}); balanced: {fair:.1%}")
