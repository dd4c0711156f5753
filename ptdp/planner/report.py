"""Turning a search result into what users read: a ranked table, JSON, a trainer YAML."""

from __future__ import annotations

import copy

from ptdp.planner.cost_model import Prediction
from ptdp.planner.search import SearchResult, why_slower
from ptdp.planner.stage_plan import StagePlan

MAX_STAGE_LINES = 8
TIME_LABELS = {"compute": "compute", "recompute": "recompute", "tensor_comm": "tensor all-reduce",
               "pipeline_p2p": "pipeline p2p", "context_ring": "context ring",
               "expert_all_to_all": "expert all-to-all", "bubble": "bubble", "dp_exposed": "DP all-reduce",
               "embedding_sync": "embedding sync", "optimizer": "optimizer"}


def _context(lay) -> dict:
    """parallel.context, written only when the plan uses context parallelism."""
    return {"context": lay.context} if lay.context > 1 else {}


def _expert(lay) -> dict:
    """parallel.expert, written only when the plan uses expert parallelism."""
    return {"expert": lay.expert} if lay.expert > 1 else {}


def expert_choice(result: SearchResult) -> dict:
    """Per expert-parallel size the search tried (MoE models): its best feasible layout and
    why it lost to the best, or that none fit."""
    best = result.best
    out = {}
    for e in sorted(result.experts):
        fits = [p for p in result.ranked if p.layout.expert == e]
        if not fits:
            out[e] = {"evaluated": result.experts[e], "feasible": 0}
            continue
        top = fits[0]
        out[e] = {"evaluated": result.experts[e], "feasible": len(fits),
                  "layout": top.layout.describe(), "step_time_s": round(top.step_time_s, 6),
                  "memory_gb_per_gpu": round(top.memory_gb_per_gpu, 3),
                  "expert_all_to_all_s": round(top.time.get("expert_all_to_all", 0.0), 6),
                  "why_slower": why_slower(top, best)}
    return out


def _expert_lines(result: SearchResult) -> list[str]:
    choice = expert_choice(result)
    e = result.best.layout.expert
    held = f"each rank holds 1/{e} of every MoE layer's experts" if e > 1 else \
        "every rank holds all the experts"
    lines = [f"expert parallelism: e={e} chosen ({held}); the best layout of each e tried:"]
    for size, row in choice.items():
        if not row["feasible"]:
            lines.append(f"  e={size}: none of {row['evaluated']} layouts fits in memory")
            continue
        lines.append(f"  e={size}: {row['layout']}, {row['step_time_s']:.3f} s, "
                     f"{row['memory_gb_per_gpu']:.1f} GB, all-to-all "
                     f"{row['expert_all_to_all_s']:.3f} s ({row['why_slower']})")
    return lines


def plan_dict(pred: Prediction, precision: str, attention: str = "flash") -> dict:
    """The JSON shape of one layout (what `ptdp plan --json` prints); `recompute_modules`:
    what it recomputes as the plan modelled it with `attention` (empty unless selective)."""
    lay = pred.layout
    return {
        "parallel": {"tensor": lay.tensor, "pipeline": lay.pipeline, "data": lay.data,
                     "chunks": lay.chunks, "scatter_gather": lay.scatter_gather,
                     "sequence_parallel": lay.sequence_parallel, **_context(lay),
                     **_expert(lay)},
        "distributed_optimizer": lay.distributed_optimizer,
        "micro_batch_size": lay.micro_batch,
        "schedule": lay.schedule,
        "recompute": lay.recompute,
        "recompute_modules": list(lay.recomputed(attention)),
        "precision": precision,
        "predicted": {**{k: round(v, 6) for k, v in pred.summary().items()},
                      "time_breakdown_s": {k: round(v, 6) for k, v in pred.time.items()},
                      "memory_breakdown_gb": pred.memory},
    }


def result_dict(result: SearchResult, header: dict, precision: str, top: int,
                attention: str = "flash") -> dict:
    best = result.best
    out = dict(header)
    out.update(plan_dict(best, precision, attention))
    out["alternatives"] = [{**plan_dict(p, precision, attention), "why_slower": why_slower(p, best)}
                           for p in result.ranked[1:top]]
    out["rejected"] = result.rejected.as_dict()
    out["search"] = {"evaluated": result.evaluated, "feasible": len(result.ranked),
                     "seconds": round(result.seconds, 3)}
    if result.experts:
        out["expert_choice"] = {str(e): row for e, row in expert_choice(result).items()}
    return out


def trainer_config(raw: dict, pred: Prediction, global_batch: int, precision: str,
                   stages: StagePlan | None = None, attention: str = "flash") -> dict:
    """The input YAML with parallel/schedule/train set to the plan (other keys kept); the
    partitioner's stage sizes when they are predicted faster than even ones. The recomputed
    modules the plan modelled with `attention` are written whenever they were pinned or
    differ from the trainer's default (a materialized plan's default adds core_attn), so
    that training the config runs what was predicted."""
    cfg = copy.deepcopy(raw or {})
    lay = pred.layout
    uneven = {"stage_layers": list(stages.planned)} if stages and stages.uneven_wins else {}
    parallel = {k: v for k, v in (cfg.get("parallel") or {}).items() if k != "stage_layers"}
    cfg["parallel"] = {**parallel, "tensor": lay.tensor,
                       "pipeline": lay.pipeline, "data": lay.data, "chunks": lay.chunks,
                       "scatter_gather": lay.scatter_gather,
                       "sequence_parallel": lay.sequence_parallel, **_context(lay),
                       **_expert(lay), **uneven}
    cfg["schedule"] = {**(cfg.get("schedule") or {}), "name": lay.schedule}
    # the layout's recomputation replaces the model file's (its modules included)
    train = {k: v for k, v in (cfg.get("train") or {}).items() if k != "recompute_modules"}
    planned = lay.recomputed(attention)   # the trainer's default: the same layout, flash
    write = planned and (lay.recompute_modules is not None or planned != lay.recomputed("flash"))
    modules = {"recompute_modules": list(planned)} if write else {}
    cfg["train"] = {**train, "micro_batch_size": lay.micro_batch,
                    "global_batch_size": global_batch, "recompute": lay.recompute, **modules,
                    "precision": precision, "distributed_optimizer": lay.distributed_optimizer}
    return cfg


