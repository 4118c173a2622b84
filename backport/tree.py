"""Assemble the pinned base tree exactly as the image does.

Bridge ``src/megatron`` at the Bridge pin is copied first, then Megatron-LM ``megatron/``
at the MCore base is overlaid (MCore files win). The tree is cached under
``<cache>/trees/<bridge9>-<base9>/``: built under the entry's lock (``<id>.lock``) in
``<id>.partial``, its file count and digest recorded in ``<id>/.complete`` (JSON), then renamed
into place. Every use re-verifies count and digest; an entry that fails (incomplete, corrupt,
or from an older version without a digest) is rebuilt, never reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

from . import locks
from .errors import SourceError
from .sources import Source

RECORD = ".complete"


def _extract(tar: tarfile.TarFile, strip: str, dest: Path) -> set:
    """Extract the members under ``strip`` into ``dest``; return the relative paths written."""
    written = set()
    for member in tar.getmembers():
        if not member.name.startswith(strip):
            continue
        rel = member.name[len(strip):].lstrip("/")
        if not rel:
            continue
        target = dest / rel
        if member.isdir():
            target.mkdir(parents=True, exist_ok=True)
        elif member.isfile():
            target.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(member).read()
            if target.exists():
                target.unlink()
            target.write_bytes(data)
            target.chmod(0o755 if member.mode & 0o111 else 0o644)
            written.add(rel)
        elif member.issym():
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists() or target.is_symlink():
                target.unlink()
            target.symlink_to(member.linkname)
            written.add(rel)
    return written


def tree_digest(tree: Path) -> tuple[int, str]:
    """(number of files and symlinks, sha256) of everything under ``tree``.

    The digest covers each entry's relative path, kind (file/executable/symlink) and bytes
    (or link target), in sorted order; directories count only through their contents.
    """
    h = hashlib.sha256()
    count = 0
    for dirpath, dirnames, filenames in os.walk(tree):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, tree)
            if os.path.islink(path):
                kind, data = "l", os.readlink(path).encode("utf-8", "surrogateescape")
            else:
                kind = "x" if os.stat(path).st_mode & 0o111 else "f"
                with open(path, "rb") as f:
                    data = f.read()
            h.update(f"{rel}\0{kind}\0{len(data)}\0".encode("utf-8", "surrogateescape"))
            h.update(data)
            count += 1
    return count, h.hexdigest()


def verify_entry(root: Path, bridge_sha: str, base_sha: str) -> "str | None":
    """None when the cached tree ``root`` is complete and intact, else what is wrong with it."""
    try:
        record = json.loads((root / RECORD).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "incomplete (no record of its file count and digest)"
    except (OSError, ValueError) as exc:
        return f"unreadable ({exc.__class__.__name__})"
    if not isinstance(record, dict) or "sha256" not in record:
        return "from an older version (no digest recorded)"
    if (record.get("bridge"), record.get("mcore")) != (bridge_sha, base_sha):
        return "for other pins"
    count, digest = tree_digest(root / "megatron")
    if count != record.get("files") or digest != record["sha256"]:
        return f"corrupt ({count} files on disk, {record.get('files')} recorded; digest differs)" if count != \
            record.get("files") else "corrupt (the digest of its files differs from the recorded one)"
    return None


def base_compile_errors(root: Path) -> "dict[str, str] | None":
    """``{"megatron/...py": "LINE: message"}``: the files of the cached base tree ``root`` that do
    not byte-compile with this interpreter (usually none), or None when ``root`` is no cache entry.

    Computed once per entry and interpreter version, and kept beside the entry's record
    (``.compile-<tag>.json``, tied to the entry's recorded digest, which :func:`verify_entry`
    checks on every run): the ``byte_compiles`` check then compiles only the files the patch
    changes, and takes the verdict on the others, byte-identical to the base's, from here.
    """
    try:
        digest = json.loads((root / RECORD).read_text(encoding="utf-8"))["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    v = sys.version_info
    path = root / f".compile-{sys.implementation.cache_tag}-{v.major}.{v.minor}.{v.micro}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("sha256") == digest and isinstance(data.get("errors"), dict):
            return data["errors"]
    except (OSError, ValueError, AttributeError):
        pass
    errors = {}
    for file in sorted((root / "megatron").rglob("*.py")):
        rel = file.relative_to(root).as_posix()
        try:
            compile(file.read_bytes(), rel, "exec", dont_inherit=True)
        except SyntaxError as exc:
            errors[rel] = f"{exc.lineno}: {exc.msg}"
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"sha256": digest, "errors": errors}, indent=2, sort_keys=True) + "\n",
                       encoding="utf-8")
        os.replace(tmp, path)
    except OSError:  # a read-only cache: the verdict is simply not kept
        tmp.unlink(missing_ok=True)
    return errors


def assemble_base_tree(bridge: Source, bridge_sha: str, mlm: Source, base_sha: str, cache_dir: Path) -> Path:
    """Return the cached assembled base tree root (containing ``megatron/``), building it once.

    Holds the entry's lock while checking or building it, so concurrent runs build it once;
    a run that finds it held waits (or refuses under ``--no-wait``).

    Raises:
        SourceError: an archive cannot be read from a mirror.
        BusyError: the entry is locked and the run does not wait.
    """
    root = cache_dir / "trees" / f"{bridge_sha[:9]}-{base_sha[:9]}"
    with locks.hold(root.with_name(root.name + ".lock"), f"the cached base tree {root}"):
        if root.exists():
            problem = verify_entry(root, bridge_sha, base_sha)
            if problem is None:
                return root
            print(f"warning: cached base tree {root} is {problem}; rebuilding it", file=sys.stderr)
            shutil.rmtree(root)
        tmp = root.with_name(root.name + ".partial")
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "megatron").mkdir(parents=True)
        expected = _extract(bridge.export(bridge_sha, "src/megatron"), "src/megatron", tmp / "megatron")
        expected |= _extract(mlm.export(base_sha, "megatron"), "megatron", tmp / "megatron")
        count, digest = tree_digest(tmp / "megatron")
        if count != len(expected):
            raise SourceError(f"assembling {root}: {count} files on disk after extracting {len(expected)}.",
                              hint="Run the same command again; if it repeats, check the disk and the mirrors.")
        record = {"bridge": bridge_sha, "mcore": base_sha, "files": count, "sha256": digest}
        (tmp / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.rename(tmp, root)
    return root


def copy_tree(src: Path, dest: Path) -> None:
    """Copy ``src/megatron`` to ``dest/megatron`` (dest replaced)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src / "megatron", dest / "megatron", symlinks=True)
