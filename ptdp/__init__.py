"""ptdp: pipeline, tensor and data parallel training of GPT and BERT models."""

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

# models/ stays at the repository root and is the package ptdp.models. A wheel install maps it
# into the package (pyproject.toml, package-dir), where no ../models exists. In a checkout this
# finder goes first, so ptdp.models always comes from the checkout whose ptdp was imported: an
# editable install of another checkout (a second worktree run with PYTHONPATH=it) would
# otherwise mix one checkout's ptdp with another's models.
_CHECKOUT_MODELS = Path(__file__).resolve().parent.parent / "models"


class _CheckoutModels(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "ptdp.models":
            return None
        return importlib.util.spec_from_file_location(
            name, _CHECKOUT_MODELS / "__init__.py",
            submodule_search_locations=[str(_CHECKOUT_MODELS)])


if (_CHECKOUT_MODELS / "__init__.py").is_file() and not any(
        isinstance(f, _CheckoutModels) for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutModels())
