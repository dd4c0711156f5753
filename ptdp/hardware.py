"""Hardware profiles: datasheet numbers for GPUs, or measurements written by `ptdp profile`.

A profile is a YAML file in `configs/hardware/` (or any path). Bandwidths are bytes per second
in one direction per link (GB/s = 1e9 B/s); peaks are dense TFLOP/s per precision: the
datasheet's, the one number both the planner's MFU and the trainer's `mfu` divide by (a
CPU has no datasheet peak, so its profile's peak is its measured GEMM rate). The
`efficiency` block turns peaks into achievable rates; `measured` (profiler output) holds
per-layer timings that replace the analytic compute model when the shape matches, and
`fingerprint` names the machine they were measured on.

Both the planner and the trainer's metrics read this catalogue; it imports neither of them,
nor torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import importlib.metadata
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HARDWARE_DIR = Path(os.environ.get("PTDP_HARDWARE_DIR",
                                   Path(__file__).resolve().parents[1] / "configs" / "hardware"))


class HardwareError(ValueError):
    """A hardware profile that cannot be used; the message names the file or key."""


@dataclass
class Efficiency:
    """Achievable fractions of datasheet rates, and the shape model for GEMMs.

    A GEMM [M,K] x [K,N] runs at peak * gemm_max * sat(M) * sat(N) * sat(K), with
    sat(x) = x / (x + gemm_half_dim): small dimensions (from large t or small b) fill the
    machine's tiles and waves less well. Every kernel also pays `kernel_launch_us`.
    """

    gemm_max: float = 0.70            # large, well-shaped GEMMs in end-to-end training
    gemm_half_dim: float = 24.0       # dimension at which a GEMM runs at half efficiency
    attention: float = 0.55           # attention kernels relative to gemm efficiency
    kernel_launch_us: float = 6.0     # per kernel; dominates only for tiny layers
    memory: float = 0.75              # elementwise kernels' share of HBM bandwidth
    collective: float = 0.80          # NCCL bus bandwidth / link bandwidth
    host_overhead_s: float = 0.0      # per-iteration fixed cost (data loading, logging)


@dataclass(eq=False)  # hashed by identity so cost functions can cache per profile
class HardwareProfile:
    name: str
    memory_gb: float
    memory_bandwidth_GBps: float
    peak_tflops: dict
    gpus_per_node: int
    intra_node_bandwidth_GBps: float
    inter_node_bandwidth_GBps: float
    nics_per_node: int = 1
    intra_node_latency_us: float = 5.0
    inter_node_latency_us: float = 10.0
    memory_reserved_gb: float = 0.0
    memory_headroom: float = 0.05     # fraction left free for allocator fragmentation
    default_precision: str = "bf16"
    attention: str = "flash"          # flash | materialized (s^2 scores kept in memory)
    device: str = "gpu"
    compute_units: int | None = None  # CPU cores shared by a node's ranks (None for GPUs)
    overlap_communication: bool = True  # False on CPUs: gloo's copies and sums use the cores
    # Pipeline transfers overlap other micro-batches' compute (ptdp's asynchronous exchange).
    # Off for datasheet GPU profiles: their efficiencies are calibrated on the source's runs,
    # whose exchange blocked (every transfer on the critical path); `ptdp profile` turns it on.
    overlap_pipeline: bool = False
    source: str = "datasheet"
    description: str = ""
    efficiency: Efficiency = field(default_factory=Efficiency)
    measured: dict | None = None      # written by the profiler; see ptdp/profiler/
    fingerprint: dict | None = None   # the machine `measured` comes from (machine_fingerprint)

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s for a precision; fp32 training on tensor-core GPUs uses TF32 rates
        only if the profile says so (key 'fp32'), so no silent upgrade happens here."""
        if precision not in self.peak_tflops:
            raise HardwareError(f"hardware '{self.name}' has no peak for precision '{precision}' "
                            f"(it lists {', '.join(sorted(self.peak_tflops))}); pass --precision")
        return float(self.peak_tflops[precision]) * 1e12

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_gb * 2**30 * (1.0 - self.memory_headroom)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_REQUIRED = ("name", "memory_gb", "memory_bandwidth_GBps", "peak_tflops", "gpus_per_node",
             "intra_node_bandwidth_GBps", "inter_node_bandwidth_GBps")


# What `ptdp profile` writes under `measured:` (ptdp/profiler/build.py): provenance, then what
# the planner reads.
MEASURED_KEYS = ("threads", "device", "torch", "host", "optimizer_s_per_param", "layers", "heads",
                 "all_reduce", "p2p", "busy", "tensor_layers", "layer_overhead_s",
                 "split_backward_overhead_s", "memory_calibration", "heap_retention")


