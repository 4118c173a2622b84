#!/usr/bin/env python3
"""Tree digests: one sha256 over a directory tree, and the per-file listing behind it.

Owns the digest that ``manifests/lock.json`` records for the pristine tree and the patched
tree (``base_tree_sha256``, ``patched_tree_sha256``, with short per-file ids in
``tree_files`` so a drift can be named), that ``tools/image`` checks before a build, that
``docker/apply-patch.sh`` checks before and after applying the patch inside the build, and
that the gate recomputes inside the built image.

Standard library only: the build copies this file into the image as
``/opt/gdn/bin/tree_digest.py`` and runs it there (``python3 tree_digest.py --help``), so the
image's digest comes from the same code as the lock's.

Digest: sha256 over the sorted listing lines ``F <rel> <sha256 of the bytes> <x|->`` (file,
executable bit) and ``L <rel> <link target>`` (symlink), ``rel`` relative to the tree root
(``megatron/``'s parent is not part of it). ``__pycache__``, ``.pytest_cache``, ``*.pyc`` and
``*.pyo`` are ignored (the image byte-compiles the patched tree).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

#: Characters of an entry's sha256 kept as its id in the lock (64 bits: enough to name a file).
ID_CHARS = 16


def _ignored(name: str) -> bool:
    return name in ("__pycache__", ".pytest_cache") or name.endswith((".pyc", ".pyo"))


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def listing(parent: Path, sub: str = "megatron") -> dict:
    """``{rel path: listing line}`` of every file and symlink under ``parent/sub``, sorted by path.

    ``rel`` is relative to ``parent`` (``megatron/core/...``), as in the lock.

    Raises:
        FileNotFoundError: ``parent/sub`` is not a directory.
    """
    parent = Path(parent)
    top = parent / sub
    if not top.is_dir():
        raise FileNotFoundError(f"no tree at {top}")
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if not _ignored(d))
        links = [d for d in dirnames if (Path(dirpath) / d).is_symlink()]
        for name in sorted(filenames + links):
            if _ignored(name):
                continue
            p = Path(dirpath) / name
            rel = p.relative_to(parent).as_posix()
            if p.is_symlink():
                out[rel] = f"L {rel} {os.readlink(p)}"
            else:
                out[rel] = f"F {rel} {sha256_file(p)} {'x' if p.stat().st_mode & 0o111 else '-'}"
    return dict(sorted(out.items()))


def digest(lines: dict) -> str:
    """sha256 hex of a :func:`listing` (its lines in path order, each ending in a newline)."""
    h = hashlib.sha256()
    for rel in sorted(lines):
        h.update((lines[rel] + "\n").encode())
    return h.hexdigest()


def tree_digest(parent: Path, sub: str = "megatron") -> str:
    """sha256 hex of the tree ``parent/sub`` (see the module docstring for what it covers)."""
    return digest(listing(parent, sub))


def file_ids(lines: dict) -> dict:
    """``{rel path: first ID_CHARS hex of the sha256 of its listing line}``: the lock's per-file ids."""
    return {rel: hashlib.sha256(line.encode()).hexdigest()[:ID_CHARS] for rel, line in sorted(lines.items())}


def first_difference(expected: dict, actual: dict) -> Optional[tuple]:
    """The first path (in sorted order) where two :func:`file_ids` maps differ.

    Returns:
        ``(rel path, "changed" | "missing" | "extra")``, or None when they are equal.
    """
    for rel in sorted(set(expected) | set(actual)):
        if rel not in actual:
            return rel, "missing"
        if rel not in expected:
            return rel, "extra"
        if expected[rel] != actual[rel]:
            return rel, "changed"
    return None


def patched_ids(lock_trees: dict) -> dict:
    """The patched tree's per-file ids from a lock's ``tree_files``: base ids plus the patch's changes."""
    ids = dict(lock_trees["base"])
    for rel, value in lock_trees.get("patched_changes", {}).items():
        if value is None:
            ids.pop(rel, None)
        else:
            ids[rel] = value
    return dict(sorted(ids.items()))


