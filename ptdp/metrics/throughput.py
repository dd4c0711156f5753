"""Throughput and memory of a training job: model TFLOP/s per rank (Eq. 4.2, generalised to the
model's block), the hardware's peak for MFU, and a process's peak memory."""

from __future__ import annotations


import torch

from ptdp.config import Config
from ptdp.hardware import load_hardware, profile_of_gpu
from ptdp.planner.formulas import ModelShape, iteration_flops
from ptdp.runtime.process_memory import peak_rss_gb


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process in GiB (2**30 bytes): allocated on a GPU, resident on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_rss_gb()


def peak_tflops(cfg: Config, device: torch.device) -> float | None:
    """The hardware's peak for the training precision: from log.hardware, or the GPU's name.
    The same number `ptdp plan` divides by for its MFU column (the profile's datasheet peak;
    a measured profile keeps it and records its GEMM rate as an efficiency)."""
    name = cfg.log.hardware
    if name is None and device.type == "cuda":
        name = profile_of_gpu(torch.cuda.get_device_name(device),
                              torch.cuda.get_device_properties(device).total_memory / 2**30)
    if name is None:
        return None
    peaks = load_hardware(name).peak_tflops
    return peaks.get(cfg.train.precision) or peaks.get("fp32")


def iteration_tflops(cfg: Config, seconds: float, world_size: int,
                     batch: int | None = None) -> float:
    """Model TFLOP/s per GPU: Eq. 4.2 for GPT, generalised to Llama-style blocks (grouped-query
    attention, SwiGLU: formulas.iteration_flops), BERT's own formula (its LM transform, pooler
    and binary head) for BERT; the recomputed forward counts only when it runs. `batch`: the
    iteration's global batch when it is not train.global_batch_size (a ramp-up). A mixture of
    experts counts its active experts only (the k each token is routed to, the shared one and
    the router; ptdp/planner/moe.py), as Megatron's MFU does."""
    tr = cfg.train
    flops = iteration_flops(ModelShape.from_config(cfg.model), batch or tr.global_batch_size,
                            cfg.padded_vocab_size, recompute_forward=tr.recompute == "full")
    return flops / seconds / world_size / 1e12