def profile_from_dict(raw: dict, source: str = "profile") -> HardwareProfile:
    if not isinstance(raw, dict):
        raise HardwareError(f"{source}: a hardware profile must be a mapping")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise HardwareError(f"{source}: hardware profile is missing {', '.join(missing)}")
    known = {f.name for f in dataclasses.fields(HardwareProfile)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise HardwareError(f"{source}: unknown hardware key(s) {', '.join(unknown)}")
    strange = sorted(set(raw.get("measured") or {}) - set(MEASURED_KEYS))
    if strange:
        raise HardwareError(f"{source}: unknown measured key(s) {', '.join(strange)}")
    values = dict(raw)
    eff_raw = values.pop("efficiency", None) or {}
    eff_known = {f.name for f in dataclasses.fields(Efficiency)}
    bad = sorted(set(eff_raw) - eff_known)
    if bad:
        raise HardwareError(f"{source}: unknown efficiency key(s) {', '.join(bad)}")
    profile = HardwareProfile(**values, efficiency=Efficiency(**eff_raw))
    if profile.gpus_per_node < 1 or profile.memory_gb <= 0:
        raise HardwareError(f"{source}: gpus_per_node and memory_gb must be positive")
    return profile


def available_hardware() -> list[str]:
    if not HARDWARE_DIR.is_dir():
        return []
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def profile_of_gpu(gpu_name: str, memory_gib: float) -> str | None:
    """The profile in configs/hardware/ of a GPU by its device name and memory: the family in
    the name ("a100", "h100", ...) and the size in GiB within 8 of the profile's ("a100-40gb"
    against "a100-80gb", "h100-80gb" against the NVL's "h100-94gb"); None when none fits."""
    gpu = gpu_name.lower()
    found = None
    for candidate in available_hardware():
        family, _, size = candidate.partition("-")
        if family in gpu and size.endswith("gb") and abs(float(size[:-2]) - memory_gib) < 8:
            found = candidate
    return found


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A catalogue name ('a100-80gb') or a path to a profile YAML."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = HARDWARE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = available_hardware()
        close = difflib.get_close_matches(name_or_path, known, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise HardwareError(f"unknown hardware '{name_or_path}'{hint}; known profiles: "
                        f"{', '.join(known) or 'none'} (in {HARDWARE_DIR}), or pass a YAML path")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise HardwareError(f"{path}: not valid YAML: {err}") from err
    return profile_from_dict(raw, str(path))


def save_hardware(profile: HardwareProfile, path: str | os.PathLike, header: str = "") -> None:
    """Write a profile; `header` lines become YAML comments at the top."""
    comments = "".join(f"# {line}\n" for line in header.splitlines())
    Path(path).write_text(comments + yaml.safe_dump(profile.to_dict(), sort_keys=False))


# --------------------------------------------------------------------------------------------
# Where a measured profile comes from
# --------------------------------------------------------------------------------------------

FINGERPRINT_KEYS = ("cpu", "cpu_cores", "gpu", "gpus", "torch")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _gpus() -> tuple[str | None, int]:
    """(GPU name, count) from the driver, without CUDA: nvidia-smi, else /proc's driver files."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout
            names = [line.strip() for line in out.splitlines() if line.strip()]
            if names:
                return names[0], len(names)
        except (OSError, subprocess.SubprocessError):
            pass
    names = []
    for path in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        with open(path) as info:
            names += [line.split(":", 1)[1].strip() for line in info if line.startswith("Model:")]
    return (names[0], len(names)) if names else (None, 0)


def _torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_fingerprint() -> dict:
    """What a measured profile depends on: the CPU model and the cores this process may use,
    the GPU model and count, the torch version. Found without importing torch."""
    gpu, count = _gpus()
    return {"cpu": _cpu_model(), "cpu_cores": len(os.sched_getaffinity(0)), "gpu": gpu,
            "gpus": count, "torch": _torch_version()}


def _describe(fp: dict) -> str:
    devices = f"{fp.get('gpus')} x {fp.get('gpu')}, " if fp.get("gpu") else ""
    return f"{devices}{fp.get('cpu')} ({fp.get('cpu_cores')} cores), torch {fp.get('torch')}"


def foreign_profile(profile: HardwareProfile, here: dict | None = None) -> str | None:
    """None when `profile` holds no measurements or was measured on a machine like this one;
    else one line saying how it differs. A measured profile without a fingerprint (written
    before profiles had one) counts as foreign: nothing says where it was measured."""
    if not profile.measured:
        return None
    here = here or machine_fingerprint()
    if not profile.fingerprint:
        return (f"hardware profile '{profile.name}' holds measurements but no fingerprint of "
                f"the machine they were taken on (this machine: {_describe(here)})")
    theirs = profile.fingerprint
    differ = [k for k in FINGERPRINT_KEYS if k in theirs and theirs[k] != here.get(k)]
    if not differ:
        return None
    return (f"hardware profile '{profile.name}' was measured on {_describe(theirs)}; this "
            f"machine is {_describe(here)} (differs in {', '.join(differ)})")
