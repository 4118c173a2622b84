"""One exception hierarchy for the whole pipeline.

Every error carries a distinct exit code and a ``hint``: the next thing the user
should do. The CLI prints ``error: <message>`` then ``hint: <hint>`` on stderr and
exits with ``exit_code``. Exit codes are documented in the README. Anything else that
escapes (an ``OSError`` from a full disk, a bug) is turned into the same two lines by
:func:`describe_unexpected`, with exit code 1. The image pipeline's errors (exit codes 9-14)
subclass :class:`PipelineError` in ``image_pipeline/errors.py``.
"""

from __future__ import annotations

import errno
import shutil


class PipelineError(Exception):
    """Base of every error the pipeline raises on purpose.

    Attributes:
        exit_code: process exit status the CLI uses (small, distinct per class).
        hint: what to do next; every message ends with it.
    """

    exit_code = 1
    default_hint = "Re-run with --debug for the traceback."

    def __init__(self, message: str, hint: str | None = None):
        self.message = message
        self.hint = hint or self.default_hint
        super().__init__(f"{message}\nhint: {self.hint}")


class UsageError(PipelineError):
    """Bad flags or flag combinations."""

    exit_code = 2
    default_hint = "Run `tools/backport --help` for the flags."


class SourceError(PipelineError):
    """An upstream repository or commit cannot be resolved or read."""

    exit_code = 3
    default_hint = (
        "Point the tool at local mirrors with --megatron-lm/--megatron-bridge "
        "(or MEGATRON_LM_REPO / MEGATRON_BRIDGE_REPO)."
    )


class CacheDamaged(SourceError):
    """git cannot read the tool's own bare cache (a corrupt pack or object): the cache is the
    culprit, not the pins or the mirror; the message names the cache path and quotes git (exit 3)."""


class PinError(PipelineError):
    """Pins disagree (base vs the Bridge `.dev.commit`, ancestry, ambiguity)."""

    exit_code = 4
    default_hint = "Check the pins in manifests/; override only with --allow-pin-mismatch."


class RecipeError(PipelineError):
    """The recipe is malformed or does not account for the upstream commit."""

    exit_code = 5
    default_hint = "Fix the recipe file named above; see manifests/README.md for its schema."


class ApplyError(PipelineError):
    """A carried patch, an upstream hunk or a transform could not be applied."""

    exit_code = 6
    default_hint = "The base tree changed under the recipe; update the recipe step named above."


class BindingExists(ApplyError):
    """A transform would add a name (field, attribute, def, import) that the file already binds
    differently; the engine names the carried hunk that binds it (exit 6).

    Attributes:
        scope: qualname of the class/function holding the binding (``""`` module level).
        name: the bound name.
        lineno: 1-based line of the existing binding in the text given to the transform.
    """

    def __init__(self, message: str, scope: str, name: str, lineno: int, hint=None):
        super().__init__(message, hint=hint)
        self.scope, self.name, self.lineno = scope, name, lineno


class VerificationError(PipelineError):
    """A verification check on the generated patch failed."""

    exit_code = 7
    default_hint = "Nothing was written. Fix the failing check named above and re-run."


class CheckMismatch(PipelineError):
    """``--check`` found files on disk that differ from a fresh run."""

    exit_code = 8
    default_hint = ("Regenerate with `tools/backport` (without --check) and commit manifests/lock.json; "
                    "if the outputs on disk were made with --carry, pass the same --carry to --check.")


class FeatureNative(PipelineError):
    """The MCore base already contains the upstream commit: nothing to backport (exit 17).

    Attributes:
        base, upstream: full SHAs.
        fixes: rows ``{"id", "what", "status", "evidence"}`` (status ``needed``,
            ``already present`` or ``not applicable``) for our preserved downstream fixes and
            our fixes beyond upstream, as far as the base's symbols tell.
    """

    exit_code = 17
    default_hint = ("Use the base as it is (no backport needed). The tool writes no fixes-only patch: keep the "
                    "items marked needed in your own downstream patch (the two preserved fixes come from the "
                    "recipe's `fix` steps, named with their source in manifest.md; the others are behaviours of "
                    "ours to check against the native code), or pick a Bridge commit whose MCore base precedes "
                    "the upstream commit (--bridge SHA).")

    def __init__(self, message: str, base: str, upstream: str, fixes: list, hint=None):
        super().__init__(message, hint=hint)
        self.base, self.upstream, self.fixes = base, upstream, fixes


