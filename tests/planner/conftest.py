"""Shared fixtures: hardware profiles."""

import dataclasses

import pytest

from ptdp.hardware import load_hardware


@pytest.fixture(scope="session")
def a100():
    return load_hardware("a100-80gb")


@pytest.fixture(scope="session")
def ideal(a100):
    """A100 without latencies or per-kernel costs, for checking formulas exactly."""
    eff = dataclasses.replace(a100.efficiency, kernel_launch_us=0.0, host_overhead_s=0.0)
    return dataclasses.replace(a100, efficiency=eff, intra_node_latency_us=0.0,
                               inter_node_latency_us=0.0)
