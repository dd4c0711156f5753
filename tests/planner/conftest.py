"""Shared fixtures and helpers: hardware profiles, `ptdp plan` in process, model YAML files,
searches answered once."""

import argparse
import dataclasses
import inspect
import json

import pytest
import yaml

from ptdp.commands import plan as plan_command
from ptdp.hardware import load_hardware
from ptdp.planner.search import SearchResult, search

_ANSWERS: dict = {}


def searched(*args, **kwargs) -> SearchResult:
    """`search`, each distinct question asked once in the session: the pure-Python search over
    1,024 GPUs takes seconds, and GPT-3 on 128 A100 nodes is asked by several tests and by
    `ptdp plan` in several more (the answers are read, never changed)."""
    bound = inspect.signature(search).bind(*args, **kwargs)
    bound.apply_defaults()
    bound.arguments["fixed"] = bound.arguments["fixed"] or {}   # None and {}: the same
    key = repr(sorted(bound.arguments.items()))
    if key not in _ANSWERS:
        _ANSWERS[key] = search(*args, **kwargs)
    return _ANSWERS[key]


def plan(argv: list[str]) -> int:
    """`ptdp plan ARGV` in this process (its search through `searched`); its exit code."""
    parser = argparse.ArgumentParser()
    plan_command.register(parser.add_subparsers())
    args = parser.parse_args(["plan"] + argv)
    real, plan_command.search = plan_command.search, searched
    try:
        return args.func(args)
    finally:
        plan_command.search = real


@pytest.fixture
def plan_json(capsys):
    """`ptdp plan PATH --hardware HARDWARE --json ARGV` in this process -> its JSON
    (H100-80GB unless `hardware` names another profile)."""
    def run(path, *argv, hardware="h100-80gb"):
        assert plan([str(path), "--hardware", hardware, "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)
    return run


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
