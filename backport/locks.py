"""Inter-process locks (``filelock``): one run at a time per output folder and per cache entry.

Owns the wait policy of a run (wait with a message, or refuse with ``--no-wait``) and the
``<lock>.owner`` note that tells a waiting run who holds the lock. The note is a separate
file because ``filelock`` truncates the lock file each time it tries to take it.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import filelock

from . import interrupts
from .cache import default_cache_dir
from .errors import BusyError, WriteError, oserror_hint

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


def _lock_error(exc: OSError, path: Path, what: str) -> WriteError:
    """A lock file that cannot be made (exit 1): one line naming it, a hint by errno."""
    where = exc.filename or str(path.parent)
    hint = oserror_hint(exc, where)
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        from .errors import blocking_file

        where = blocking_file(where) or where  # the file in the way, not the folder below it
    cache = default_cache_dir()
    if path == cache or cache in path.parents:
        hint += f" (The tool's cache {cache} is $GDN_BACKPORT_CACHE or ~/.cache/gdn-backport.)"
    return WriteError(f"cannot take the lock for {what}: {exc.strerror or exc}: {where}", hint=hint)


def _command_line(limit: int = 300) -> str:
    """This process's command line for the owner note: whole when short, else cut with an ellipsis
    (so a waiting run never shows a shortened command as if it were the whole)."""
    text = " ".join(sys.argv)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@contextlib.contextmanager
def hold(path: Path, what: str, say: Callable[[str], None] = _say) -> Iterator[None]:
    """Hold the exclusive lock ``path`` (created with its parent) for the block.

    Args:
        path: the lock file, e.g. ``<out>/build/.gdn/output.lock`` or ``<cache>/trees/<id>.lock``.
        what: what the lock protects, for the waiting message ("the output folder /x").
        say: where the waiting message goes (stderr by default).

    Raises:
        BusyError: another process holds it and the run's policy is ``--no-wait``.
        WriteError: the lock file or its folder cannot be made (a file in its path, read-only,
            disk full); exit 1.
    """
    lock = filelock.FileLock(str(path), thread_local=False)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire(blocking=False)
    except filelock.Timeout:
        holder = _owner_note(path)
        if not _WAIT.get():
            raise BusyError(f"{what} is in use by another run ({holder}; lock {path}).",
                            hint="Wait for that run to finish and run the same command again, or drop "
                                 "--no-wait to wait for it.") from None
        with interrupts.during(f"waiting for the lock of {what} ({path}), which another run holds"):
            say(f"waiting for {what}: another run holds it ({holder}; lock {path})")  # named before it is said
            t0 = time.monotonic()
            lock.acquire()
        say(f"… got {what} after {time.monotonic() - t0:.1f} s")
    except OSError as exc:  # the lock's folder is a file, read-only, or on a full disk
        raise _lock_error(exc, path, what) from None
    owner = path.with_name(path.name + ".owner")
    try:
        tmp = owner.with_name(f"{owner.name}.{os.getpid()}")
        tmp.write_text(f"pid {os.getpid()}, since {time.strftime('%H:%M:%S', time.gmtime())} UTC: "
                       + _command_line() + "\n", encoding="utf-8",
                       errors="backslashreplace")
        os.replace(tmp, owner)
    except OSError:
        pass  # the note only helps a waiting run; a full disk must not fail the lock
    try:
        yield
    finally:
        lock.release()
