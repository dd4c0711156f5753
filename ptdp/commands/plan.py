"""`ptdp plan`. No torch import here (nor anywhere in ptdp.planner): planning must stay fast.

Bad input (unknown hardware, impossible --fix, GPU counts that do not divide) prints one
line naming the problem and exits with code 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from ptdp.config import ConfigError, config_from_dict, load_model_yaml, validate
from ptdp.config.catalogue import Planner, names_where, schedule_spec
from ptdp.config.models import DEFAULT_PRESET
from ptdp.hardware import HardwareError, foreign_profile, load_hardware
from ptdp.planner.compute import ModelShape
from ptdp.planner.cost_model import SCHEDULES, Workload
from ptdp.planner.errors import PlanError
from ptdp.planner.formulas import active_parameters, parameter_total
from ptdp.planner.report import (format_result, format_stages, result_dict, stages_dict,
                                 trainer_config)
from ptdp.planner.stage_plan import head_in_layers, layer_profiles, plan_stages
from ptdp.planner.search import STRICT_SCHEDULES, parse_fix, search


def register(subparsers) -> None:
    plan = subparsers.add_parser(
        "plan", help="pick (p, t, d, v, b, schedule, recompute) for a model and cluster",
        description="Search every valid PTD-P layout with the closed-form cost model and rank "
                    "them by predicted step time.")
    plan.add_argument("model", help="YAML with a model: section (other sections are kept)")
    plan.add_argument("--hardware", required=True,
                      help="profile name in configs/hardware (e.g. a100-80gb) or a YAML path")
    plan.add_argument("--nodes", type=int, default=1)
    plan.add_argument("--gpus-per-node", type=int, default=None,
                      help="default: the hardware profile's")
    plan.add_argument("--gpus", type=int, default=None,
                      help="total GPUs instead of --nodes (a multiple of --gpus-per-node)")
    plan.add_argument("--global-batch-size", type=int, default=None,
                      help="B; default: train.global_batch_size from the YAML")
    plan.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                      help="default: the hardware profile's")
    plan.add_argument("--fix", default=None,
                      help="pin choices, e.g. p=8,t=8,b=1,v=2,schedule=interleaved,"
                           "recompute=full,sg=true,distopt=true; c=2 for context parallelism "
                           "(c = 1 unless pinned here or by the YAML's parallel.context); e=4 "
                           "pins expert parallelism (MoE models; searched otherwise)")
    plan.add_argument("--allow-2bw", action="store_true",
                      help="also consider PipeDream-2BW (relaxed, 1-stale weight updates)")
    plan.add_argument("--allow-distributed-optimizer", action="store_true",
                      help="also consider sharding the optimizer state over the data-parallel "
                           "ranks (train.distributed_optimizer: same arithmetic, less memory, "
                           "one all-gather of the weights per step)")
    plan.add_argument("--attention", choices=("flash", "materialized"), default=None,
                      help="attention kernel memory/time model; default: the profile's")
    plan.add_argument("--top", type=int, default=10, help="rows to print")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.add_argument("--write-config", metavar="OUT.yaml", default=None,
                      help="write the best layout as a config `ptdp train` runs unchanged")
    plan.set_defaults(func=run_plan)


def _fail(command: str, err: Exception) -> int:
    print(f"ptdp {command}: error: {err}", file=sys.stderr)
    return 2


def _cluster(args, hw) -> tuple[int, int]:
    """(total GPUs, GPUs per node) from --nodes/--gpus/--gpus-per-node."""
    per_node = args.gpus_per_node or hw.gpus_per_node
    if per_node < 1 or args.nodes < 1:
        raise PlanError("--nodes and --gpus-per-node must be positive")
    if args.gpus is None:
        return args.nodes * per_node, per_node
    if args.gpus < 1:
        raise PlanError("--gpus must be positive")
    if args.gpus > per_node and args.gpus % per_node:
        raise PlanError(f"--gpus {args.gpus} is not a whole number of {per_node}-GPU nodes")
    return args.gpus, min(per_node, args.gpus)


def _global_batch(args, raw: dict, cfg) -> int:
    if args.global_batch_size is not None:
        batch = args.global_batch_size
    elif "global_batch_size" in ((raw.get("train") or {})):
        batch = cfg.train.global_batch_size
    else:
        raise PlanError("--global-batch-size is required (the YAML has no train.global_batch_size)")
    if batch < 1:
        raise PlanError(f"--global-batch-size must be positive, got {batch}")
    return batch


def run_plan(args) -> int:
    try:
        return _plan(args)
    except (PlanError, HardwareError, ConfigError) as err:
        return _fail("plan", err)
    except BrokenPipeError:        # `ptdp plan ... | head`
        sys.stderr.close()
        return 0


def _plan(args) -> int:
    raw, cfg = load_model_yaml(args.model)
    hw = load_hardware(args.hardware)
    foreign = foreign_profile(hw)
    if foreign:   # fine when planning for that hardware from elsewhere; say so either way
        print(f"warning: {foreign}; its measured times describe that machine (run `ptdp "
              f"profile` here if this machine is the one to plan for)", file=sys.stderr)
    gpus, per_node = _cluster(args, hw)
    batch = _global_batch(args, raw, cfg)
    precision = args.precision or hw.default_precision
    hw.peak_flops(precision)  # fails early, naming the precisions the profile knows
    if args.top < 1:
        raise PlanError("--top must be at least 1")
    fixed = parse_fix(args.fix)
    if cfg.parallel.context > 1:   # the YAML's context parallelism is kept (unless --fix c=)
        fixed.setdefault("context", cfg.parallel.context)
    opt_in = args.allow_2bw or ("schedule" in fixed
                                and schedule_spec(fixed["schedule"]).planner is Planner.OPT_IN)
    schedules = SCHEDULES if opt_in else STRICT_SCHEDULES
    shape = ModelShape.from_config(cfg.model)
    if fixed.get("expert", 1) > 1 and not shape.experts:
        raise PlanError(f"--fix e={fixed['expert']}: expert parallelism needs model.num_experts > 0")
    work = Workload(shape, batch, precision, per_node)
    result = search(hw, work, gpus, fixed, attention=args.attention, schedules=schedules,
                    distributed_optimizer=args.allow_distributed_optimizer)
    if not result.ranked:
        reasons = "; ".join(f"{cat} ({n}, e.g. {result.rejected.examples[cat]})"
                            for cat, n in result.rejected.counts.items()) or "no candidates"
        raise PlanError(f"no layout of {gpus} GPUs fits"
                        f"{' with --fix ' + args.fix if args.fix else ''}: {reasons}")
    m = cfg.model
    params = parameter_total(shape)   # Eq. 4.3, generalised for Llama-style blocks
    stages = plan_stages(hw, work, result.best, args.attention)
    uneven = stages is not None and stages.uneven_wins
    if args.json:
        header = {"model": {"arch": m.arch, "preset": m.preset, "parameters": params,
                            "num_layers": m.num_layers, "hidden_size": m.hidden_size,
                            "num_heads": m.num_heads, "num_kv_heads": m.num_kv_heads,
                            "ffn_hidden_size": m.ffn_hidden_size, "activation": m.activation,
                            "seq_length": m.seq_length, "vocab_size": m.vocab_size,
                            "tie_embeddings": m.tie_embeddings, "mtp_layers": m.mtp_layers,
                            **_moe_header(m, shape)},
                  "hardware": hw.name, "gpus": gpus, "gpus_per_node": per_node,
                  "global_batch_size": batch}
        out = result_dict(result, header, precision, args.top, args.attention or hw.attention)
        if uneven:
            out["stages"] = stages_dict(stages)
        print(json.dumps(out, indent=2))
    else:
        block = f" ({m.preset} block)" if m.preset != DEFAULT_PRESET else ""
        title = (f"{m.arch}{block} {params / 1e9:.1f}B parameters ({m.num_layers} layers, "
                 f"h={m.hidden_size}, {m.heads_text()}, f={m.ffn_hidden_size}, "
                 f"s={m.seq_length}, V={m.vocab_size}{_moe_title(m, shape)}{_mtp_title(m)}) "
                 f"on {gpus} x {hw.name} ({gpus // per_node} node(s) x {per_node}), "
                 f"B={batch}, {precision}")
        print(format_result(result, title, args.top))
        if uneven:
            profiles = layer_profiles(hw, work, result.best.layout, args.attention)
            print(format_stages(stages, head_in_layers(profiles)))
        if schedules == STRICT_SCHEDULES:
            skipped = " and ".join(names_where(lambda s: s.planner is Planner.OPT_IN))
            print(f"({skipped} not considered: it changes the weight-update rule; --allow-2bw to "
                  f"include)")
    if args.write_config:
        out = trainer_config(raw, result.best, batch, precision, stages,
                             args.attention or hw.attention)
        _check_trainer_accepts(out, gpus)
        Path(args.write_config).write_text(yaml.safe_dump(out, sort_keys=False))
        if not args.json:
            print(f"wrote {args.write_config}")
    return 0


def _moe_header(m, shape) -> dict:
    """The --json model entries of a mixture of experts: its experts and active parameters."""
    if not shape.experts:
        return {}
    return {"num_experts": m.num_experts, "moe_top_k": m.moe_top_k,
            "moe_ffn_hidden_size": m.moe_ffn_hidden_size,
            "moe_shared_ffn_hidden_size": m.moe_shared_ffn_hidden_size,
            "active_parameters": active_parameters(shape)}


def _moe_title(m, shape) -> str:
    if not shape.experts:
        return ""
    return (f", {m.num_experts} experts, top-{m.moe_top_k}, f_moe={m.moe_ffn_hidden_size}, "
            f"{active_parameters(shape) / 1e9:.1f}B active")


def _mtp_title(m) -> str:
    """The multi-token-prediction depths (counted in the parameters, FLOPs and last stage)."""
    if not m.mtp_layers:
        return ""
    return f", {m.mtp_layers} MTP depth{'s' if m.mtp_layers > 1 else ''}"


def _check_trainer_accepts(out: dict, gpus: int) -> None:
    """Validate the written config as `ptdp train` will (ConfigError naming the key)."""
    validate(config_from_dict(out, "planned config"), gpus)
