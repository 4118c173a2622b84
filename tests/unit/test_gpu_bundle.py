"""tools/gpu-bundle: refuses missing inputs with the command that writes them, packs the rest
reproducibly (a throwaway git repo holding a copy of the script; no network)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from conftest import git, write_files

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def bundle_repo(tmp_path):
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "gpu-bundle", root / "tools" / "gpu-bundle")
    write_files(root, {"README.md": "x\n", ".gitignore": "/build/\n/.whl/\n/patches/\n/dist/\n"})
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-qm", "init")
    return root


def _run(root):
    return subprocess.run([str(root / "tools" / "gpu-bundle")], cwd=root, capture_output=True, text=True)


def _complete(root):
    write_files(root, {
        "build/tree/patched/megatron/core/a.py": "p\n",
        "build/tree/base/megatron/core/a.py": "b\n",
        "patches/latest/megatron.patch": "diff\n",
        ".whl/fla042/fla-0.4.2.whl": "w2", ".whl/fla041/fla-0.4.1.whl": "w1",
    })


def test_missing_tree_names_the_command(bundle_repo):
    proc = _run(bundle_repo)
    assert proc.returncode == 2
    assert "build/tree/patched is missing" in proc.stderr and "tools/backport" in proc.stderr
    assert not (bundle_repo / "dist").exists()


def test_missing_wheels_names_make_wheels(bundle_repo):
    _complete(bundle_repo)
    shutil.rmtree(bundle_repo / ".whl" / "fla041")
    proc = _run(bundle_repo)
    assert proc.returncode == 2 and "make wheels" in proc.stderr


def test_bundle_contents_and_reproducible_bytes(bundle_repo):
    _complete(bundle_repo)
    assert _run(bundle_repo).returncode == 0
    out = bundle_repo / "dist" / "gdn-gpu-bundle.tgz"
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
    assert {"README.md", "tools/gpu-bundle", "build/tree/patched/megatron/core/a.py",
            "build/tree/base/megatron/core/a.py", "patches/latest/megatron.patch",
            ".whl/fla042/fla-0.4.2.whl", ".whl/fla041/fla-0.4.1.whl"} <= names
    first = hashlib.sha256(out.read_bytes()).hexdigest()
    assert _run(bundle_repo).returncode == 0
    assert hashlib.sha256(out.read_bytes()).hexdigest() == first
