"""Start a tool of this repository with the project venv's interpreter.

The wrappers in ``tools/`` run under whatever ``python3`` is first on PATH. When that
interpreter lacks the project's packages (click, rich, GitPython, ...), re-execute the same
command with ``.venv/bin/python`` if the venv exists; otherwise stop with one ``error:``
line and a ``hint:`` naming ``make venv`` (exit 1). Only the standard library is used here.
"""

from __future__ import annotations

import importlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_PYTHON = os.path.join(REPO, ".venv", "bin", "python")
NEEDED = ("click", "rich", "git", "unidiff", "libcst", "pydantic", "yaml")


def run(module: str, tool: str, needed: tuple[str, ...] = NEEDED) -> None:
    """Import ``module`` (``backport.cli`` say) and call its ``main()``.

    Args:
        module: dotted module holding ``main``.
        tool: the wrapper's path as the user typed it, for messages (``tools/backport``).
        needed: top-level packages checked before importing ``module``.
    """
    missing = []
    for name in needed:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        in_venv = os.path.realpath(sys.prefix) == os.path.realpath(os.path.dirname(os.path.dirname(VENV_PYTHON)))
        if os.path.exists(VENV_PYTHON) and not in_venv and not os.environ.get("GDN_VENV_REEXEC"):
            os.environ["GDN_VENV_REEXEC"] = "1"
            os.execv(VENV_PYTHON, [VENV_PYTHON, sys.argv[0], *sys.argv[1:]])
        sys.stderr.write(
            f"error: {tool}: {sys.executable} lacks the project's packages ({', '.join(missing)})\n"
            f"hint: run `make venv` in {REPO} (it makes .venv, which {tool} then uses by itself), "
            "or activate a venv with `pip install -e .` and run the same command again.\n")
        sys.exit(1)
    sys.path.insert(0, REPO)
    importlib.import_module(module).main()
