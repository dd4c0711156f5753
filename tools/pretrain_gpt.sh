#!/usr/bin/env bash
# Launch `ptdp train` under torchrun on this node: one process per GPU, or CPU ranks with gloo
# when no GPU is visible. Run the same command on every node of a multi-node job.
#
#   tools/pretrain_gpt.sh [CONFIG.yaml] [key=value ...]
#
# CONFIG defaults to configs/gpt_tiny.yaml. Overrides are dotted config keys
# (parallel.tensor=2 train.iters=50 ...); pass them as key=value only: torchrun would swallow
# flags that begin like its own (--node..., --master..., --virtual...).
#
# Environment (defaults in brackets):
#   NNODES          nodes in the job (Megatron's NUM_NODES also works)   [1]
#   NODE_RANK       this node's index, 0 .. NNODES-1                     [0]
#   MASTER_ADDR     address of node 0                                    [127.0.0.1]
#   MASTER_PORT     a free TCP port on node 0                            [a free port when NNODES=1, else 29500]
#   GPUS_PER_NODE   processes on this node                               [visible GPUs; NPROC if none]
#   NPROC           CPU ranks on this node when no GPU is visible        [8]
#   OMP_NUM_THREADS threads per CPU rank                                 [1]
#   PYTHON          Python interpreter                                   [python3]
#   TORCHRUN        launcher command                                     [$PYTHON -m torch.distributed.run, i.e. torchrun]
#   TORCHRUN_ARGS   extra torchrun flags                                 []
#   MAX_RESTARTS    restart the job this many times after a failure      [0]
#                   (each restart resumes from the newest checkpoint in checkpoint.dir; a
#                   configuration or data error, a divergence or a full disk is not
#                   restarted: docs/troubleshooting.md)
#   DRY_RUN=1       print the command instead of running it
#   CUDA_DEVICE_MAX_CONNECTIONS  set to 1 by `ptdp train` itself when parallel.tensor or
#                   parallel.context > 1 (as Megatron-LM requires), unless set here
#   TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT, TORCH_NCCL_DEBUG_INFO_TEMP_FILE
#                   torch's NCCL flight recorder, dumped on a timeout or a hang the hang
#                   detector names              [2000, 1, /tmp/ptdp_nccl_trace_rank_]
# checkpoint.dir must be one directory every node sees (a shared file system) when NNODES > 1:
# `ptdp check` warns when it is on a local disk, `ptdp train` stops at start-up if it is not
# shared (docs/clusters.md).
# Hide GPUs to force CPU ranks: CUDA_VISIBLE_DEVICES= tools/pretrain_gpt.sh ...
set -euo pipefail

SCRIPT_NAME="${PTDP_SCRIPT_NAME:-$(basename "$0")}"
DEFAULT_CONFIG="${PTDP_DEFAULT_CONFIG:-configs/gpt_tiny.yaml}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"

die() { echo "$SCRIPT_NAME: error: $*" >&2; exit 2; }

usage() {
    sed -n '2,/^set -euo/p' "$ROOT/tools/pretrain_gpt.sh" | sed '$d' | sed 's/^# \{0,1\}//'
}

# --- arguments ------------------------------------------------------------------------------
CONFIG="$DEFAULT_CONFIG"
if [[ $# -gt 0 ]]; then
    case "$1" in
        -h|--help) usage; exit 0 ;;
        -*) ;;            # reported below with the other flags
        *=*) ;;           # first argument is already an override: keep the default config
        *) CONFIG="$1"; shift ;;
    esac