def _row(rank, pred: Prediction, best: Prediction, context: bool = False,
         expert: bool = False) -> list[str]:
    lay = pred.layout
    return [str(rank), str(lay.pipeline), str(lay.tensor),
            *([str(lay.context)] if context else []), str(lay.data),
            *([str(lay.expert)] if expert else []), str(lay.chunks),
            str(lay.micro_batch), lay.schedule, lay.recompute,
            "yes" if lay.scatter_gather else "no", "yes" if lay.sequence_parallel else "no",
            "yes" if lay.distributed_optimizer else "no",
            f"{pred.step_time_s:.3f}",
            f"{pred.tflops_per_gpu:.1f}", f"{pred.mfu:.0%}", f"{pred.memory_gb_per_gpu:.1f}",
            f"{pred.bubble_fraction:.1%}", why_slower(pred, best)]


def format_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_result(result: SearchResult, title: str, top: int) -> str:
    best = result.best
    context = best.layout.context > 1   # a "c" column only when c is pinned above 1
    expert = bool(result.experts)       # an "e" column for mixtures of experts
    header = ["#", "p", "t", *(["c"] if context else []), "d", *(["e"] if expert else []), "v",
              "b", "schedule", "recompute", "sg", "sp", "distopt", "step_s", "TFLOP/s", "MFU",
              "mem_GB", "bubble", "vs best"]
    rows = [_row(i + 1, p, best, context, expert) for i, p in enumerate(result.ranked[:top])]
    rej = result.rejected
    lines = [title,
             f"searched {result.evaluated} layouts in {result.seconds:.2f} s; "
             f"{len(result.ranked)} fit in memory", "",
             format_table(rows, header), ""]
    total = sum(best.time.get(k, 0.0) for k in TIME_LABELS)
    parts = ", ".join(f"{TIME_LABELS[k]} {best.time[k] / total:.0%}" for k in TIME_LABELS
                      if best.time.get(k, 0.0) / total >= 0.005)
    lines.append(f"best layout's time: {parts}")
    mem = best.memory
    lines.append("best layout's memory (GB): " + ", ".join(
        f"{k} {mem[k]:.1f}" for k in ("weights", "gradients", "optimizer", "activations", "buffers")))
    if expert:
        lines += _expert_lines(result)
    if rej.counts:
        lines += ["", "why the others lost (choices pruned or rejected):"]
        for cat, n in sorted(rej.counts.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {cat:<14} {n:>7}  e.g. {rej.examples[cat]}")
    return "\n".join(lines)


def stages_dict(stages: StagePlan) -> dict:
    """The JSON of a proposed uneven split (`ptdp plan --json`, key "stages")."""
    return {"stage_layers": list(stages.planned),
            "stage_times_s": [round(t, 6) for t in stages.planned_times],
            "even_stage_layers": list(stages.even) if stages.even else None,
            "even_stage_times_s": ([round(t, 6) for t in stages.even_times]
                                   if stages.even_times else None),
            "predicted_saving_s": round(stages.saving_s, 6)}


def format_stages(stages: StagePlan, head_layers: tuple[float, float]) -> str:
    """Why and how the best layout's stages are uneven, one line per stage (every stage up to
    MAX_STAGE_LINES, else those that differ from the even split). Only printed when the
    partitioner's split is predicted faster than the even one."""
    embed, head = head_layers
    gain = stages.saving_s / stages.step_time_s if stages.step_time_s else 0.0
    even = f" instead of even {list(stages.even)}" if stages.even else ""
    lines = [f"stages (the partitioner, ptdp/planner/partitioner.py): parallel.stage_layers = "
             f"{list(stages.planned)}{even}",
             f"  predicted {gain:.1%} faster ({stages.saving_s:.3f} s per iteration): the "
             f"slowest pipeline rank takes {stages.planned_slowest_rank * 1e3:.2f} ms per "
             f"micro-batch instead of {(stages.even_slowest_rank or 0) * 1e3:.2f}; the embedding "
             f"costs {embed:.2f} and the output layer and loss {head:.2f} transformer layers"]
    last = len(stages.planned) - 1
    for s, (count, t) in enumerate(zip(stages.planned, stages.planned_times)):
        if last >= MAX_STAGE_LINES and stages.even and count == stages.even[s]:
            continue
        extra = (" + embedding" if s == 0 else "") + (" + output layer and loss" if s == last
                                                      else "")
        was = (f"   (even: {stages.even[s]}, {stages.even_times[s] * 1e3:.2f} ms)"
               if stages.even else "")
        lines.append(f"  stage {s}: {count} layer{'s' if count != 1 else ''}{extra}, "
                     f"{t * 1e3:.2f} ms per micro-batch{was}")
    if last >= MAX_STAGE_LINES and stages.even:
        lines.append("  other stages: as the even split")
    return "\n".join(lines)
