"""Sample indices built once and cached next to the data (`PREFIX.<kind>-<key>.npz`).

The cache file's name is a hash of everything the index depends on (the documents' sizes,
the split, the sequence length, the seed, ...), so a stale cache can never be picked up: new
data or settings mean a new name. Files are written under a temporary name and renamed, so
ranks that build the same index at the same time cannot see a half-written file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)

CACHE_VERSION = 1


def cache_key(**parts) -> str:
    """Stable hash of scalars and numpy arrays (arrays by content)."""
    h = hashlib.sha256(str(CACHE_VERSION).encode())
    for name in sorted(parts):
        value = parts[name]
        h.update(name.encode())
        if isinstance(value, np.ndarray):
            h.update(np.ascontiguousarray(value).tobytes())
        else:
            h.update(json.dumps(value, sort_keys=True).encode())
    return h.hexdigest()[:16]


def cached_arrays(prefix: str, kind: str, key: str,
                  build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Load `{prefix}.{kind}-{key}.npz`, or call `build()` and save its arrays there.

    If the data directory is read-only the index is built in memory every time (with a
    warning) rather than failing the job.
    """
    path = Path(f"{prefix}.{kind}-{key}.npz")
    if path.is_file():
        try:
            with np.load(path) as f:
                return {name: f[name] for name in f.files}
        except (OSError, ValueError, EOFError) as err:
            log.warning("rebuilding unreadable index cache %s (%s)", path, err)
    arrays = build()
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except OSError as err:
        log.warning("could not cache sample index at %s (%s); building it in memory", path, err)
    finally:
        tmp.unlink(missing_ok=True)
    return arrays
