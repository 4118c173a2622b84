"""Inside the image: the build's tree checks, on the image's own pristine tree and patch.

``/opt/gdn/bin/apply-patch.sh`` (the script the build ran) is run on a scratch copy of
``/opt/gdn`` whose pristine tree has drifted from ``/opt/gdn/patch/trees.json`` (the tree
fields of ``manifests/lock.json``): a line above a hunk, a file the patch does not touch, a
missing file, an extra file. Each exits 13 and names the first differing file; a hunk that
would apply at an offset fails even when the lock agrees with the drifted tree. The image's
own trees pass the same digest check. Skips outside the image (no ``/opt/gdn``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("GDN_IMAGE_ROOT", "/opt/gdn"))
SCRIPT = ROOT / "bin" / "apply-patch.sh"
TREES = ROOT / "patch" / "trees.json"

pytestmark = pytest.mark.skipif(
    not (SCRIPT.is_file() and TREES.is_file() and (ROOT / "base" / "megatron").is_dir()),
    reason=f"not inside the image: needs {SCRIPT}, {TREES} and {ROOT}/base/megatron")


def _digest_module():
    spec = importlib.util.spec_from_file_location("tree_digest", ROOT / "bin" / "tree_digest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _patched_paths() -> tuple[list, list]:
    """(files the patch modifies, files it creates), from the image's patch."""
    modified, created, old = [], [], None
    for line in (ROOT / "patch" / "megatron.patch").read_text().splitlines():
        if line.startswith("--- "):
            old = line[4:].split("\t")[0]
        elif line.startswith("+++ b/"):
            new = line[6:].split("\t")[0]
            (created if old == "/dev/null" else modified).append(new)
    return modified, created


def _untouched() -> str:
    modified, created = _patched_paths()
    lines = _digest_module().listing(ROOT / "base")
    return next(p for p in lines if p.endswith(".py") and p not in modified and p not in created)


@pytest.fixture
def scratch(tmp_path) -> Path:
    root = tmp_path / "gdn"
    shutil.copytree(ROOT / "base", root / "base", symlinks=True)
    shutil.copytree(ROOT / "patch", root / "patch")
    shutil.copytree(ROOT / "bin", root / "bin")
    return root


def _run(root: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, GDN_ROOT=str(root), TMPDIR=str(tmp_path))
    return subprocess.run(["sh", str(root / "bin" / "apply-patch.sh")], env=env, capture_output=True, text=True,
                          timeout=300)


def _drift(root: Path, kind: str) -> str:
    """Make the drift; return the path the error must name."""
    base = root / "base"
    if kind == "line_above_a_hunk":
        rel = _patched_paths()[0][0]
        f = base / rel
        f.write_text("# one line of drift above every hunk\n" + f.read_text())
        return f"{rel} (changed)"
    rel = _untouched()
    if kind == "file_the_patch_does_not_touch":
        (base / rel).write_text((base / rel).read_text() + "# drift\n")
        return f"{rel} (changed)"
    if kind == "missing_file":
        (base / rel).unlink()
        return f"{rel} (missing)"
    if kind == "extra_file":
        extra = "megatron/core/zz_drift_extra.py"
        (base / extra).write_text("X = 1\n")
        return f"{extra} (extra)"
    raise ValueError(kind)


def test_the_images_trees_have_the_lock_digests():
    mod = _digest_module()
    trees = json.loads(TREES.read_text())
    assert mod.check_against_lock(ROOT / "base", trees, "base")["ok"]
    assert mod.check_against_lock(ROOT / "tree", trees, "patched")["ok"]


@pytest.mark.parametrize("kind", ["line_above_a_hunk", "file_the_patch_does_not_touch", "missing_file",
                                  "extra_file"])
def test_build_refuses_a_drifted_pristine_tree(scratch, tmp_path, kind):
    named = _drift(scratch, kind)
    result = _run(scratch, tmp_path)
    assert result.returncode == 13, result.stdout[-2000:] + result.stderr[-2000:]
    assert "error: [base-tree]" in result.stderr
    assert f"first differing file: {named}" in result.stderr, result.stderr
    assert not (scratch / "tree").exists()


def test_build_refuses_a_hunk_at_an_offset_even_when_the_lock_agrees(scratch, tmp_path):
    _drift(scratch, "line_above_a_hunk")
    mod = _digest_module()
    lines = mod.listing(scratch / "base")
    trees = json.loads((scratch / "patch" / "trees.json").read_text())
    trees["base_tree_sha256"] = mod.digest(lines)
    trees["tree_files"]["base"] = mod.file_ids(lines)
    (scratch / "patch" / "trees.json").write_text(json.dumps(trees))
    result = _run(scratch, tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "error: [patch-apply] the patch applies only with an offset or fuzz" in out, out[-2000:]
    assert "offset 1 line" in out
