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
    from ptdp.runtime.joblock import die_with_parent
    if os.environ.get("TORCHELASTIC_RUN_ID"):   # under torchrun: never outlive its agent
        die_with_parent()
    overrides = list(args.overrides) + (["log.verbose=true"] if args.verbose else [])
    found = check_job(args.config, overrides, _env_int("WORLD_SIZE", 1),
                      ranks_per_node=_env_int("LOCAL_WORLD_SIZE", 1))
    if not found.errors and _env_int("RANK", 0) == 0:
        for line in found.warnings:   # e.g. tensor groups that straddle nodes
            print(f"ptdp train: warning: {line}", file=sys.stderr)
    code, shown = _agreed_verdict(found)
    if code:
        for line in shown:
            print(f"ptdp train: {line}", file=sys.stderr, flush=True)
        record_exit(code)   # a config error is not worth a restart (ptdp/runtime/exit_status.py)
        return _after_rank_0_said_why(code)
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


RENDEZVOUS = ("RANK", "MASTER_ADDR", "MASTER_PORT")   # what the job's store is found by

# How long a rank other than 0 stays, at most, after the verdict that stops every rank.
SAID_WHY_GRACE_S = 3.0


def _after_rank_0_said_why(code: int) -> int:
    """`code`, returned once rank 0 has had time to print why. Every rank stops on the same
    verdict before any process group exists, and only rank 0 prints it; torchrun's agent ends
    the other workers as soon as one exits, so a rank that left first could have rank 0 killed
    before its line was out. Under torchrun the agent ends this wait when rank 0 exits."""
    if _env_int("RANK", 0) != 0 and _env_int("WORLD_SIZE", 1) > 1:
        import time
        time.sleep(SAID_WHY_GRACE_S)
    return code


def _agreed_verdict(found) -> tuple[int, list[str]]:
    """The exit code that stops the job (0: it goes on), the same on every rank, and the lines
    this rank prints. A rank stops the job with the checks' errors, else with a refusal to
    hold the job's outputs (one job per checkpoint.dir and metrics file,
    ptdp/runtime/joblock.py); the ranks pool their verdicts (ptdp/runtime/agreement.py), since
    ranks on different nodes can find different things, and rank 0 prints them. When some
    ranks never arrive, the lowest rank that did names them (exit 4, like a lost peer: a
    restart may mend it)."""
    from ptdp.runtime.agreement import MissingRanks, agree
    from ptdp.runtime.exit_status import CONFIG_ERROR, HUNG
    problems = _own_problems(found)
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if world == 1 or not all(os.environ.get(name) for name in RENDEZVOUS):
        # (a job of one, or a rank started without torchrun's or srun's variables: no store
        # to agree through, only its own findings)
        return (CONFIG_ERROR if problems else 0), problems if rank == 0 else []
    from ptdp.config.schema import Config
    from ptdp.runtime.startup import backend_timeout_s, job_store
    timeout_s = backend_timeout_s(found.cfg or Config())
    try:
        verdict = agree(job_store(timeout_s), rank, world, problems, timeout_s)
    except MissingRanks as err:
        return HUNG, [err.line] if err.line else []
    return (CONFIG_ERROR if verdict else 0), verdict if rank == 0 else []


def _own_problems(found) -> list[str]:
    """This rank's verdict: the checks' errors (with what a Megatron spelling means), or,
    when they pass, whether it can hold the job's outputs."""
    if found.errors:
        from ptdp.megatron.translate import explain_config_errors
        return list(explain_config_errors(found.errors))
    from ptdp.runtime.joblock import JobInUse, hold_outputs
    try:
        hold_outputs(found.cfg, _env_int("RANK", 0))
    except JobInUse as err:
        return [str(err)]
    except OSError as err:   # e.g. a folder this node cannot create: named, not a traceback
        return [f"cannot hold the job's outputs: {err}"]
    return []


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
