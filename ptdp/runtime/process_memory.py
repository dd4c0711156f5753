"""This process's resident memory, from /proc/self/status (torch-free, so memory measurements
of a rank do not import more than the rank itself did)."""

from __future__ import annotations

import resource


def process_status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: resident peak) in
    bytes, or None where there is no such file."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024   # kB
    except OSError:
        pass
    return None


def peak_rss_gb() -> float:
    """This process's resident-memory high-water mark (VmHWM) in GiB. Unlike getrusage's
    ru_maxrss it is not inherited across fork+exec, so a large launcher does not inflate it."""
    peak = process_status_bytes("VmHWM")
    if peak is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux
    return peak / 2**30
