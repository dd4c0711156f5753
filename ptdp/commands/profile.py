"""`ptdp profile MODEL.yaml --out PROFILE.yaml`: measure this machine for the planner.

The measuring is in ptdp/profiler/ (it imports torch and the model code); this module only
parses arguments, so `ptdp --help` stays fast.
"""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    prof = subparsers.add_parser(
        "profile", help="measure layer times and bandwidths here; write a hardware profile",
        description="Measure per-layer forward/backward time, activation and weight bytes at "
                    "several micro-batch sizes on this device, and collective/p2p bandwidth "
                    "between local ranks; write a hardware profile for `ptdp plan`.")
    prof.add_argument("model", help="YAML with a model: section (the shape to measure)")
    prof.add_argument("--out", required=True, help="profile YAML to write")
    prof.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    prof.add_argument("--micro-batches", default="1,2,4", help="comma-separated b values")
    prof.add_argument("--tensor", default="1,2", help="comma-separated t values to shard for")
    prof.add_argument("--ranks", type=int, default=2,
                      help="local ranks for bandwidth tests; on CPU the busy-node measurements "
                           "run 2, 4, ... up to this many ranks at once")
    prof.add_argument("--ranks-per-node", type=int, default=8,
                      help="ranks one node of this kind hosts (the profile's gpus_per_node)")
    prof.add_argument("--base", default=None,
                      help="GPU only: datasheet profile for what one device cannot measure")
    prof.add_argument("--threads", type=int, default=1,
                      help="torch threads per process (match the trainer's ranks)")
    prof.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    prof.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    prof.add_argument("--iters", type=int, default=5, help="timed repetitions per point")
    prof.add_argument("--memory-repeats", type=int, default=2,
                      help="CPU: runs of each memory calibration job, the largest peak kept "
                           "(a peak varies by a few %% from run to run; 1 is quicker, 2 errs on "
                           "the safe side)")
    prof.set_defaults(func=run)


def run(args) -> int:
    from ptdp.config import ConfigError
    from ptdp.hardware import HardwareError
    from ptdp.planner.errors import PlanError
    try:
        from ptdp.profiler.build import main  # torch is imported only here
        return main(args)
    except (PlanError, HardwareError, ConfigError) as err:
        print(f"ptdp profile: error: {err}", file=sys.stderr)
        return 2