fi
if [[ ! -f "$CONFIG" ]]; then
    if [[ "$CONFIG" != /* && -f "$ROOT/$CONFIG" ]]; then
        CONFIG="$ROOT/$CONFIG"   # e.g. the default config when called from outside the repo
    else
        die "config file not found: $CONFIG (give a YAML path, e.g. configs/gpt_tiny.yaml)"
    fi
fi
for arg in "$@"; do
    case "$arg" in
        -*) die "'$arg': pass overrides as key=value (e.g. parallel.tensor=2), not flags; torchrun swallows flags like its own" ;;
        *.*=*) ;;
        *) die "'$arg' is not a section.key=value override (e.g. train.iters=20)" ;;
    esac
done

# --- resources ------------------------------------------------------------------------------
# Megatron-LM's example scripts spell the node count NUM_NODES: accept it, refuse a conflict.
if [[ -n "${NUM_NODES:-}" && -n "${NNODES:-}" && "$NUM_NODES" != "$NNODES" ]]; then
    die "NNODES=$NNODES and NUM_NODES=$NUM_NODES disagree; set one of them"
fi
NNODES="${NNODES:-${NUM_NODES:-1}}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$NNODES'"
[[ "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NNODES" ]] \
    || die "NODE_RANK must be in 0..$((NNODES - 1)), got '$NODE_RANK'"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS must be a whole number, got '$MAX_RESTARTS'"

no_torch="cannot import torch with $PYTHON; run 'make install' (or pip install -e '.[dev]')"
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    visible_gpus="$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null)" \
        || die "$no_torch"
    if [[ "$visible_gpus" -gt 0 ]]; then
        GPUS_PER_NODE="$visible_gpus"
        DEVICE="cuda (NCCL)"
    else
        GPUS_PER_NODE="${NPROC:-8}"
        DEVICE="cpu (gloo)"
    fi
else
    "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" \
        || die "$no_torch"
    DEVICE="as set (GPUS_PER_NODE=$GPUS_PER_NODE)"
fi
[[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "GPUS_PER_NODE must be a positive integer, got '$GPUS_PER_NODE'"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# NCCL (GPU ranks only): torch's flight recorder, and its dump when a collective times out
export TORCH_NCCL_TRACE_BUFFER_SIZE="${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}"
export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-/tmp/ptdp_nccl_trace_rank_}"

if [[ -z "${MASTER_PORT:-}" ]]; then
    if [[ "$NNODES" -eq 1 ]]; then   # one node: any free port, so several jobs can share a box
        MASTER_PORT="$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")"
    else
        MASTER_PORT=29500
    fi
fi
WORLD_SIZE=$((NNODES * GPUS_PER_NODE))

# The checkout's own code first, whether or not ptdp is pip-installed.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Check the whole job once here (`ptdp check`: config, layout for this world size, data,
# tokenizer, checkpoint, output folders), so a mistake is one clear message before torchrun
# starts, not one per rank. Its summary (layout, micro-batches, memory) goes to stderr.
if ! "$PYTHON" -m ptdp check "$CONFIG" "$@" --world-size "$WORLD_SIZE" --nproc-per-node "$GPUS_PER_NODE" >&2; then
    die "fix the job or launch a different number of ranks (NNODES=$NNODES x GPUS_PER_NODE=$GPUS_PER_NODE = $WORLD_SIZE)"
fi

# --- launch ---------------------------------------------------------------------------------
# `python -m torch.distributed.run` is torchrun, run by the same interpreter that was checked
# above (a `torchrun` on PATH may belong to another Python).
if [[ -n "${TORCHRUN:-}" ]]; then
    read -r -a launcher <<< "$TORCHRUN"
else
    launcher=("$PYTHON" -m torch.distributed.run)
fi
read -r -a extra <<< "${TORCHRUN_ARGS:-}"

cmd=("${launcher[@]}"
     --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
     --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
     ${extra[@]+"${extra[@]}"}
     -m ptdp train "$CONFIG" "$@")

# How to launch this job again: `ptdp train` prints it, with checkpoint.load, in its end summary.
resume_env=""
[[ "$DEVICE" == "cpu (gloo)" ]] && resume_env="NPROC=$GPUS_PER_NODE "
[[ "$NNODES" -gt 1 ]] && resume_env="NNODES=$NNODES NODE_RANK=<this node> MASTER_ADDR=$MASTER_ADDR $resume_env"
export PTDP_RESUME_PREFIX="${resume_env}bash tools/$SCRIPT_NAME"

echo "$SCRIPT_NAME: node $NODE_RANK of $NNODES, $GPUS_PER_NODE ranks here, device $DEVICE, master $MASTER_ADDR:$MASTER_PORT" >&2
echo "$SCRIPT_NAME: ${cmd[*]}" >&2
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    exit 0
fi

# One job per checkpoint.dir: wait (PTDP_LOCK_WAIT_S, default 60 s) until no process of an
# earlier job holds it, or stop naming them (ptdp/runtime/joblock.py). Node 0 asks for the job.
free_checkpoint_dir() {
    [[ "$NODE_RANK" -ne 0 ]] && return 0
    "$PYTHON" -m ptdp.runtime.joblock "$CONFIG" "$@" \
        || die "not starting: another job is using this checkpoint.dir"
}
if [[ "$MAX_RESTARTS" -eq 0 ]]; then
    free_checkpoint_dir "$@"
    exec "${cmd[@]}"
fi

# --- restarts -------------------------------------------------------------------------------
# Each rank that ends for a reason worth telling apart leaves its exit code in $PTDP_EXIT_DIR
# (ptdp/runtime/exit_status.py; torchrun itself exits 1 whatever its workers did): 2 (a
# configuration or data error), 3 (divergence) and 5 (a full disk) would fail again the same
# way, so they end the job;
# 4 (a hang, or a peer lost, named by the hang detector) and a crash or kill (no code left)
# restart it. PTDP_RESTART tells the job which attempt it is, so that a restarted job resumes
# from the newest checkpoint in its checkpoint.dir. On several nodes every node's script
# restarts its own torchrun, and they meet again at MASTER_ADDR:MASTER_PORT+attempt (a fresh
# rendezvous: the old one may outlive the failure by seconds).
export PTDP_EXIT_DIR
PTDP_EXIT_DIR="$(mktemp -d "${TMPDIR:-/tmp}/ptdp-exit.XXXXXX")"
trap 'rm -rf "$PTDP_EXIT_DIR"' EXIT
attempt=0
while true; do
    rm -f "$PTDP_EXIT_DIR"/rank*
    free_checkpoint_dir "$@"   # (a worker of the attempt before may still be exiting)
    rc=0
    if [[ "$attempt" -gt 0 ]]; then
        # A fresh rendezvous per attempt: a node restarting quickly must not join the store of
        # the attempt before, which node 0's old agent keeps for a while. Every node restarts
        # after every failure (a lost rank ends them all), so they count attempts alike and
        # meet at MASTER_PORT + attempt; on one node any free port will do.
        if [[ "$NNODES" -eq 1 ]]; then
            port="$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")"
        else
            port=$((MASTER_PORT + attempt))
        fi
        for i in "${!cmd[@]}"; do
            [[ "${cmd[$i]}" == "--master-port" ]] && cmd[$((i + 1))]="$port"
        done
        echo "$SCRIPT_NAME: attempt $attempt meets at $MASTER_ADDR:$port" >&2
    fi
    PTDP_RESTART="$attempt" "${cmd[@]}" || rc=$?
    [[ "$rc" -eq 0 ]] && exit 0
    codes=" $( (cat "$PTDP_EXIT_DIR"/rank* 2>/dev/null || true) | sort -u | tr '\n' ' ')"
    for final in 2 3 5; do
        if [[ "$codes" == *" $final "* ]]; then
            case "$final" in
                2) why="a configuration or data error" ;;
                3) why="divergence" ;;
                5) why="a full disk" ;;
            esac
            echo "$SCRIPT_NAME: the job ended with $why (exit $final): not restarting" >&2
            exit "$final"
        fi
    done
    if [[ "$attempt" -ge "$MAX_RESTARTS" ]]; then
        echo "$SCRIPT_NAME: the job failed (exit $rc) and MAX_RESTARTS=$MAX_RESTARTS restarts are used up" >&2
        exit "$rc"
    fi
    attempt=$((attempt + 1))
    why="a hang or a lost rank"; [[ "$codes" == " " ]] && why="a crash"
    echo "$SCRIPT_NAME: the job failed (exit $rc, $why); restart $attempt of $MAX_RESTARTS, from the newest checkpoint" >&2
done
