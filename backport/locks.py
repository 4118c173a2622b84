"""Inter-process locks (``filelock``): one run at a time per output folder and per cache entry.

Owns the wait policy of a run (wait with a message, or refuse with ``--no-wait``) and the
``<lock>.owner`` note that tells a waiting run who holds the lock. The note is a separate
file because ``filelock`` truncates the lock file each time it tries to take it.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import filelock

from .errors import BusyError

#: Whether a run waits for a busy lock (True) or refuses at once (``--no-wait``). Set by the
#: CLI for the extent of one run with :func:`policy`.
_WAIT: contextvars.ContextVar[bool] = contextvars.ContextVar("gdn_backport_wait", default=True)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def policy(wait: bool) -> Iterator[None]:
    """Within the block, busy locks are waited for (``wait``) or refused with :class:`BusyError`."""
    token = _WAIT.set(wait)
    try:
        yield
    finally:
        _WAIT.reset(token)


def _owner_note(path: Path) -> str:
    try:
        return path.with_name(path.name + ".owner").read_text(encoding="utf-8").strip()
    except OSError:
        return "owner unknown"


@contextlib.contextmanager
def hold(path: Path, what: str, say: Callable[[str], None] = _say) -> Iterator[None]:
    """Hold the exclusive lock ``path`` (created with its parent) for the block.

    Args:
        path: the lock file, e.g. ``<out>/build/.gdn/output.lock`` or ``<cache>/trees/<id>.lock``.
        what: what the lock protects, for the waiting message ("the output folder /x").
        say: where the waiting message goes (stderr by default).

    Raises:
        BusyError: another process holds it and the run's policy is ``--no-wait``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(path), thread_local=False)
    try:
        lock.acquire(blocking=False)
    except filelock.Timeout:
        holder = _owner_note(path)
        if not _WAIT.get():
            raise BusyError(f"{what} is in use by another run ({holder}; lock {path}).",
                            hint="Wait for that run to finish and run the same command again, or drop "
                                 "--no-wait to wait for it.") from None
        say(f"waiting for {what}: another run holds it ({holder}; lock {path})")
        t0 = time.monotonic()
        lock.acquire()
        say(f"… got {what} after {time.monotonic() - t0:.1f} s")
    owner = path.with_name(path.name + ".owner")
    try:
        tmp = owner.with_name(f"{owner.name}.{os.getpid()}")
        tmp.write_text(f"pid {os.getpid()}, since {time.strftime('%H:%M:%S', time.gmtime())} UTC: "
                       + " ".join(sys.argv[:1] + sys.argv[1:6])[:200] + "\n", encoding="utf-8",
                       errors="backslashreplace")
        os.replace(tmp, owner)
    except OSError:
        pass  # the note only helps a waiting run; a full disk must not fail the lock
    try:
        yield
    finally:
        lock.release()
