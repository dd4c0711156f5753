"""`ptdp train CONFIG [key=value ...]`: one rank per process, under torchrun."""

from __future__ import annotations

import os
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="train a GPT or BERT model (run under torchrun, one process per rank)",
        description="Train with the layout, schedule and model of CONFIG. Overrides are "
                    "dotted keys, e.g. parallel.tensor=2 train.iters=20 (prefer key=value: "
                    "torchrun swallows flags that look like its own).")
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ptdp.config import ConfigError, load_config
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"ptdp train: config error: {err}", file=sys.stderr)
        return 2
    from ptdp.runtime import shutdown
    from ptdp.training import DivergenceError, Trainer
    try:
        Trainer(cfg).train()
    except DivergenceError as err:  # every rank stops here together; rank 0 says why
        if os.environ.get("RANK", "0") == "0":
            print(f"ptdp train: {err}", file=sys.stderr)
        return 3
    finally:
        shutdown()
    return 0
