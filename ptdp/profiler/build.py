"""`ptdp profile`'s work: measure everything, assemble the hardware profile and write it."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from ptdp.hardware import (Efficiency, HardwareProfile, load_hardware, machine_fingerprint,
                           save_hardware)
from ptdp.planner.errors import PlanError
from ptdp.profiler.calibration import (RESERVE_REPEATS, calibrate_layer_overhead,
                                       calibrate_reserve)
from ptdp.profiler.collectives import measure_busy_nodes, measure_collectives
from ptdp.profiler.kernels import measure_device, measure_head, measure_layer
from ptdp.profiler.tensor_layers import measure_tensor_layers
from ptdp.profiler.timing import ensure_process_group


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise PlanError(f"{flag} '{text}': expected comma-separated integers") from err
    if not values or min(values) < 1:
        raise PlanError(f"{flag} '{text}': expected positive integers")
    return values


def _total_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def build_profile(model_cfg, *, name: str, micro_batches: list[int], tensors: list[int],
                  ranks: int, ranks_per_node: int, threads: int, precision: str, device_name: str,
                  iters: int, base: str | None = None, memory_repeats: int = RESERVE_REPEATS,
                  log=print) -> HardwareProfile:
    import torch
    torch.set_num_threads(threads)
    device = torch.device("cuda" if device_name == "cuda" or (
        device_name == "auto" and torch.cuda.is_available()) else "cpu")
    for t in tensors:
        if model_cfg.num_heads % t or model_cfg.ffn_hidden_size % t:
            raise PlanError(f"--tensor {t}: model.num_heads and ffn_hidden_size must divide by it")
    ensure_process_group()
    log(f"profiling on {device} ({threads} thread(s)), {precision}")
    dev = measure_device(precision, device, iters)
    log(f"  GEMM peak {dev['peak_flops'] / 1e12:.3f} TFLOP/s, memory "
        f"{dev['memory_Bps'] / 1e9:.1f} GB/s, launch {dev['launch_s'] * 1e6:.1f} us, "
        f"half-dim {dev['half_dim']}")
    layers, heads = [], []
    for t in tensors:
        for b in micro_batches:
            layers.append(measure_layer(model_cfg, t, b, precision, device, iters))
            heads.append(measure_head(model_cfg, t, b, precision, device, iters))
            row = layers[-1]
            log(f"  layer t={t} b={b}: fwd {row['forward_s'] * 1e3:.2f} ms, bwd "
                f"{row['backward_s'] * 1e3:.2f} ms, saved {row['activation_bytes_none'] / 2**20:.1f} MiB")
    comms = None
    if device.type == "cpu" and ranks > 1:
        comms = measure_collectives(ranks, threads, max(iters, 3))
        log(f"  all-reduce {comms['all_reduce']['bandwidth_GBps']:.2f} GB/s bus, "
            f"p2p {comms['p2p']['bandwidth_GBps']:.2f} GB/s, {comms['p2p']['latency_us']:.0f} us")
    measured = {"threads": threads, "device": str(device), "torch": str(torch.__version__),
                "host": platform.node(), "optimizer_s_per_param": dev["optimizer_s_per_param"],
                "layers": layers, "heads": heads}
    if comms:
        measured.update(all_reduce=comms["all_reduce"], p2p={
            k: comms["p2p"][k] for k in ("bandwidth_GBps", "latency_us", "samples")})
        measured["busy"] = measure_busy_nodes(max(ranks, 2), threads, max(iters, 5), log)
        measured["tensor_layers"] = measure_tensor_layers(
            model_cfg, tensors, micro_batches, precision, [row["ranks"] for row in measured["busy"]],
            threads, max(iters, 9), log)
    profile = _assemble(name, device, precision, dev, comms, measured, ranks_per_node, base)
    if device.type == "cpu" and comms:
        overhead = calibrate_layer_overhead(profile, model_cfg, precision, threads)
        measured["layer_overhead_s"] = overhead["layer_overhead_s"]
        measured["split_backward_overhead_s"] = overhead["split_backward_overhead_s"]
        log(f"  trainer on one rank, b=1: {overhead['step_s'] * 1e3:.1f} ms per step against "
            f"{overhead['model_s'] * 1e3:.1f} ms from the kernels: "
            f"{overhead['layer_overhead_s'] * 1e3:.2f} ms per layer and micro-batch on top; "
            f"zb-h1's split backward {overhead['split_step_s'] * 1e3:.1f} ms: "
            f"{overhead['split_backward_overhead_s'] * 1e3:.2f} ms per layer and micro-batch more")
        calibration = calibrate_reserve(profile, model_cfg, precision, threads, memory_repeats)
        measured["memory_calibration"] = calibration
        measured["heap_retention"] = round(calibration["heap_retention"], 4)
        profile.memory_reserved_gb = round(calibration["reserve_gb"], 4)
        log("  reserve: " + ", ".join(
            f"{name} run peak {run['peak_gb']:.3f} GiB, modelled {run['model_gb']:.3f} GiB"
            for name, run in calibration["runs"].items())
            + f": reserve {calibration['reserve_gb']:.3f} GiB, and "
            f"{calibration['heap_retention']:.2f} x a micro-batch's activations")
    return profile


def _assemble(name, device, precision, dev, comms, measured, ranks_per_node, base) -> HardwareProfile:
    """Measured numbers on top of a base profile (GPU) or on their own (CPU)."""
    efficiency = Efficiency(gemm_max=1.0, gemm_half_dim=float(dev["half_dim"]), attention=1.0,
                            kernel_launch_us=dev["launch_s"] * 1e6, memory=1.0, collective=1.0,
                            host_overhead_s=comms["overhead_s"] if comms else 0.0)
    if base:
        profile = load_hardware(base)
        profile.name, profile.source = name, f"measured over {base}"
        # One peak per device: the datasheet's stays (MFU divides by it, in the planner and
        # the trainer alike); the measured large-GEMM rate is its achievable share.
        datasheet = profile.peak_tflops.get(precision)
        if datasheet:
            efficiency.gemm_max = dev["peak_flops"] / (datasheet * 1e12)
        else:
            profile.peak_tflops = {**profile.peak_tflops, precision: dev["peak_flops"] / 1e12}
        profile.efficiency = efficiency
        profile.memory_bandwidth_GBps = dev["memory_Bps"] / 1e9
        profile.measured = measured
        profile.fingerprint = machine_fingerprint()
        return profile
    if device.type == "cuda":
        raise PlanError("profiling a GPU needs --base NAME for what one GPU cannot measure "
                        "(node size, NVLink and network bandwidth)")
    all_reduce = comms["all_reduce"] if comms else {"bandwidth_GBps": 10.0, "latency_us": 50.0}
    baseline = comms["baseline_gb"] if comms else 0.3
    return HardwareProfile(
        name=name, description=f"measured on {platform.node()} ({os.cpu_count()} CPU cores)",
        source="measured", device="cpu", compute_units=len(os.sched_getaffinity(0)),
        memory_gb=round(_total_memory_gb() / ranks_per_node, 3), memory_reserved_gb=round(baseline, 3),
        memory_headroom=0.0, memory_bandwidth_GBps=dev["memory_Bps"] / 1e9,
        # A CPU has no datasheet peak: its measured GEMM rate is the peak (for MFU too).
        peak_tflops={precision: dev["peak_flops"] / 1e12}, default_precision=precision,
        gpus_per_node=ranks_per_node,
        intra_node_bandwidth_GBps=all_reduce["bandwidth_GBps"],
        intra_node_latency_us=all_reduce["latency_us"],
        inter_node_bandwidth_GBps=all_reduce["bandwidth_GBps"],
        inter_node_latency_us=all_reduce["latency_us"], nics_per_node=ranks_per_node,
        attention="flash", overlap_communication=False, overlap_pipeline=True,
        efficiency=efficiency, measured=measured,
        fingerprint=machine_fingerprint())


def main(args) -> int:
    from ptdp.config import load_model_yaml
    _, cfg = load_model_yaml(args.model)
    out = Path(args.out)
    try:
        profile = _profile_from_args(cfg, args, out)
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    out.parent.mkdir(parents=True, exist_ok=True)
    save_hardware(profile, out, header=(
        f"Written by `ptdp profile` ({args.threads} thread(s) per rank) for {cfg.model.arch} "
        f"l={cfg.model.num_layers} h={cfg.model.hidden_size} a={cfg.model.num_heads} "
        f"f={cfg.model.ffn_hidden_size} s={cfg.model.seq_length} V={cfg.model.vocab_size}.\n"
        "measured.layers/heads hold per-shard times for that model's shape; the efficiency\n"
        "block (GEMM rate, launch cost, memory bandwidth) serves every other shape."))
    print(f"wrote {out}")
    return 0


def _profile_from_args(cfg, args, out: Path) -> HardwareProfile:
    if args.memory_repeats < 1:
        raise PlanError(f"--memory-repeats {args.memory_repeats}: run each memory calibration "
                        f"at least once")
    for t in _ints(args.tensor, "--tensor"):   # before any slow import
        if cfg.model.num_heads % t or cfg.model.ffn_hidden_size % t:
            raise PlanError(f"--tensor {t}: model.num_heads ({cfg.model.num_heads}) and "
                            f"ffn_hidden_size ({cfg.model.ffn_hidden_size}) must divide by it")
    return build_profile(
        cfg.model, name=args.name or out.stem, micro_batches=_ints(args.micro_batches, "--micro-batches"),
        tensors=_ints(args.tensor, "--tensor"), ranks=args.ranks, ranks_per_node=args.ranks_per_node,
        threads=args.threads, precision=args.precision, device_name=args.device, iters=args.iters,
        base=args.base, memory_repeats=args.memory_repeats)
