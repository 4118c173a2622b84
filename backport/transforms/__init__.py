"""Named source transforms of ours, anchored on upstream symbol names (libcst).

A transform takes the current text of one file and returns a :class:`Result`. It raises
:class:`~backport.errors.ApplyError` when its anchor symbol is missing, naming it. Fix
transforms are idempotent: when the fix is already there (for example from a carried
downstream patch) they return the text unchanged with ``status="already-present"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict


@dataclass(frozen=True)
class Result:
    """Output of a transform: new text and ``applied`` or ``already-present``."""

    text: str
    status: str = "applied"


REGISTRY: Dict[str, Callable[[str], Result]] = {}


def register(name: str):
    """Decorator: register a transform under ``name`` (the recipe refers to it)."""

    def deco(fn):
        if name in REGISTRY:
            raise RuntimeError(f"transform {name} registered twice")
        REGISTRY[name] = fn
        return fn

    return deco


from . import fixes, gdn  # noqa: E402,F401  (registers the GDN adaptations and the preserved fixes)
