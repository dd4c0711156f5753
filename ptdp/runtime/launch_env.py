"""The launch environment a rank starts in: torchrun's variables, or SLURM's when `srun` starts
one task per GPU without torchrun, and the CUDA settings tensor parallelism wants.

torchrun gives every rank RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT. `srun --ntasks-per-node=G python -m ptdp train ...` gives SLURM_PROCID,
SLURM_LOCALID and the job step's task count, tasks per node and node list (SLURM_STEP_*);
`from_slurm` derives torchrun's names from them (the master is the step's first host, the
port 20000 + job id mod 20000 as in tools/slurm_pretrain.sh), so the same code forms the job.
Torch-free: `ptdp train` adopts it before its checks read WORLD_SIZE.
"""

from __future__ import annotations

import os
import re

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")


class LaunchError(RuntimeError):
    """The environment names a job that cannot be formed (one line, naming the variable)."""


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu-[007-009,012],cpu1' -> 'gpu-007'."""
    head = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if not head or not head.group(1) and not head.group(2):
        raise LaunchError(f"SLURM node list '{nodelist}' names no host")
    prefix, ranges = head.group(1), head.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first   # the range's own zero padding is kept ('007')


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node `node_id` from SLURM's tasks per node, e.g. '8(x2),4' -> 8, 8, 4."""
    counts = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise LaunchError(f"SLURM_STEP_TASKS_PER_NODE='{tasks_per_node}' is not SLURM's format")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if node_id >= len(counts):
        raise LaunchError(f"SLURM_NODEID={node_id} but SLURM_STEP_TASKS_PER_NODE="
                          f"'{tasks_per_node}' lists {len(counts)} node(s)")
    return counts[node_id]


def from_slurm(environ: dict) -> dict:
    """torchrun's variables from SLURM's, for a rank `srun` started directly; {} when torchrun
    (or anything else) already set RANK, or when not in a job step started by srun. (An sbatch
    script itself also has SLURM_PROCID=0 and the allocation's SLURM_NTASKS, but no
    SLURM_STEP_* variables: a plain `ptdp train` there is one process, not rank 0 of many.)"""
    if "RANK" in environ or "SLURM_PROCID" not in environ \
            or "SLURM_STEP_NUM_TASKS" not in environ:
        return {}

    def need(name: str) -> str:
        if not environ.get(name):
            raise LaunchError(f"started by srun (SLURM_PROCID is set) but {name} is not: launch "
                              f"with srun inside an allocation, or with torchrun")
        return environ[name]

    nodelist = need("SLURM_STEP_NODELIST")
    node_id = int(environ.get("SLURM_NODEID", "0"))
    per_node = need("SLURM_STEP_TASKS_PER_NODE")
    return {
        "RANK": need("SLURM_PROCID"),
        "WORLD_SIZE": need("SLURM_STEP_NUM_TASKS"),
        "LOCAL_RANK": need("SLURM_LOCALID"),
        "LOCAL_WORLD_SIZE": str(tasks_on_node(per_node, node_id)),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodelist),
        "MASTER_PORT": environ.get("MASTER_PORT")
                       or str(20000 + int(need("SLURM_JOB_ID")) % 20000),
    }


def adopt_slurm_environment() -> dict:
    """Set torchrun's variables from SLURM's in this process (see `from_slurm`); returns them."""
    derived = from_slurm(dict(os.environ))
    os.environ.update(derived)
    return derived


ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")   # (torch 2.9's name)


def cuda_environment(tensor: int, context: int, environ=None) -> dict:
    """Variables a CUDA rank needs before its first CUDA call (the ones `environ`, default
    this process's, does not set already).

    With tensor or context parallelism a layer's collective and the GEMMs around it run on
    different streams; one hardware work queue (CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron-LM
    requires) makes the GPU start them in the order the host issued them, so a communication
    kernel is not queued behind compute it should overlap with.

    The caching allocator gets expandable segments (PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True, as torchtitan sets) unless the user configured the allocator:
    blocks grow in place instead of fragmenting memory across the varying activation sizes of
    pipeline schedules. The allocator reads it once, when CUDA is first initialised.
    """
    environ = os.environ if environ is None else environ
    out = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tensor > 1 or context > 1 else {}
    if not any(name in environ for name in ALLOCATOR_VARIABLES):
        out["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return {name: value for name, value in out.items() if name not in environ}


def started_by_srun(environ=None) -> bool:
    """A rank that `srun` started directly, one task per GPU (not torchrun's worker): SLURM
    may then give each task only its own GPUs (--gpus-per-task, --gpu-bind)."""
    environ = os.environ if environ is None else environ
    return "SLURM_STEP_NUM_TASKS" in environ and "TORCHELASTIC_RUN_ID" not in environ


def gpu_of_rank(local_rank: int, gpus: int, ranks_per_node: int, own_gpus: bool) -> int:
    """The visible GPU a rank uses: LOCAL_RANK when each rank sees all of its node's GPUs
    (torchrun), LOCAL_RANK % visible when each task sees only its own (`own_gpus`: srun with
    --gpus-per-task=1 shows each task one, as GPU 0). LaunchError, one line, when the numbers
    cannot give each rank a GPU of its own."""
    if local_rank < gpus and ranks_per_node <= gpus:
        return local_rank
    if own_gpus and gpus > 0 and ranks_per_node % gpus == 0:
        return local_rank % gpus
    raise LaunchError(
        f"this node starts {ranks_per_node} ranks but only {gpus} GPU(s) are visible to "
        f"LOCAL_RANK={local_rank}{visible_devices(os.environ)}, and each rank needs a GPU of "
        f"its own; start at most {gpus} ranks per node (torchrun --nproc-per-node {gpus}), "
        f"give each srun task its own GPU (srun --gpus-per-task=1), or train on CPU with "
        f"train.device=cpu")


def visible_devices(environ) -> str:
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
