"""One GPU per rank: a node cannot start more GPU ranks than it has visible GPUs, and says so
in one line before any process group; CPU training never needs a GPU."""

from types import SimpleNamespace

import pytest
import torch

from ptdp.checks import check_job


@pytest.fixture
def gpus(monkeypatch):
    def visible(count: int):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return visible


def test_more_ranks_than_gpus_is_one_line_naming_the_fix(gpus):
    gpus(1)
    found = check_job(None, ["parallel.data=2"], world_size=2, ranks_per_node=2)
    assert len(found.errors) == 1
    line = found.errors[0]
    assert "this node starts 2 ranks but only 1 GPU(s) are visible" in line
    assert "--nproc-per-node 1" in line and "train.device=cpu" in line


@pytest.mark.parametrize("device,count,ranks", [("cpu", 1, 8), ("auto", 0, 8), ("auto", 8, 8),
                                                ("cuda", 2, 2)])
def test_enough_gpus_or_cpu_passes(gpus, device, count, ranks):
    gpus(count)
    found = check_job(None, [f"train.device={device}", "train.global_batch_size=16"],
                      world_size=ranks, ranks_per_node=ranks)
    assert found.errors == []


def test_srun_tasks_that_each_see_one_gpu_pass(gpus, monkeypatch):
    """srun --gpus-per-task=1: LOCAL_RANK 5 of 8 sees one GPU, its own (rank % device_count);
    under torchrun the same numbers would put 8 ranks on one GPU and are refused."""
    gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    job = (None, ["train.device=cuda", "train.global_batch_size=16"])
    assert check_job(*job, world_size=8, ranks_per_node=8).errors == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    errors = check_job(*job, world_size=8, ranks_per_node=8).errors
    assert len(errors) == 1 and "only 1 GPU(s) are visible to LOCAL_RANK=5" in errors[0]


@pytest.mark.parametrize("name, gib, profile, bf16", [
    ("NVIDIA H100 NVL", 93.6, "h100-94gb", 835), ("NVIDIA H100 80GB HBM3", 79.1, "h100-80gb", 989),
    ("NVIDIA H200", 139.8, "h200-141gb", 989)])
def test_the_gpu_name_and_memory_pick_the_profile(monkeypatch, name, gib, profile, bf16):
    """MFU's peak comes from the GPU here (ptdp/metrics/throughput.py): an H100 NVL is the
    h100-94gb profile (94 GB HBM3, 835 TFLOP/s dense bf16), not the SXM's 989."""
    from ptdp.config import load_config
    from ptdp.hardware import load_hardware
    from ptdp.metrics.throughput import peak_tflops
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=gib * 2**30))
    cfg = load_config(None, ["train.precision=bf16"], world_size=1)
    assert peak_tflops(cfg, torch.device("cuda", 0)) == bf16
    nvl = load_hardware("h100-94gb")
    assert (nvl.memory_gb, nvl.memory_bandwidth_GBps, nvl.peak_tflops["fp8"]) == (94, 3900, 1671)


def test_cuda_without_gpus_is_refused(gpus):
    gpus(0)
    found = check_job(None, ["train.device=cuda"], world_size=1, ranks_per_node=1)
    assert found.errors == ["train.device=cuda but no GPU is visible (CUDA_VISIBLE_DEVICES=); "
                            "train on CPU with train.device=cpu"]


def test_cuda_graphs_without_gpus_are_refused(gpus):
    """train.device=auto trains on CPU where no GPU is visible: CUDA graphs would do nothing."""
    gpus(0)
    found = check_job(None, ["train.cuda_graphs=true"], world_size=1, ranks_per_node=1)
    assert found.errors == ["train.cuda_graphs=true but no GPU is visible "
                            "(CUDA_VISIBLE_DEVICES=); set train.cuda_graphs=false on CPU"]


def test_the_suite_itself_runs_without_gpus():
    assert not torch.cuda.is_available()


def test_a_rank_without_parameters_puts_no_cpu_tensor_into_a_collective(monkeypatch):
    """The distributed optimizer can leave a rank of a small model no piece at all: its share
    of the gradient norm (zero) must still live on the rank's device, since NCCL refuses CPU
    tensors. `meta` stands in for the GPU; every tensor reaching a collective is recorded."""
    import torch.distributed as dist

    from ptdp.optim.grads import global_grad_norm
    seen = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **k: seen.append(tensor.device))
    grid = SimpleNamespace(tp_rank=0, size=lambda *axes: 2, group=lambda *axes: axes)
    norm = global_grad_norm([], grid, sharded=True, device=torch.device("meta"))
    assert seen == [torch.device("meta")] * 2 and norm.device == torch.device("meta")


def test_tf32_is_a_training_setting():
    """train.tf32 (default on) sets torch's TF32 flags for fp32 matmuls and convolutions on
    CUDA, as tools/bench_gpu.py does for its reference."""
    from ptdp.config import load_config
    from ptdp.runtime.startup import set_tf32
    assert load_config(None, [], world_size=1).train.tf32 is True
    assert load_config(None, ["train.tf32=false"], world_size=1).train.tf32 is False
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        set_tf32(True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        set_tf32(False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
