"""Readers of the files this tool wrote (``manifest.json``), checked before they are relied on.

A manifest on disk may be edited, truncated by hand or written by another version: valid JSON is
not enough. :func:`manifest_view` checks the fields its readers use (``annotate``, ``--summary``)
with pydantic and :func:`manifest_against_patch` checks that its per-line runs describe the patch
it sits beside, hunk by hunk, so that no reader ends in a ``KeyError``/``IndexError`` or prints
totals the patch does not have. Both raise :class:`~backport.errors.UsageError` (exit 2) naming
the file and the first field that is wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import UsageError
from .patchfile import LINE_KINDS

_Count = Field(ge=0, strict=True)


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _Run(_Model):
    kind: Literal[LINE_KINDS]  # type: ignore[valid-type]
    origin: str
    n: int = _Count


class _RemovedRun(_Model):
    origin: str
    n: int = _Count


class _Origin(_Model):
    origin: str
    kind: str
    added: int = _Count
    removed: int = _Count


class _Hunk(_Model):
    id: str
    lines: list[_Run]
    removed_lines: list[_RemovedRun] = []
    origins: list[_Origin]


class _File(_Model):
    path: str
    hunks: list[_Hunk]


class _Patch(_Model):
    name: str
    sha256: str
    files: int = _Count
    hunks: int = _Count
    added: int = _Count
    removed: int = _Count
    added_by_kind: Optional[dict[str, int]] = None


class _Pins(_Model):
    upstream: str
    upstream_ref: str
    megatron_bridge: str
    mcore_base: str
    commits_between: int
    bridge_dev_commit: Optional[str] = None


class _UpstreamHunk(_Model):
    id: str
    disposition: str
    reason: Optional[str] = None
    by: Optional[str] = None


class _Check(_Model):
    check: str
    ok: bool
    detail: str


class _RecipePins(_Model):
    megatron_bridge: str
    mcore_base: str
    commits_between: int


class _StepStatus(_Model):
    id: str
    status: str
    detail: str


class _HunkStatus(_Model):
    status: str


class _Retarget(_Model):
    recipe_pins: _RecipePins
    steps: list[_StepStatus]
    upstream_hunks: list[_HunkStatus]


class Manifest(_Model):
    """The fields of ``manifest.json`` its readers rely on (the rest is passed through)."""

    patch: _Patch
    pins: _Pins
    files: list[_File]
    upstream_hunks: list[_UpstreamHunk]
    upstream_summary: dict[str, int]
    verification: list[_Check]
    retarget: Optional[_Retarget] = None


def manifest_view(data, path: Path, who: str, hint: str) -> dict:
    """``data`` (parsed ``manifest.json``) when it holds every field :class:`Manifest` names with
    the right types; the dict itself is returned, unchanged.

    Raises:
        UsageError: ``"<who>: <path> is not a manifest gdn-backport wrote: <field>: <problem>"``.
    """
    if not isinstance(data, dict):
        raise UsageError(f"{who}: {path} is not a gdn-backport manifest (a JSON {type(data).__name__}, not an "
                         "object)", hint=hint)
    try:
        Manifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise UsageError(f"{who}: {path} is not a manifest gdn-backport wrote: {where}: {first['msg']}{more}",
                         hint=hint) from None
    return data


def manifest_against_patch(m: dict, patch_set, patch_hunk_id, path: Path, patch: Path, who: str, hint: str) -> None:
    """Check that the manifest ``m`` (already through :func:`manifest_view`) describes the parsed
    patch ``patch_set`` (unidiff ``PatchSet``): the same output hunks, and per hunk as many added
    (removed) lines in its ``lines`` (``removed_lines``) runs as the patch hunk has.
    ``patch_hunk_id(pfile, n)`` is the output hunk id of the n-th hunk (1-based) of a file.

    Raises:
        UsageError: naming the first hunk that differs and both counts.
    """
    records = {h["id"]: h for f in m["files"] for h in f["hunks"]}
    seen = set()
    for pfile in patch_set:
        for n, hunk in enumerate(pfile, start=1):
            hid = patch_hunk_id(pfile, n)
            seen.add(hid)
            rec = records.get(hid)
            if rec is None:
                raise UsageError(f"{who}: the manifest {path} has no record of the patch's hunk {hid} ({patch})",
                                 hint=hint)
            for what, runs, want in (("added", rec["lines"], hunk.added),
                                     ("removed", rec.get("removed_lines", []), hunk.removed)):
                have = sum(r["n"] for r in runs)
                if have != want:
                    field = "lines" if what == "added" else "removed_lines"
                    raise UsageError(f"{who}: the manifest {path} does not describe the patch {patch}: hunk {hid} "
                                     f"has {want} {what} lines in the patch, its per-line runs ({field}) count {have}",
                                     hint=hint)
    extra = sorted(set(records) - seen)
    if extra:
        raise UsageError(f"{who}: the manifest {path} records hunks the patch {patch} does not have: "
                         f"{', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}", hint=hint)
