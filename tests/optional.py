"""The optional extras of pyproject.toml ([project.optional-dependencies]) in the tests.

A core install (`pip install -e .` plus pytest) has none of them; a test that needs one skips,
naming the package and the extra that installs it, instead of failing:

    needs("datasets")                 # in a test, fixture or test helper: skip here if missing
    pytest.param(..., marks=skip_without("tokenizers"))   # one parametrized case
    if installed("matplotlib"): ...   # a test that still runs without it, checking less
    assert_picture(png, stdout)       # a tool's picture, or its line saying there is none

Call `needs` before the first use of the package, including the indirect ones: ptdp's
`preprocess` imports `datasets`, its GPT-2 and WordPiece vocabularies `tokenizers`, and
`ptdp plot` / `ptdp timeline` matplotlib.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# The importable name of each package, and the extra of pyproject.toml that brings it
# (`tokenizers` comes with transformers).
EXTRA_OF = {"datasets": "data", "tokenizers": "hf", "transformers": "hf", "safetensors": "hf",
            "google.protobuf": "hf", "matplotlib": "plot", "tensorboard": "tensorboard",
            "wandb": "wandb"}


def reason(module: str) -> str:
    extra = EXTRA_OF.get(module) or EXTRA_OF[module.split(".")[0]]   # a submodule: its package's
    return f"needs {module}: pip install 'ptdp[{extra}]'"


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):   # a missing parent package; a module blocked by None
        return False


def needs(module: str):
    """The module, or skip the calling test with a line naming the extra to install."""
    __tracebackhide__ = True   # the skip is reported at the caller's line
    return pytest.importorskip(module, reason=reason(module))


def skip_without(module: str):
    """A mark skipping a test (or one parametrized case) when `module` is missing."""
    return pytest.mark.skipif(not installed(module), reason=reason(module))


def assert_picture(png: Path, stdout: str) -> None:
    """A benchmark tool drew its PNG; or, without matplotlib, drew none and said so (the JSON
    holds its results: tools/bench_schedules.py, tools/validate_planner.py)."""
    if installed("matplotlib"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists()
        assert "matplotlib missing: no picture (pip install 'ptdp[plot]')" in stdout
