"""The environment every git command of the tool runs in: the user's git setup left out.

A user's ``~/.gitconfig`` (``diff.noprefix``, ``diff.algorithm``, ``core.autocrlf``...), a
system config, ``GIT_CONFIG_COUNT``/``GIT_CONFIG_PARAMETERS`` and ``GIT_DIR``-style variables
would change the bytes git prints (patch prefixes, hunk alignment) or the repository it acts
on. The tool's output must depend on its inputs alone, so every git invocation (subprocess or
GitPython) gets :func:`isolated`: no ``GIT_*`` variable from the caller, no global or system
config, a fixed ``HOME`` and ``TZ``.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

FIXED = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_COUNT": "0",
    "HOME": "/nonexistent",
    "TZ": "UTC",
}


def isolated(extra: Optional[Mapping[str, str]] = None, base: Optional[Mapping[str, str]] = None) -> dict:
    """``base`` (default ``os.environ``) without any ``GIT_*`` variable, plus :data:`FIXED` and ``extra``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("GIT_")}
    env.update(FIXED)
    env.update(extra or {})
    return env


def isolate_gitpython(repo) -> None:
    """Give GitPython's ``repo.git`` :data:`FIXED` for every later command.

    GitPython adds its overrides to ``os.environ`` and cannot remove a variable, so the ones
    that carry configuration are emptied instead (``GIT_CONFIG_COUNT=0`` voids the
    ``GIT_CONFIG_KEY_n``/``VALUE_n`` pairs).
    """
    repo.git.update_environment(GIT_CONFIG_PARAMETERS="", **FIXED)