class BusyError(PipelineError):
    """Another run holds the output folder or a cache entry, and ``--no-wait`` was given."""

    exit_code = 15
    default_hint = "Wait for the other run to finish, or drop --no-wait."


class OutputLinkError(PipelineError):
    """An output path under ``--out`` (a file, a tree, or a folder on the way to one, the tool's
    state under ``build/.gdn`` included) is a symbolic link: the run neither writes through it
    (that would replace files outside ``--out``) nor replaces it (the link is the user's).

    Attributes:
        link: the link's path.
        target: what it points to (``os.readlink``).
    """

    exit_code = 16
    default_hint = "Remove the link named above (its target stays as it is) and run the same command again."

    def __init__(self, message: str, link: str, target: str, hint=None):
        super().__init__(message, hint=hint)
        self.link, self.target = link, target


class WriteError(PipelineError):
    """Outputs or a cache entry could not be written (disk full, read-only, permissions).

    Same exit code as an unexpected error (1): both are system failures, not the inputs'.
    """

    exit_code = 1
    default_hint = "Fix the file system problem named above and run the same command again."


def blocking_file(path) -> "str | None":
    """The first folder on the way to ``path`` (``path`` itself included) that exists and is not a
    folder, e.g. the regular file a cache path runs through; None when there is none."""
    import os

    parts = os.path.abspath(str(path)).split(os.sep)
    for i in range(2, len(parts) + 1):
        sub = os.sep.join(parts[:i]) or os.sep
        if os.path.lexists(sub) and not os.path.isdir(sub):
            return sub
        if not os.path.lexists(sub):
            return None
    return None


def oserror_hint(exc: OSError, path: "str | None" = None) -> str:
    """What to do about ``exc`` (by errno), naming ``path`` (default: the exception's file)."""
    where = path or exc.filename or "the output folder"
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        return f"Free space on the file system holding {where} (`df -h {where}`), then run the same command again."
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"Make {where} writable (or choose another --out / --cache-dir), "
                "then run the same command again.")
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        culprit = blocking_file(where)
        if culprit is not None:
            return (f"{culprit} is a file where a folder is needed (on the way to {where}); move it or choose "
                    "another folder, then run the same command again.")
        return (f"A file stands where a folder is needed in {where}; move it or choose another folder, "
                "then run the same command again.")
    if exc.errno == errno.ENOENT:
        return f"{where} does not exist; check the path, then run the same command again."
    return "Fix the file system problem named above, then run the same command again."


def describe_unexpected(exc: BaseException, step: str) -> tuple[str, str]:
    """(one-line message, hint) for an exception that is not a :class:`PipelineError`.

    Args:
        exc: the exception that escaped.
        step: what the run was doing ("writing outputs", "assembling the base tree", ...).
    """
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        src, dst, why = exc.args[0][0]
        more = len(exc.args[0]) - 1
        text = f"copying {src} to {dst} failed: {why}" + (f" (and {more} more)" if more else "")
        code = getattr(why, "errno", None) if isinstance(why, OSError) else None
        fake = OSError(code or errno.EIO, str(why), dst)
        if "No space left" in str(why):
            fake = OSError(errno.ENOSPC, str(why), dst)
        return f"{step} failed: {text}", oserror_hint(fake, dst)
    if isinstance(exc, OSError):
        what = exc.strerror or str(exc)
        path = f": {exc.filename}" if exc.filename else ""
        return f"{step} failed: {what}{path}", oserror_hint(exc)
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return (f"{step} failed: unexpected {type(exc).__name__}" + (f": {first}" if first else ""),
            "This is a bug in gdn-backport or an unforeseen input; report it with the log named below.")
