"""SIGINT and SIGTERM: the run stops at the first one, cleans up, and no later one cuts the clean-up.

Owns the signal handlers of ``tools/backport`` (:func:`install`), the step a run is at
(:data:`STEP`, named in the ``interrupted while <step>`` message), the regions a signal must not
cut (:func:`shielded`), the temporary folders the tool makes (:func:`temporary_folder`) and
its final clean-up (:func:`finish`).

Rules (issue 45; the README's exit codes 130 and 143):

* The first signal handled raises :class:`KeyboardInterrupt` (SIGINT) or :class:`Terminated`
  (SIGTERM) in the main thread, so ``finally`` blocks and context managers run; the exit code is
  that signal's (130 / 143), whatever follows. (Signals that arrive together, before the process
  runs again, are handled in signal-number order: SIGINT first.)
* Inside a :func:`shielded` block (making or removing a temporary folder, starting or stopping
  a child process, switching outputs in) a signal is held and raised when the outermost block
  ends, so a folder is never left half made or half removed and a child never loses its handle.
* Once an interrupt is raised, later signals are only counted for :data:`GRACE_S` seconds
  (the clean-up runs to its end; several signals a few ms apart act as one); after that a signal
  raises again, so a clean-up that hangs can still be stopped.
* :func:`finish` (the entry point's last step) removes every temporary folder still registered;
  from then on signals are only recorded, and the process entry exits with ``os._exit`` (after
  flushing), so none lands in the interpreter's own shutdown (which puts back the default
  disposition of a Python handler: the process would end by the signal, exit -15 / -2 instead of
  143 / 130, half way through its clean-up).
* An inherited ignored SIGINT (``nohup``, ``&`` in a non-interactive shell) stays ignored: the
  caller asked for it. SIGTERM is always handled.

Only the main thread makes shielded regions (the tool runs its work there; signal handlers
run there too).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

#: Seconds after the first interrupt during which further signals are only counted.
GRACE_S = 10.0

#: The step the run is at, for the message of an interrupt (``interrupted while <now>``); ``done``
#: is set once the new outputs are committed (the message then says they are complete).
STEP: dict = {"now": "starting", "done": None}

_state = {"depth": 0, "held": None, "raised_at": None, "closing": False, "installed": False, "count": 0}
_PREVIOUS: dict = {}  # the handlers install() found, for restore()
_PROTECTED: set = set()  # code objects whose own lines a signal never cuts (the entry point's epilogue)
_FOLDERS: list = []  # temporary folders made and not yet removed (removed by finish() at the latest)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that ``finally`` blocks and context managers run (the
    import check's interpreter is stopped, temporary folders go): exit 143."""


def exit_code(exc: BaseException) -> int:
    """143 for :class:`Terminated` (SIGTERM), else 130 (SIGINT)."""
    return 143 if isinstance(exc, Terminated) else 130


def _exception(signum: int) -> KeyboardInterrupt:
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _handler(signum, frame) -> None:
    _state["count"] += 1
    if _state["closing"] or (frame is not None and frame.f_code in _PROTECTED):  # the run is over: nothing to cut
        if _state["held"] is None and _state["raised_at"] is None:
            _state["held"] = signum
        return
    raised_at = _state["raised_at"]
    if raised_at is not None and time.monotonic() - raised_at < GRACE_S:
        return  # the run is already stopping: its clean-up goes on
    if _state["depth"] > 0:
        if _state["held"] is None:
            _state["held"] = signum  # raised when the shielded region ends
        return
    _state["raised_at"] = time.monotonic()
    raise _exception(signum)


def install(protect: tuple = ()) -> None:
    """Handle SIGTERM, and SIGINT unless it is inherited ignored (see the module docstring).

    Args:
        protect: code objects (``main.__code__``) whose own lines no signal cuts: a signal that
            arrives while one of them runs (not a function it calls) is held for :func:`finish`.
    """
    _PROTECTED.clear()
    _PROTECTED.update(protect)
    _PROTECTED.add(finish.__code__)
    _PREVIOUS.clear()
    _PREVIOUS.update({s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)})
    signal.signal(signal.SIGTERM, _handler)
    if _PREVIOUS[signal.SIGINT] is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _handler)
    _state.update(depth=0, held=None, raised_at=None, closing=False, installed=True, count=0)
    STEP.update(now="starting", done=None)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """A block no signal cuts: one that arrives inside is raised when the outermost block ends
    (unless an interrupt is already on its way, or :func:`finish` has begun)."""
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        if _state["depth"] == 0 and _state["held"] is not None and not _state["closing"]:
            signum, _state["held"] = _state["held"], None
            if _state["raised_at"] is None:
                _state["raised_at"] = time.monotonic()
                raise _exception(signum)


def interrupted() -> bool:
    """Whether a signal has stopped (or is about to stop) the run."""
    return _state["raised_at"] is not None or _state["held"] is not None


def step(now: str) -> None:
    """Name the step the run is at (for the message of an interrupt)."""
    STEP["now"] = now


@contextlib.contextmanager
def during(now: str) -> Iterator[None]:
    """:data:`STEP` names ``now`` for the block, then the step before it again (unless the block
    ends by an exception: the message of an interrupt names the step it cut)."""
    before = STEP["now"]
    STEP["now"] = now
    yield  # an exception (an interrupt) leaves ``now`` named: it is the step that was cut
    STEP["now"] = before


