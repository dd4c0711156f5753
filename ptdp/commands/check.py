"""`ptdp check CONFIG [key=value ...] --world-size N`: validate a job without starting it."""

from __future__ import annotations

import os
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "check", help="validate a training job without starting it",
        description="Check everything a job needs before any rank starts: the config (keys, "
                    "ranges, layout against the world size), data files (.bin/.idx headers and "
                    "sizes, enough tokens for one sequence), the tokenizer, log.hardware, "
                    "optional packages, the checkpoint to load and the output folders. Prints "
                    "the resolved layout, the micro-batch count and a per-rank memory estimate "
                    "(exit 0), or every problem found, one line each (exit 2). Creates nothing. "
                    "`ptdp train` runs the same checks on every rank before it starts.")
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="ranks the job will run on (default: $WORLD_SIZE, else 1)")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="ranks per node, as torchrun's --nproc-per-node: checks that each "
                             "GPU rank gets a visible GPU of its own and warns when tensor "
                             "groups straddle nodes (default: not checked)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ptdp.checks import check_job
    from ptdp.job_summary import summary

    world = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE") or 1)
    if world < 1:
        print(f"ptdp check: --world-size must be >= 1, got {world}", file=sys.stderr)
        return 2
    found = check_job(args.config, args.overrides, world, ranks_per_node=args.nproc_per_node)
    if found.errors:
        from ptdp.megatron.translate import explain_config_errors
        for line in explain_config_errors(found.errors):   # + what a Megatron spelling is
            print(f"ptdp check: {line}", file=sys.stderr)
        return 2
    print(f"ptdp check: {args.config} is ready to train on {world} rank(s)")
    for line in summary(found.cfg, world, found.hardware):
        print(f"  {line}")
    for line in found.warnings:
        print(f"  warning: {line}")
    for line in found.notes:
        print(f"  note: {line}")
    return 0
