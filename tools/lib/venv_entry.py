"""Start a tool of this repository with the project venv's interpreter.

The wrappers in ``tools/`` run under whatever ``python3`` is first on PATH. When that
interpreter lacks the project's packages (click, rich, GitPython, ...), re-execute the same
command with ``.venv/bin/python`` if the venv exists; otherwise stop with one ``error:``
line and a ``hint:`` naming ``make venv`` (exit 1). Only the standard library is used here.
"""

from __future__ import annotations

import importlib
import os
import signal
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
    previous = _early_signals(tool)  # the imports below take a while: a signal there is one clean line
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
    mod = importlib.import_module(module)
    if not getattr(mod, "INSTALLS_SIGNAL_HANDLERS", False):  # else kept until its main installs its own
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    mod.main()


def _early_signals(tool: str) -> dict:
    """Until the tool's ``main`` runs (its imports; for a module with ``INSTALLS_SIGNAL_HANDLERS``
    until its ``main`` installs its own): SIGTERM (and SIGINT, unless inherited ignored) exit 143 /
    130 at once with one ``error:`` line instead of a traceback from the middle of an import
    (nothing has been made yet). Returns the handlers to put back."""
    said = []

    def stop(signum, _frame):
        if said:  # one message and the first signal's code, whatever follows (a Python handler, not
            return  # SIG_IGN: a signal already on its way would be reported "ignored due to race condition")
        said.append(signum)
        what = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"
        try:
            sys.stderr.write(f"error: {what} while starting {tool}\nhint: Run the same command again.\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        # Nothing has been made yet; os._exit, not sys.exit: the interpreter's shutdown puts back the
        # default dispositions, and a second signal there would end the process by the signal (-15).
        os._exit(143 if signum == signal.SIGTERM else 130)

    previous = {signal.SIGTERM: signal.getsignal(signal.SIGTERM)}
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        previous[signal.SIGINT] = signal.getsignal(signal.SIGINT)
    for signum in previous:
        signal.signal(signum, stop)
    return previous