def committed(what: str) -> None:
    """Record that the new outputs are complete and in place (``what`` says where): an interrupt
    from now on says so instead of asking for the run again."""
    STEP["done"] = what


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):  # a file, or a folder rmtree could not empty
        with contextlib.suppress(OSError):
            os.unlink(path)


def make_folder(prefix: str, dir: Optional[Path] = None) -> Path:
    """A new private temporary folder (``tempfile.mkdtemp``), registered for removal by
    :func:`remove_folder` or, at the latest, :func:`finish`. Made under a shield: a signal never
    leaves a folder that nothing will remove.

    Raises:
        OSError: the temporary folder cannot be made.
    """
    with shielded():
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=dir))
        _FOLDERS.append(path)
    return path


def remove_folder(path: Path) -> None:
    """Remove a folder made by :func:`make_folder`, whole (under a shield), and forget it."""
    with shielded():
        _remove(path)
        with contextlib.suppress(ValueError):
            _FOLDERS.remove(path)


def keep_folder(path: Path) -> None:
    """Forget a folder made by :func:`make_folder` without removing it (a result the user reads)."""
    with shielded(), contextlib.suppress(ValueError):
        _FOLDERS.remove(path)


@contextlib.contextmanager
def temporary_folder(prefix: str, dir: Optional[Path] = None) -> Iterator[Path]:
    """A temporary folder for the block (:func:`make_folder`), removed whole when it ends, by an
    exception or an interrupt too."""
    path = make_folder(prefix, dir)
    try:
        yield path
    finally:
        remove_folder(path)


def restore() -> None:
    """Put back the handlers :func:`install` found (``main`` called inside another program)."""
    for signum, handler in _PREVIOUS.items():
        with contextlib.suppress(ValueError, OSError, TypeError):
            signal.signal(signum, handler)


def finish() -> "int | None":
    """The entry point's last step: from here no signal raises (a signal is only recorded, by the
    same Python handler: never a switch to ``SIG_IGN``, which makes Python report a signal that
    arrived just before as "ignored due to race condition"); every registered temporary folder is
    removed. The caller then exits without the interpreter's shutdown (``os._exit``, after
    flushing), which would put back the default dispositions (the process would end by a late
    signal, -15 / -2, half way through its clean-up), or calls :func:`restore` when it runs inside
    another program.

    Returns:
        The signal number of a signal that arrived and was never raised (held in a shielded region
        that ended with the run, or arrived during this clean-up), else None; the caller exits
        with its code.
    """
    _state["closing"] = True
    for path in list(_FOLDERS):
        _remove(path)
        _FOLDERS.remove(path)
    held, _state["held"] = _state["held"], None  # consumed: returned once
    return None if _state["raised_at"] is not None else held


def message(exc_or_signum, now: Optional[str] = None) -> "tuple[int, str]":
    """``(exit code, the two lines error:/hint:)`` of an interrupt, naming the step it cut."""
    code = exc_or_signum if isinstance(exc_or_signum, int) else exit_code(exc_or_signum)
    if code in (signal.SIGINT, signal.SIGTERM):
        code = 143 if code == signal.SIGTERM else 130
    what = "terminated (SIGTERM)" if code == 143 else "interrupted"
    now = now or STEP["now"]
    done = STEP["done"]
    if done:
        return code, (f"error: {what} while {now}, after the commit point: the new outputs in {done} are complete "
                      "and in place\nhint: Nothing to run again; `tools/backport --summary` (with the same --out) "
                      "prints its table.")
    return code, (f"error: {what} while {now}\nhint: Run the same command again; a switch of outputs cut short is "
                  "finished or rolled back by the next run.")


def say_and_exit(exc_or_signum, now: Optional[str] = None) -> None:
    """Print :func:`message` on stderr and exit with its code (``SystemExit``)."""
    code, text = message(exc_or_signum, now)
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr, flush=True)
    sys.exit(code)


def run_child(args: list, input=None, timeout: Optional[float] = None, check: bool = False,
              capture_output: bool = False, **popen) -> "subprocess.CompletedProcess":
    """:func:`subprocess.run` whose child is never left running: started under a shield (no
    interrupt lands between the fork and the handle) and, on any exception (an interrupt, a
    timeout), killed and reaped under a shield before the exception goes on.

    Raises:
        subprocess.CalledProcessError: ``check`` and a non-zero exit.
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds (it is killed first).
        OSError: the program cannot be started.
    """
    import subprocess

    if input is not None:
        popen["stdin"] = subprocess.PIPE
    if capture_output:
        popen["stdout"] = popen["stderr"] = subprocess.PIPE
    proc = None
    try:
        with shielded():
            proc = subprocess.Popen(args, **popen)
        out, err = proc.communicate(input, timeout=timeout)
    except BaseException:
        if proc is not None:
            with shielded():
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                for f in (proc.stdin, proc.stdout, proc.stderr):
                    if f is not None:
                        with contextlib.suppress(OSError):
                            f.close()
        raise
    result = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        result.check_returncode()
    return result
