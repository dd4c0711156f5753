#!/usr/bin/env bash
#SBATCH --job-name=ptdp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=ptdp-%j.out
#
# SLURM batch script: one tools/pretrain_gpt.sh launcher per node (srun, one task per node),
# each starting GPUS_PER_NODE ranks with torchrun. Submit from the repository root:
#
#   sbatch [--nodes N] [--gpus-per-node G] [--time HH:MM:SS] [--partition P] \
#       tools/slurm_pretrain.sh CONFIG.yaml [key=value ...]
#
#   e.g. sbatch --nodes 12 tools/slurm_pretrain.sh configs/gpt_175b.yaml data.paths=[/data/my_corpus]
#
# MAX_RESTARTS=N (in the environment of sbatch, which srun passes on) makes every node's
# launcher restart its torchrun after a crash or hang, from the newest checkpoint in
# checkpoint.dir (use checkpoint.load=auto; docs/checkpoints.md). Restart n meets at
# MASTER_PORT + n (a fresh rendezvous), and node 0's launcher first waits for the ranks of the
# attempt before to release checkpoint.dir (one job per folder).
# sbatch options on the command line override the #SBATCH defaults above. The launcher runs
# any architecture (the config's model.arch picks GPT or BERT).
# Derived here: MASTER_ADDR = first host of `scontrol show hostnames $SLURM_JOB_NODELIST`,
# NNODES = $SLURM_JOB_NUM_NODES, NODE_RANK = $SLURM_NODEID (per node, inside srun),
# MASTER_PORT = 20000 + job id mod 20000 unless set, GPUS_PER_NODE from SLURM unless set.
# PTDP_ROOT (default: the submit directory) is the checkout every node runs.
set -euo pipefail

die() { echo "slurm_pretrain.sh: error: $*" >&2; exit 2; }

[[ -n "${SLURM_JOB_ID:-}" ]] || die "not inside a SLURM job; submit with: sbatch tools/slurm_pretrain.sh CONFIG.yaml [key=value ...]"
# sbatch runs a copy of this script from its spool directory, so locate the checkout from the
# submit directory rather than from $0.
ROOT="${PTDP_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"
[[ -x "$ROOT/tools/pretrain_gpt.sh" ]] || die "no tools/pretrain_gpt.sh under $ROOT; submit from the repository root or set PTDP_ROOT"
cd "$ROOT"

[[ $# -ge 1 ]] || die "usage: sbatch tools/slurm_pretrain.sh CONFIG.yaml [key=value ...]"
CONFIG="$1"
[[ -f "$CONFIG" ]] || die "config file not found: $CONFIG (relative to $ROOT)"

NNODES="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
# Read every line (no `| head`: with pipefail, scontrol dying of SIGPIPE would end the job).
mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
[[ ${#hosts[@]} -gt 0 && -n "${hosts[0]}" ]] || die "scontrol show hostnames '$SLURM_JOB_NODELIST' gave no host"
MASTER_ADDR="${hosts[0]}"
MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    # SLURM_GPUS_PER_NODE may read "8" or "a100:8"; SLURM_GPUS_ON_NODE is a plain count.
    GPUS_PER_NODE="${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-}}"
    GPUS_PER_NODE="${GPUS_PER_NODE##*:}"
fi
export NNODES MASTER_ADDR MASTER_PORT
[[ -n "${GPUS_PER_NODE:-}" ]] && export GPUS_PER_NODE   # else each node counts its own GPUs

echo "slurm_pretrain.sh: job $SLURM_JOB_ID, $NNODES node(s) [$SLURM_JOB_NODELIST], master $MASTER_ADDR:$MASTER_PORT, ${GPUS_PER_NODE:-auto} GPUs per node" >&2

# One launcher per node; SLURM_NODEID is only known inside each srun task.
srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
    bash -c 'NODE_RANK="$SLURM_NODEID" exec tools/pretrain_gpt.sh "$@"' pretrain_gpt.sh "$@"
