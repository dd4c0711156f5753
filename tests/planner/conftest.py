"""Shared fixtures and helpers: hardware profiles, `ptdp plan` in process, model YAML files."""

import argparse
import dataclasses

import pytest
import yaml

from ptdp.commands import plan as plan_command
from ptdp.hardware import load_hardware


def plan(argv: list[str]) -> int:
    """`ptdp plan ARGV` in this process; its exit code."""
    parser = argparse.ArgumentParser()
    plan_command.register(parser.add_subparsers())
    args = parser.parse_args(["plan"] + argv)
    return args.func(args)


@pytest.fixture
def model_file(tmp_path):
    """write(content, name) -> the path of a YAML file holding `content`."""
    def write(content, name="model.yaml"):
        path = tmp_path / name
        path.write_text(yaml.safe_dump(content))
        return str(path)
    return write


@pytest.fixture(scope="session")
def a100():
    return load_hardware("a100-80gb")


@pytest.fixture(scope="session")
def ideal(a100):
    """A100 without latencies or per-kernel costs, for checking formulas exactly."""
    eff = dataclasses.replace(a100.efficiency, kernel_launch_us=0.0, host_overhead_s=0.0)
    return dataclasses.replace(a100, efficiency=eff, intra_node_latency_us=0.0,
                               inter_node_latency_us=0.0)
