"""Write a :class:`~backport.engine.Build` to disk atomically, or compare it (``--check``).

Layout (relative to the output root, normally the repository root):
``patches/megatron/<date>-<base9>.patch`` (+ ``.manifest.json``/``.manifest.md``),
``patches/latest/megatron.patch`` (same bytes) + ``manifest.json``/``manifest.md``,
``manifests/lock.json`` (committed digests), and the trees ``build/tree/base`` and
``build/tree/patched``. Every file is staged then moved into place with ``os.replace``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import CheckMismatch
from .manifest_md import render_markdown
from .tree import copy_tree
from .tree_digest import lock_fields as tree_lock_fields
from .verify import apply_patch


def canonical_json(data) -> bytes:
    """The one JSON writer: sorted keys, indent 2, trailing newline, UTF-8."""
    return (json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def lock_data(build) -> dict:
    """The committed lock: pins, recipe digest, patch and manifest sha256, tree digests.

    ``base_tree_sha256`` / ``patched_tree_sha256`` / ``tree_files``: see ``backport.tree_digest``.
    """
    m = build.manifest
    return {
        "schema": 1,
        "pins": m["pins"],
        "recipe": m["recipe"],
        "patch": {"name": m["patch"]["name"], "sha256": m["patch"]["sha256"]},
        "manifest_sha256": hashlib.sha256(canonical_json(m)).hexdigest(),
        "date": m["date"],
        **tree_lock_fields(build.base_tree, build.patch),
    }


def rendered(build) -> dict[str, bytes]:
    """Every output file (path relative to the output root -> bytes), sorted."""
    name = build.manifest["patch"]["name"]
    stem = name[: -len(".patch")]
    manifest_json = canonical_json(build.manifest)
    manifest_md = render_markdown(build.manifest).encode()
    files = {
        f"patches/megatron/{name}": build.patch,
        f"patches/megatron/{stem}.manifest.json": manifest_json,
        f"patches/megatron/{stem}.manifest.md": manifest_md,
        "patches/latest/megatron.patch": build.patch,
        "patches/latest/manifest.json": manifest_json,
        "patches/latest/manifest.md": manifest_md,
        "manifests/lock.json": canonical_json(lock_data(build)),
    }
    return dict(sorted(files.items()))


def write(build, root: Path, trees: bool = True) -> list[Path]:
    """Write all outputs under ``root`` atomically; return the written paths.

    Files are staged in a temp dir on the same filesystem and moved with ``os.replace``;
    the trees are built beside their targets and swapped in with a rename.
    """
    files = rendered(build)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".gdn-stage-", dir=root))
    try:
        for rel, data in files.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_bytes(data)
        if trees:
            base = staging / "build/tree/base"
            patched = staging / "build/tree/patched"
            copy_tree(build.base_tree, base)
            copy_tree(build.base_tree, patched)
            apply_patch(patched, build.patch, dry_run=False)
        written = []
        for rel in files:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / rel, root / rel)
            written.append(root / rel)
        if trees:
            for name in ("base", "patched"):
                dest = root / "build/tree" / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                old = dest.with_name(name + ".old")
                if dest.exists():
                    dest.rename(old)
                (staging / "build/tree" / name).rename(dest)
                if old.exists():
                    shutil.rmtree(old)
                written.append(dest)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)


LOCK = "manifests/lock.json"
#: Report word of a generated file that is not on disk while the lock pins its digest.
PINNED_BY_LOCK = "absent; covered by the patch and manifest sha256 in " + LOCK


def lock_date(root: Path) -> "str | None":
    """The ``date`` (YYYY-MM-DD) of ``root/manifests/lock.json``, or None when there is no lock.

    ``--check`` without ``--date`` rebuilds with this date, so the committed outputs compare
    equal on any later day.

    Raises:
        CheckMismatch: the lock exists but is not JSON with a ``date``.
    """
    import datetime as dt

    path = root / LOCK
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())["date"]
        return dt.datetime.strptime(value, "%Y-%m-%d").strftime("%Y-%m-%d")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckMismatch(f"{path} is not a lock with a date ({exc.__class__.__name__}: {exc})",
                            hint=f"Restore it with `git checkout {LOCK}`, or regenerate it with "
                                 "`tools/backport`, then run --check again.") from exc


def check(build, root: Path) -> dict[str, str]:
    """Compare fresh outputs with the files on disk.

    The lock must be on disk and equal. The generated files (patch, manifests) must all be
    equal, or all be absent, as in a fresh clone where only the lock is committed: the lock
    holds the patch's and the manifest's sha256, so comparing it compares them.

    Returns:
        relative path -> ``"identical"`` or :data:`PINNED_BY_LOCK`, sorted by path.

    Raises:
        CheckMismatch: listing every path that is missing or differs.
    """
    files = rendered(build)
    generated = [rel for rel in files if rel != LOCK]
    lock_only = not any((root / rel).exists() for rel in generated)
    report, diffs = {}, []
    for rel, data in files.items():
        path = root / rel
        if not path.exists():
            if lock_only and rel != LOCK:
                report[rel] = PINNED_BY_LOCK
            else:
                diffs.append(f"{rel} (missing)")
        elif path.read_bytes() != data:
            diffs.append(f"{rel} (differs)")
        else:
            report[rel] = "identical"
    if diffs:
        raise CheckMismatch("outputs on disk differ from a fresh run: " + ", ".join(diffs),
                            hint=_mismatch_hint(build, root))
    return report


def _date_on_disk(path: Path) -> "str | None":
    try:
        return str(json.loads(path.read_text())["date"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _mismatch_hint(build, root: Path) -> "str | None":
    """A hint naming a date mismatch, which is the usual cause; None keeps the class's."""
    day = build.manifest["date"]
    lock_day = _date_on_disk(root / LOCK)
    latest_day = _date_on_disk(root / "patches/latest/manifest.json")
    if lock_day and lock_day != day:
        return (f"This check rebuilt the {day} patch, but {LOCK} is dated {lock_day} (the date is part of the "
                f"patch). Run the check without --date and with SOURCE_DATE_EPOCH unset to use the lock's date; "
                f"re-date the lock only on purpose (`tools/backport`, then commit {LOCK}).")
    if latest_day and latest_day != day:
        return (f"patches/latest holds the {latest_day} outputs, and this check rebuilt the lock's {day} ones. "
                f"To check the committed lock alone, run the check in a clean clone (or with --out at a folder "
                f"holding only {LOCK}); to compare on disk, first run `tools/backport --date {day}`.")
    return None


