"""One exception hierarchy for the whole pipeline.

Every error carries a distinct exit code and a ``hint``: the next thing the user
should do. The CLI prints ``error: <message>`` then ``hint: <hint>`` on stderr and
exits with ``exit_code``. Exit codes are documented in the README.
"""

from __future__ import annotations


class PipelineError(Exception):
    """Base of every error the pipeline raises on purpose.

    Attributes:
        exit_code: process exit status the CLI uses (small, distinct per class).
        hint: what to do next; every message ends with it.
    """

    exit_code = 1
    default_hint = "Re-run with --verbose for details."

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


class VerificationError(PipelineError):
    """A verification check on the generated patch failed."""

    exit_code = 7
    default_hint = "Nothing was written. Fix the failing check named above and re-run."


class CheckMismatch(PipelineError):
    """``--check`` found files on disk that differ from a fresh run."""

    exit_code = 8
    default_hint = "Regenerate with `tools/backport` (without --check) and commit manifests/lock.json."


class ImageError(PipelineError):
    """Building or gating the image failed."""

    exit_code = 9
    default_hint = "Read the log tail above; `make image` rebuilds from the verified patch."
