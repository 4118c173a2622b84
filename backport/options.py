"""Inputs of one backport run: :class:`Options`, the output date (``--date`` /
``SOURCE_DATE_EPOCH``) and the checks made before any work."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .errors import UsageError
from .cache import default_cache_dir

def fs_text(name: str) -> str:
    """A file name as text for the manifest: its bytes read as UTF-8, whatever the locale.

    Under a non-UTF-8 locale (``LC_ALL=C PYTHONUTF8=0``) Python hands non-ASCII names over as
    surrogate escapes, which cannot be written as UTF-8; undecodable bytes become ``\\xNN``.
    """
    return os.fsencode(name).decode("utf-8", errors="backslashreplace")


@dataclass
class Options:
    """Inputs of one run (flags of ``tools/backport``).

    Attributes:
        recipe: recipe YAML path.
        upstream: upstream commit (full or unique short SHA); must be the recipe's.
        megatron_lm, megatron_bridge: URL or path of each source (None: env var or GitHub).
        cache_dir: bare-repo and tree cache.
        carry: downstream patch applied first (zero fuzz), or None.
        date: ``YYYYMMDD`` of the output names and manifest.
        allow_pin_mismatch: accept an MCore base that differs from the Bridge ``.dev.commit``.
        offline: use only the cache.
        import_check: run the import check (needs torch, triton 3.6 and FLA 0.4.2).
        python: interpreter for the import check.
        bridge: Megatron-Bridge commit to build on (``--bridge``; None: the recipe's pin); the
            MCore base is its ``.dev.commit``.
        mcore_base: MCore base other than the Bridge's ``.dev.commit`` (``--mcore-base``; only
            with ``allow_pin_mismatch``).
    """

    recipe: Path
    upstream: Optional[str] = None
    megatron_lm: Optional[str] = None
    megatron_bridge: Optional[str] = None
    cache_dir: Path = field(default_factory=default_cache_dir)
    carry: Optional[Path] = None
    date: str = "19700101"
    allow_pin_mismatch: bool = False
    offline: bool = False
    import_check: bool = True
    python: str = "python3"
    bridge: Optional[str] = None
    mcore_base: Optional[str] = None


#: The dates outputs may carry: from the Unix epoch (SOURCE_DATE_EPOCH=0) to 9999-12-31, the
#: last day a YYYYMMDD name can hold.
DATE_RANGE = ("1970-01-01", "9999-12-31")
EPOCH_MAX = 253402300799  # 9999-12-31T23:59:59Z


def parse_date(value: Optional[str]) -> str:
    """``YYYYMMDD`` from ``--date`` (YYYY-MM-DD or YYYYMMDD), else ``SOURCE_DATE_EPOCH``, else today (UTC).

    Dates run from 1970-01-01 to 9999-12-31 (:data:`DATE_RANGE`); ``SOURCE_DATE_EPOCH`` is
    whole seconds since 1970-01-01 UTC, 0 to :data:`EPOCH_MAX`.

    Raises:
        UsageError: malformed or out-of-range date or SOURCE_DATE_EPOCH.
    """
    import datetime as dt

    if value is not None:
        # strptime alone takes "2026131" as 2026-01-31 and "202611" as 2026-01-01: the digits'
        # layout is checked first (ASCII digits only).
        if not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}|[0-9]{8}", value):
            raise UsageError(f"--date {value!r} is not YYYY-MM-DD.", hint="For example --date 2026-11-29.")
        if int(value[:4]) < 1970:  # before strptime, which refuses year 0000 as "not a date"
            raise UsageError(f"--date {value!r} is out of range: dates run from {DATE_RANGE[0]} to {DATE_RANGE[1]}.",
                             hint="Give a date from 1970-01-01 on, for example --date 2026-11-29.")
        for fmt in ("%Y-%m-%d", "%Y%m%d"):
            try:
                day = dt.datetime.strptime(value, fmt)
                break
            except ValueError:
                pass
        else:  # the layout is right, the day is not (month 13, 2026-02-29)
            raise UsageError(f"--date {value!r} is not a day of the calendar (YYYY-MM-DD).",
                             hint="Check the month and the day, for example --date 2026-11-29.")
        return day.strftime("%Y%m%d")
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch:
        hint = "Unset SOURCE_DATE_EPOCH, or set it to whole seconds since 1970-01-01 UTC (`date -u +%s`)."
        try:
            if not re.fullmatch(r"-?[0-9]+", epoch):  # int() also takes "1_700", " 17 ", "+17" and other scripts' digits
                raise ValueError(epoch)
            seconds = int(epoch)
        except ValueError as exc:
            raise UsageError(f"SOURCE_DATE_EPOCH={epoch!r} is not an integer.", hint=hint) from exc
        if not 0 <= seconds <= EPOCH_MAX:
            raise UsageError(f"SOURCE_DATE_EPOCH={epoch!r} is out of range: it must be 0 to {EPOCH_MAX} "
                             f"({DATE_RANGE[0]} to {DATE_RANGE[1]}).", hint=hint)
        return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y%m%d")
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d")


def validate(opts: Options) -> None:
    """Check the inputs that can be checked before any work (called first by :func:`build`).

    Raises:
        UsageError: ``opts.date`` is not a YYYYMMDD day in :data:`DATE_RANGE`, or the
            import check is on and ``opts.python`` is not an executable interpreter.
    """
    import datetime as dt
    import shutil

    try:
        day = dt.datetime.strptime(opts.date, "%Y%m%d")
    except (TypeError, ValueError):
        day = None
    if day is None or day.year < 1970 or len(opts.date) != 8:
        raise UsageError(f"date {opts.date!r} is not a YYYYMMDD day from {DATE_RANGE[0]} to {DATE_RANGE[1]}.",
                         hint="For example --date 2026-11-29.")
    for flag, value in (("--upstream", opts.upstream), ("--bridge", opts.bridge), ("--mcore-base", opts.mcore_base)):
        if value is not None and not str(value).strip():
            raise UsageError(f"{flag} {value!r} names no commit (an empty value is not taken as the recipe's pin)",
                             hint=f"Pass {flag} a commit SHA, or drop it to use the recipe's pin; check the "
                                  "variable that gave the empty value.")
    for flag, value in (("--cache-dir", opts.cache_dir), ("--megatron-lm", opts.megatron_lm),
                        ("--megatron-bridge", opts.megatron_bridge)):
        text = "" if value is None else str(value)
        if flag != "--cache-dir" and "://" in text:
            continue  # a URL: git reads it as it is
        if text and (os.path.expandvars(text) != text or os.path.expanduser(text) != text):
            raise UsageError(f"{flag} {text} holds a literal `$`/`~` that names a variable or a home folder: git "
                             "(through GitPython) would expand it and use another folder than the one named",
                             hint=f"Pass {flag} the path with the variable expanded (unquoted in the shell, e.g. "
                                  f"{os.path.expanduser(os.path.expandvars(text))}), or rename the folder so that "
                                  "its name holds no `$` or leading `~`.")
    if opts.mcore_base is not None and not opts.allow_pin_mismatch:
        raise UsageError(f"--mcore-base {opts.mcore_base} needs --allow-pin-mismatch: it overrides the base the "
                         "Bridge commit's .dev.commit names.",
                         hint="Drop --mcore-base (the base is read from the --bridge commit's .dev.commit), "
                              "or add --allow-pin-mismatch.")
    if opts.import_check:
        python = opts.python
        found = python if "/" in python else shutil.which(python)
        if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
            raise UsageError(f"--python {python}: no such executable interpreter; it runs the import check.",
                             hint="Pass an interpreter with torch, triton 3.6.0 and FLA 0.4.2 (e.g. "
                                  "--python $PWD/.venv/bin/python after `make venv`), or --no-import-check.")
