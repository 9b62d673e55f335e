"""Where thoughtscope keeps what it caches: a leaf of `probes` (standard library and platformdirs only),
so the model zoo, the toy models' trainers and the validation cache all use it without importing
each other."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def user_cache_dir() -> Path:
    """Root of everything thoughtscope caches: `$THOUGHTSCOPE_CACHE_DIR` or the platform cache dir."""
    env = os.environ.get("THOUGHTSCOPE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(platformdirs.user_cache_dir("thoughtscope"))
