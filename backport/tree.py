"""Assemble the pinned base tree exactly as the image does.

Bridge ``src/megatron`` at the Bridge pin is copied first, then Megatron-LM ``megatron/``
at the MCore base is overlaid (MCore files win). The tree is cached under
``<cache>/trees/<bridge9>-<base9>/`` and built atomically (temp dir, then rename).
"""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

from .sources import Source


def _extract(tar: tarfile.TarFile, strip: str, dest: Path) -> int:
    count = 0
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
            count += 1
        elif member.issym():
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists() or target.is_symlink():
                target.unlink()
            target.symlink_to(member.linkname)
            count += 1
    return count


def assemble_base_tree(bridge: Source, bridge_sha: str, mlm: Source, base_sha: str, cache_dir: Path) -> Path:
    """Return the cached assembled base tree root (containing ``megatron/``), building it once.

    Raises:
        SourceError: an archive cannot be read from a mirror.
    """
    root = cache_dir / "trees" / f"{bridge_sha[:9]}-{base_sha[:9]}"
    if (root / ".complete").exists():
        return root
    tmp = root.with_name(root.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "megatron").mkdir(parents=True)
    _extract(bridge.export(bridge_sha, "src/megatron"), "src/megatron", tmp / "megatron")
    _extract(mlm.export(base_sha, "megatron"), "megatron", tmp / "megatron")
    (tmp / ".complete").write_text(f"bridge {bridge_sha}\nmcore {base_sha}\n")
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return root


def copy_tree(src: Path, dest: Path) -> None:
    """Copy ``src/megatron`` to ``dest/megatron`` (dest replaced)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src / "megatron", dest / "megatron", symlinks=True)
