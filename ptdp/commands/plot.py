"""`ptdp plot METRICS.jsonl [...] --out curves.png` (ptdp/metrics/plot.py)."""

from __future__ import annotations

import sys
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plot", help="draw loss, learning rate, throughput and loss scale of one or more runs",
        description="Reads metrics files (log.metrics_file: one JSON record per iteration) and "
                    "draws train and validation loss, learning rate, tokens/s and loss scale "
                    "against the iteration, the runs overlaid. Needs matplotlib "
                    "(pip install 'ptdp[plot]').")
    parser.add_argument("metrics", nargs="+", help="metrics .jsonl files")
    parser.add_argument("--out", default="curves.png", help="image to write (.png, .pdf, .svg)")
    parser.add_argument("--title", default=None, help="figure title")
    parser.set_defaults(func=run)


def run(args) -> int:
    missing = [p for p in args.metrics if not Path(p).is_file()]
    if missing:
        print(f"ptdp plot: no such metrics file: {missing[0]}", file=sys.stderr)
        return 2
    try:
        from ptdp.metrics.plot import plot_metrics
        out = plot_metrics(args.metrics, args.out, args.title)
    except ImportError:
        print("ptdp plot: matplotlib is not installed: pip install 'ptdp[plot]'", file=sys.stderr)
        return 2
    except (ValueError, KeyError) as err:
        print(f"ptdp plot: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(args.metrics)} run(s))")
    return 0
