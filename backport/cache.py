"""Where the tool's cache lives (bare upstream clones, tree caches, lock files, logs).

Its own module so that :mod:`backport.locks` and :mod:`backport.sources` both depend on it and
not on each other.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$GDN_BACKPORT_CACHE`` or ``~/.cache/gdn-backport``."""
    env = os.environ.get("GDN_BACKPORT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "gdn-backport"
