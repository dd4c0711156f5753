"""`ptdp train CONFIG [key=value ...]`: one rank per process, under torchrun (or `srun`, one
task per GPU: ptdp/runtime/launch_env.py)."""

from __future__ import annotations

import os
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="train a GPT or BERT model (under torchrun or srun, one process per rank)",
        description="Train with the layout, schedule and model of CONFIG. Overrides are "
                    "dotted keys, e.g. parallel.tensor=2 train.iters=20 (prefer key=value: "
                    "torchrun swallows flags that look like its own). Started by srun one task "
                    "per GPU (no torchrun), it forms the job from SLURM's variables. Every rank "
                    "first runs the checks of `ptdp check`; if one fails, rank 0 prints one "
                    "line per problem and every rank exits with code 2 before any process "
                    "group exists.")
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    parser.add_argument("--verbose", action="store_true",
                        help="print the full resolved config at start-up (same as "
                             "log.verbose=true; it is always written beside the metrics file)")
    parser.set_defaults(func=run)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name) or default)
    except ValueError:
        return default


def run(args) -> int:
    from ptdp.checks import check_job
    from ptdp.runtime.exit_status import CONFIG_ERROR, record_exit
    from ptdp.runtime.launch_env import LaunchError, adopt_slurm_environment

    try:
        adopt_slurm_environment()   # `srun` one task per GPU, without torchrun
    except LaunchError as err:
        print(f"ptdp train: {err}", file=sys.stderr)
        record_exit(CONFIG_ERROR)
        return CONFIG_ERROR
    overrides = list(args.overrides) + (["log.verbose=true"] if args.verbose else [])
    found = check_job(args.config, overrides, _env_int("WORLD_SIZE", 1),
                      ranks_per_node=_env_int("LOCAL_WORLD_SIZE", 1))
    if found.errors:
        if _env_int("RANK", 0) == 0:  # every rank found the same: one copy is enough
            from ptdp.megatron.translate import explain_config_errors
            for line in explain_config_errors(found.errors):   # + what a Megatron spelling is
                print(f"ptdp train: {line}", file=sys.stderr, flush=True)
        record_exit(CONFIG_ERROR)   # not worth a restart (ptdp/runtime/exit_status.py)
        return _after_rank_0_said_why(CONFIG_ERROR)
    if _env_int("RANK", 0) == 0:
        for line in found.warnings:   # e.g. tensor groups that straddle nodes
            print(f"ptdp train: warning: {line}", file=sys.stderr)
    from ptdp.runtime.joblock import die_with_parent
    if os.environ.get("TORCHELASTIC_RUN_ID"):   # under torchrun: never outlive its agent
        die_with_parent()
    refusal = _hold_outputs(found.cfg)
    if refusal:
        if _env_int("RANK", 0) == 0:
            print(f"ptdp train: {refusal}", file=sys.stderr, flush=True)
        record_exit(CONFIG_ERROR)
        return _after_rank_0_said_why(CONFIG_ERROR)
    from ptdp.data.indexed import IndexedDataError
    from ptdp.runtime.startup import shutdown
    from ptdp.training import Trainer
    final = _final_exits()
    try:
        Trainer(found.cfg).train(resume_command(args, found.cfg))
    except tuple(final) as err:
        # every rank stops here together, for a reason a restart would meet again: rank 0
        # says why in one line, each rank leaves the code for the restart loop
        if _env_int("RANK", 0) == 0:
            print(f"ptdp train: {err}", file=sys.stderr)
        code = next(code for kind, code in final.items() if isinstance(err, kind))
        record_exit(code)
        return code
    except IndexedDataError as err:   # found by the rank that read it (a token id out of range)
        print(f"ptdp train: rank {_env_int('RANK', 0)}: {err}", file=sys.stderr, flush=True)
        record_exit(CONFIG_ERROR)     # the same data fails the same way again
        return CONFIG_ERROR
    finally:
        shutdown()
    return 0


# How long a rank other than 0 stays, at most, after a problem every rank found and rank 0 prints.
SAID_WHY_GRACE_S = 3.0


def _after_rank_0_said_why(code: int) -> int:
    """`code`, returned once rank 0 has had time to print why. Every rank finds the same
    problem before any process group exists, and only rank 0 prints it; torchrun's agent ends
    the other workers as soon as one exits, so a rank that left first could have rank 0 killed
    before its line was out. Under torchrun the agent ends this wait when rank 0 exits."""
    if _env_int("RANK", 0) != 0 and _env_int("WORLD_SIZE", 1) > 1:
        import time
        time.sleep(SAID_WHY_GRACE_S)
    return code


def _hold_outputs(cfg) -> str | None:
    """Hold the job's outputs (one job per checkpoint.dir and metrics file,
    ptdp/runtime/joblock.py): the refusal every rank ends with, or None. Ranks may find
    different things (a folder nodes see differently), so they agree through the job's store:
    a rank leaving alone would leave the others waiting for it in the process group's
    rendezvous."""
    from ptdp.runtime.joblock import JobInUse, agree, hold_outputs
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    try:
        hold_outputs(cfg, rank)
        refusal = None
    except JobInUse as err:
        refusal = str(err)
    if world == 1:
        return refusal
    from ptdp.runtime.startup import backend_timeout_s, job_store
    return agree(job_store(backend_timeout_s(cfg)), rank, world, refusal)


def _final_exits() -> dict:
    """Why a job ends that a restart would not mend -> its exit code (ptdp/runtime/exit_status.py):
    checkpoint.dir on a node's own disk and no intact checkpoint are configuration errors,
    a full disk and divergence have codes of their own."""
    from ptdp.checkpoint.integrity import DiskFull
    from ptdp.checkpoint.load import NoIntactCheckpoint
    from ptdp.checkpoint.safety import NotSharedError
    from ptdp.runtime.exit_status import CONFIG_ERROR, DISK_FULL, DIVERGED
    from ptdp.training import DivergenceError
    return {NotSharedError: CONFIG_ERROR, NoIntactCheckpoint: CONFIG_ERROR, DiskFull: DISK_FULL,
            DivergenceError: DIVERGED}


def resume_command(args, cfg) -> str | None:
    """The command that continues this job from its checkpoint.dir: the launcher (the
    tools/ script's, exported as PTDP_RESUME_PREFIX, else torchrun with this job's sizes),
    the same config and overrides, and checkpoint.load pointing at checkpoint.dir."""
    import shlex
    if not cfg.checkpoint.dir:
        return None
    prefix = os.environ.get("PTDP_RESUME_PREFIX")
    if not prefix:
        nodes = _env_int("WORLD_SIZE", 1) // max(_env_int("LOCAL_WORLD_SIZE", 1), 1)
        prefix = (f"torchrun --nproc-per-node {_env_int('LOCAL_WORLD_SIZE', 1)}"
                  + (f" --nnodes {nodes} --node-rank <this node>" if nodes > 1 else "")
                  + " -m ptdp train")
    kept = [o for o in args.overrides if not o.startswith("checkpoint.load=")]
    words = [args.config, *kept, f"checkpoint.load={cfg.checkpoint.dir}"]
    return prefix + " " + " ".join(shlex.quote(w) for w in words)
