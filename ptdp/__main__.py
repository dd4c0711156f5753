"""`python -m ptdp` and `torchrun -m ptdp`.

From the folder that holds a clone named `ptdp`, with ptdp installed in editable mode
(`pip install -e`), `import ptdp` finds the clone's folder first: Python's path finder scans
the current folder (sys.path[0]) before setuptools' editable finder is asked, and the clone's
folder, having no __init__.py, becomes a namespace package. This module is still found (the
editable finder maps `ptdp.*` under the real package), but `from ptdp import __version__` would
fail ("cannot import name '__version__' from 'ptdp' (unknown location)"). So a namespace `ptdp`
is replaced by the package this file belongs to before anything else is imported from it.
"""

import importlib.util
import sys
from pathlib import Path


def _use_this_package() -> None:
    package = sys.modules.get("ptdp")
    if package is not None and getattr(package, "__file__", None) is not None:
        return   # the real package (the usual case)
    here = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location(
        "ptdp", here / "__init__.py", submodule_search_locations=[str(here)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["ptdp"] = module
    spec.loader.exec_module(module)


_use_this_package()

from ptdp.cli import main  # noqa: E402  (after the package is the right one)

if __name__ == "__main__":
    code = main()
    # Left to itself, the interpreter's shutdown runs the cyclic collector over every object
    # torch and the trainer made (~300,000): 0.3-1 s of CPU for each rank of a job and each
    # launch's `ptdp check`, after the work is done. Frozen objects are skipped; the OS frees
    # them. atexit handlers and non-daemon threads still run first, as before.
    import gc
    gc.freeze()
    raise SystemExit(code)