def lock_fields(base_root: Path, patch: bytes) -> dict:
    """The lock's tree fields for ``base_root`` (holding ``megatron/``) and ``patch`` applied to it.

    Returns ``{"base_tree_sha256", "patched_tree_sha256", "tree_files": {"base": {rel: id},
    "patched_changes": {rel: id or None}}}``; ``rel`` is relative to ``megatron/``'s parent
    (e.g. ``megatron/core/...``). The patch is applied to a temporary copy with GNU patch at zero
    fuzz (``backport.verify.apply_patch``).

    Raises:
        VerificationError: the patch does not apply cleanly.
    """
    from .interrupts import temporary_folder
    from .tree import copy_tree
    from .verify import apply_patch

    base = listing(Path(base_root))
    with temporary_folder("gdn-tree-digest-") as tmp:  # removed whole, a signal or not
        copy_tree(Path(base_root), tmp)
        apply_patch(tmp, patch, dry_run=False)
        patched = listing(tmp)
    base_ids, patched_all = file_ids(base), file_ids(patched)
    changes = {rel: patched_all.get(rel) for rel in sorted(set(base_ids) | set(patched_all))
               if base_ids.get(rel) != patched_all.get(rel)}
    return {
        "base_tree_sha256": digest(base),
        "patched_tree_sha256": digest(patched),
        "tree_files": {"base": base_ids, "patched_changes": changes},
    }


def check(parent: Path, want_sha256: str, want_ids: Optional[dict] = None, sub: str = "megatron") -> dict:
    """Compare the tree ``parent/sub`` with a lock's digest (and per-file ids, to name a drift).

    Returns ``{"ok", "sha256", "want", "files", "first_difference": [rel, kind] or None}``.

    Raises:
        FileNotFoundError: ``parent/sub`` is not a directory.
    """
    lines = listing(parent, sub)
    got = digest(lines)
    first = None
    if got != want_sha256 and want_ids is not None:
        first = first_difference(want_ids, file_ids(lines))
    return {"ok": got == want_sha256, "sha256": got, "want": want_sha256, "files": len(lines),
            "first_difference": list(first) if first else None}


def describe(result: dict, what: str) -> str:
    """One line for a failed :func:`check` of the ``what`` tree (e.g. ``"pristine"``)."""
    first = result.get("first_difference")
    named = (f"first differing file: {first[0]} ({first[1]})" if first
             else "the lock has no per-file ids to name the file")
    return (f"the {what} tree's sha256 {result['sha256'][:12]} is not the lock's "
            f"{(result['want'] or '')[:12]}; {named}")


def check_against_lock(parent: Path, lock: dict, which: str) -> dict:
    """:func:`check` of ``parent/megatron`` against the lock's ``which`` (``base`` | ``patched``) tree.

    Raises:
        KeyError: the lock has no ``<which>_tree_sha256``.
    """
    want = lock[f"{which}_tree_sha256"]
    trees = lock.get("tree_files")
    ids = None
    if trees:
        ids = trees["base"] if which == "base" else patched_ids(trees)
    return check(parent, want, ids)


def main(argv=None) -> int:
    """CLI: print a tree's digest, or check it against a lock (exit 13 on a drift)."""
    ap = argparse.ArgumentParser(prog="tree_digest.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("parent", help="folder holding megatron/ (e.g. /opt/gdn/base)")
    ap.add_argument("--lock", help="lock JSON with base_tree_sha256, patched_tree_sha256, tree_files")
    ap.add_argument("--which", choices=("base", "patched"), default="base",
                    help="which of the lock's trees PARENT/megatron must equal [base]")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line")
    ap.add_argument("--ids", action="store_true",
                    help="print {sha256, files, ids} as one JSON line (ids: the lock's per-file ids)")
    args = ap.parse_args(argv)
    parent = Path(args.parent)
    try:
        if args.ids:
            lines = listing(parent)
            print(json.dumps({"sha256": digest(lines), "files": len(lines), "ids": file_ids(lines)},
                             sort_keys=True))
            return 0
        if not args.lock:
            lines = listing(parent)
            print(json.dumps({"sha256": digest(lines), "files": len(lines)}) if args.json else digest(lines))
            return 0
        lock = json.loads(Path(args.lock).read_text(encoding="utf-8"))
        result = check_against_lock(parent, lock, args.which)
    except FileNotFoundError as exc:
        print(f"error: {exc}\nhint: build the tree with `tools/backport --upstream 5139086e`, then build again.",
              file=sys.stderr)
        return 13
    except KeyError as exc:
        print(f"error: {args.lock} has no {exc.args[0]}\nhint: regenerate the lock with "
              "`tools/backport --upstream 5139086e`, then build again.", file=sys.stderr)
        return 13
    what = "pristine" if args.which == "base" else "patched"
    if args.json:
        print(json.dumps(result, sort_keys=True))
    if not result["ok"]:
        print(f"error: {describe(result, what)}\nhint: rebuild the trees and the patch with "
              "`tools/backport --upstream 5139086e` (it rewrites build/tree/), then build again.", file=sys.stderr)
        return 13
    if not args.json:
        print(f"{what} tree sha256 {result['sha256']} ({result['files']} files) equals the lock's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
