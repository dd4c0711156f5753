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


def cuda_environment(tensor: int, context: int) -> dict:
    """Variables a CUDA rank needs before its first CUDA call.

    With tensor or context parallelism a layer's collective and the GEMMs around it run on
    different streams; one hardware work queue (CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron-LM
    requires) makes the GPU start them in the order the host issued them, so a communication
    kernel is not queued behind compute it should overlap with.
    """
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tensor > 1 or context > 1 else {}
