"""`python -m ptdp` / `torchrun -m ptdp` from the folder holding a clone named `ptdp`, with an
editable install (ptdp/__main__.py): the clone's folder becomes a namespace package `ptdp`
ahead of the installed one, which used to end in "cannot import name '__version__' from 'ptdp'
(unknown location)"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What `pip install -e` leaves behind (setuptools' editable finder, reduced to its two rules:
# the top-level package and its submodules), appended to sys.meta_path after Python's path
# finder, as setuptools does; any real editable finder is taken out so this checkout is used.
RUN_AS_INSTALLED = """
import runpy, sys
from importlib.machinery import PathFinder
from importlib.util import spec_from_file_location
root = {root!r}
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
class Editable:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "ptdp":
            return spec_from_file_location(name, root + "/__init__.py",
                                           submodule_search_locations=[root])
        if name.rpartition(".")[0] == "ptdp":
            return PathFinder.find_spec(name, path=[root])
sys.meta_path.append(Editable)
sys.argv = ["ptdp", "--version"]
runpy.run_module("ptdp", run_name="__main__", alter_sys=True)
"""


def test_python_m_ptdp_works_beside_a_clone_folder_named_ptdp(tmp_path):
    (tmp_path / "ptdp" / "models").mkdir(parents=True)   # the clone: no ptdp/__init__.py at its top
    (tmp_path / "ptdp" / "pyproject.toml").write_text("")
    code = RUN_AS_INSTALLED.format(root=str(ROOT / "ptdp"))
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("ptdp ")
