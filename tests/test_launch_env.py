"""Forming the job from the launch environment: SLURM's variables when `srun` starts one task
per GPU without torchrun (ptdp/runtime/launch_env.py), and the CUDA settings tensor parallelism
needs. The end-to-end srun launch is in tests/test_multinode.py."""

import os

import pytest

from ptdp.runtime.launch_env import (LaunchError, cuda_environment, first_host, from_slurm,
                                     tasks_on_node)

SRUN = dict(SLURM_PROCID="9", SLURM_STEP_NUM_TASKS="12", SLURM_LOCALID="1", SLURM_NODEID="2",
            SLURM_STEP_TASKS_PER_NODE="4(x2),4", SLURM_STEP_NODELIST="gpu-[007-009]",
            SLURM_JOB_ID="123456")
# what an sbatch script itself sees: the allocation, but no job step of srun's
BATCH = dict(SLURM_PROCID="0", SLURM_NTASKS="12", SLURM_LOCALID="0", SLURM_NODEID="0",
             SLURM_TASKS_PER_NODE="4(x3)", SLURM_JOB_NODELIST="gpu-[007-009]", SLURM_JOB_ID="1")


@pytest.mark.parametrize("nodelist, host", [
    ("gpu-[007-009,012]", "gpu-007"), ("node3", "node3"), ("a1,b[2-3]", "a1"),
    ("rack[12]-n[1-2]", "rack12"), ("[4-5]", "4")])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_tasks_on_each_node():
    assert [tasks_on_node("8(x2),4", n) for n in range(3)] == [8, 8, 4]
    with pytest.raises(LaunchError, match="SLURM_NODEID=3 but SLURM_STEP_TASKS_PER_NODE='8"):
        tasks_on_node("8(x2),4", 3)
    with pytest.raises(LaunchError, match="not SLURM's format"):
        tasks_on_node("eight", 0)


def test_srun_one_task_per_gpu_gives_torchruns_variables():
    assert from_slurm(SRUN) == {"RANK": "9", "WORLD_SIZE": "12", "LOCAL_RANK": "1",
                                "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "gpu-007",
                                "MASTER_PORT": str(20000 + 123456 % 20000)}
    # a job step on a subset of the allocation, and an explicit master
    step = dict(SRUN, SLURM_STEP_NODELIST="gpu-[008-009]", SLURM_STEP_NUM_TASKS="8",
                SLURM_STEP_TASKS_PER_NODE="4(x2)", SLURM_NODEID="1", MASTER_PORT="6000")
    assert from_slurm(step) == dict(from_slurm(SRUN), WORLD_SIZE="8", MASTER_ADDR="gpu-008",
                                    MASTER_PORT="6000")


def test_torchrun_ranks_and_plain_processes_keep_their_environment():
    assert from_slurm(dict(SRUN, RANK="3")) == {}   # torchrun inside an srun task
    assert from_slurm(BATCH) == {}   # a plain `ptdp train` in an sbatch script: one process
    assert from_slurm({"PATH": "/bin"}) == {}


def test_an_incomplete_srun_environment_is_one_line_naming_the_variable():
    partial = {k: v for k, v in SRUN.items() if k != "SLURM_LOCALID"}
    with pytest.raises(LaunchError, match="SLURM_LOCALID is not"):
        from_slurm(partial)
    with pytest.raises(LaunchError, match="SLURM_STEP_NODELIST is not"):
        from_slurm({k: v for k, v in SRUN.items() if k != "SLURM_STEP_NODELIST"})


def test_tensor_and_context_parallelism_ask_for_one_cuda_work_queue():
    configured = {"PYTORCH_CUDA_ALLOC_CONF": "x"}   # (the allocator: the next test)
    assert cuda_environment(tensor=1, context=1, environ=configured) == {}
    assert cuda_environment(tensor=2, context=1, environ=configured) == \
        {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert cuda_environment(tensor=1, context=2, environ=configured) == \
        {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def test_the_allocator_gets_expandable_segments_unless_the_user_configured_it():
    expandable = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert cuda_environment(tensor=1, context=1, environ={}) == expandable
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        assert cuda_environment(tensor=1, context=1, environ={name: "max_split_size_mb:64"}) == {}


def test_startup_sets_the_allocator_before_the_first_cuda_call(monkeypatch):
    from ptdp.config import load_config
    from ptdp.runtime import startup
    seen = {}

    def pick_device(choice):
        seen["value"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        raise _Stop

    monkeypatch.setattr(startup, "pick_device", pick_device)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")})
    with pytest.raises(_Stop):
        startup.init_distributed(load_config(None, [], world_size=1))
    assert seen["value"] == "expandable_segments:True"


@pytest.mark.parametrize("local_rank, gpus, ranks, own, expected", [
    (5, 8, 8, False, 5),     # torchrun: every rank sees the node's GPUs
    (5, 8, 8, True, 5),      # srun without binding: the same
    (5, 1, 8, True, 0),      # srun --gpus-per-task=1: each task's own GPU is its GPU 0
    (5, 4, 8, True, 1),      # srun binding 4 GPUs to each half of the tasks
])
def test_each_rank_gets_a_gpu_of_its_own(local_rank, gpus, ranks, own, expected):
    from ptdp.runtime.launch_env import gpu_of_rank
    assert gpu_of_rank(local_rank, gpus, ranks, own) == expected


@pytest.mark.parametrize("gpus, own", [(1, False), (3, True), (4, False)])
def test_numbers_that_cannot_fit_are_one_line(gpus, own):
    from ptdp.runtime.launch_env import gpu_of_rank
    with pytest.raises(LaunchError) as err:
        gpu_of_rank(5, gpus, 8, own)
    assert str(err.value).startswith(f"this node starts 8 ranks but only {gpus} GPU(s) are "
                                     f"visible to LOCAL_RANK=5")
    assert "srun --gpus-per-task=1" in str(err.value) and "\n" not in str(err.value)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("preset, expected", [(None, "1"), ("8", "8")])
def test_startup_sets_it_before_the_first_cuda_call_unless_the_launch_did(monkeypatch, preset,
                                                                          expected):
    from ptdp.config import load_config
    from ptdp.runtime import startup
    seen = {}

    def pick_device(choice):   # the first CUDA call of start-up: stop there
        seen["value"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        raise _Stop

    monkeypatch.setattr(startup, "pick_device", pick_device)
    environ = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    monkeypatch.setattr(os, "environ", environ if preset is None
                        else dict(environ, CUDA_DEVICE_MAX_CONNECTIONS=preset))   # no leak
    with pytest.raises(_Stop):
        startup.init_distributed(load_config(None, ["parallel.tensor=2"], world_size=2))
    assert seen["value"] == expected
