"""The image holds exactly the verified tree: tree digests (backport/tree_digest.py), the lock's
tree fields, the checks before and after applying the patch (docker/apply-patch.sh), the
preflight and build-error mapping (exit 13 naming the first differing file), and the gate's
check of the digests computed inside the image. No Docker: the image side runs on scratch roots
and a fake client."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backport import tree_digest as td
from backport.tree_digest import sha256_file
from image_pipeline import cli as image_cli
from image_pipeline.build import TREE_DIGEST_SCRIPT, BuildTracker, classify_build_error
from image_pipeline.errors import BuildStepFailed, InputError, TreeDrift
from image_pipeline.gate import image_tree_check, junit_cases, require_gate_ok, run_gate, tree_check_failure
from image_pipeline.inputs import CPU_BASE_IMAGE, FLAVOURS, Inputs, preflight, read_tree_lock, tree_digest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
GOOD_PATCH = (Path(__file__).resolve().parents[1] / "data" / "image" / "good.patch").read_text()
MOD = "def f():\n    # one\n    return 1\n"
OTHER = "Z = 3\n"

needs_patch = pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")


def _tree(parent: Path) -> Path:
    """A pristine synthetic tree: megatron/core/mod.py (patched) and other.py (not patched)."""
    core = parent / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "mod.py").write_text(MOD)
    (core / "other.py").write_text(OTHER)
    (parent / "megatron" / "tool.sh").write_text("#!/bin/sh\n")
    (parent / "megatron" / "tool.sh").chmod(0o755)
    return parent


# --------------------------------------------------------------------------- digest

def test_digest_covers_content_mode_and_names_and_ignores_caches(tmp_path):
    parent = _tree(tmp_path / "t")
    before = td.tree_digest(parent)
    (parent / "megatron" / "core" / "__pycache__").mkdir()
    (parent / "megatron" / "core" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"x")
    assert td.tree_digest(parent) == before
    (parent / "megatron" / "tool.sh").chmod(0o644)
    assert td.tree_digest(parent) != before
    (parent / "megatron" / "tool.sh").chmod(0o755)
    (parent / "megatron" / "core" / "other.py").rename(parent / "megatron" / "core" / "other2.py")
    assert td.tree_digest(parent) != before


def test_module_and_the_script_in_the_image_give_the_same_digest(tmp_path):
    """The image runs a copy of backport/tree_digest.py with the image's python3, stdlib only."""
    parent = _tree(tmp_path / "t")
    ctx_script = tmp_path / "bin" / "tree_digest.py"
    ctx_script.parent.mkdir()
    shutil.copy2(TREE_DIGEST_SCRIPT, ctx_script)
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONNOUSERSITE": "1"}  # no backport on sys.path
    out = subprocess.run([sys.executable, "-S", str(ctx_script), str(parent), "--ids"], env=env,
                         capture_output=True, text=True, check=True, cwd=tmp_path)
    seen = json.loads(out.stdout)
    assert seen["sha256"] == td.tree_digest(parent) == tree_digest(parent)
    assert seen["ids"] == td.file_ids(td.listing(parent))
    assert seen["files"] == 3


@needs_patch
def test_lock_fields_record_both_trees(tmp_path):
    parent = _tree(tmp_path / "t")
    fields = td.lock_fields(parent, GOOD_PATCH.encode())
    assert fields["base_tree_sha256"] == td.tree_digest(parent)
    patched = tmp_path / "p"
    shutil.copytree(parent, patched)
    subprocess.run(["patch", "-p1", "-s", "-i", "-"], cwd=patched, input=GOOD_PATCH, text=True, check=True)
    assert fields["patched_tree_sha256"] == td.tree_digest(patched)
    assert set(fields["tree_files"]["patched_changes"]) == {"megatron/core/mod.py", "megatron/core/new_mod.py"}
    assert td.patched_ids(fields["tree_files"]) == td.file_ids(td.listing(patched))
    assert td.tree_digest(parent) == fields["base_tree_sha256"]  # the pristine tree is untouched


@pytest.mark.parametrize("drift, named", [
    ("changed", ("megatron/core/other.py", "changed")),
    ("missing", ("megatron/core/other.py", "missing")),
    ("extra", ("megatron/core/zz_extra.py", "extra")),
])
def test_first_difference_names_the_file(tmp_path, drift, named):
    parent = _tree(tmp_path / "t")
    want = td.file_ids(td.listing(parent))
    _drift(parent, drift)
    assert td.first_difference(want, td.file_ids(td.listing(parent))) == named


def _drift(parent: Path, kind: str) -> None:
    core = parent / "megatron" / "core"
    if kind == "above-hunk":  # one line above the patch's first hunk of mod.py
        (core / "mod.py").write_text("# drift\n" + MOD)
    elif kind == "changed":  # a file the patch does not touch
        (core / "other.py").write_text(OTHER + "W = 4\n")
    elif kind == "missing":
        (core / "other.py").unlink()
    elif kind == "extra":
        (core / "zz_extra.py").write_text("V = 5\n")


# --------------------------------------------------------------------------- in the build

def _scratch_root(tmp_path: Path, trees: dict | None = None) -> Path:
    """The image's /opt/gdn layout on a scratch root: base/, patch/ (with trees.json), bin/."""
    root = tmp_path / "gdn"
    _tree(root / "base")
    (root / "patch").mkdir()
    (root / "patch" / "megatron.patch").write_text(GOOD_PATCH)
    (root / "patch" / "manifest.json").write_text(json.dumps(
        {"patch": {"sha256": sha256_file(root / "patch" / "megatron.patch")}}))
    trees = trees or td.lock_fields(root / "base", GOOD_PATCH.encode())
    (root / "patch" / "trees.json").write_text(json.dumps(trees))
    (root / "bin").mkdir()
    shutil.copy2(TREE_DIGEST_SCRIPT, root / "bin" / "tree_digest.py")
    return root


def _apply(root: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, GDN_ROOT=str(root), TMPDIR=str(tmp_path))
    return subprocess.run(["sh", str(DOCKER / "apply-patch.sh")], env=env, capture_output=True, text=True)


@needs_patch
def test_apply_script_checks_both_digests_on_the_locked_tree(tmp_path):
    root = _scratch_root(tmp_path)
    result = _apply(root, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "==> [base-tree] pristine tree sha256" in result.stdout
    assert "==> [patched-tree] patched tree sha256" in result.stdout
    trees = json.loads((root / "patch" / "trees.json").read_text())
    assert td.tree_digest(root / "tree") == trees["patched_tree_sha256"]


# The four drifts issue 14 names, and the file each must be reported as.
DRIFTS = [
    ("above-hunk", "megatron/core/mod.py (changed)"),
    ("changed", "megatron/core/other.py (changed)"),
    ("missing", "megatron/core/other.py (missing)"),
    ("extra", "megatron/core/zz_extra.py (extra)"),
]


@needs_patch
@pytest.mark.parametrize("kind, named", DRIFTS)
def test_apply_script_refuses_a_drifted_pristine_tree(tmp_path, kind, named):
    root = _scratch_root(tmp_path)
    _drift(root / "base", kind)
    result = _apply(root, tmp_path)
    assert result.returncode == 13, result.stdout + result.stderr
    assert "error: [base-tree]" in result.stderr
    assert f"first differing file: {named}" in result.stderr
    assert "hint:" in result.stderr
    assert not (root / "tree").exists()  # refused before the patch


@needs_patch
def test_apply_script_refuses_a_hunk_at_an_offset(tmp_path):
    """Even a lock that agrees with a drifted tree cannot make an offset pass."""
    root = _scratch_root(tmp_path)
    _drift(root / "base", "above-hunk")
    base_only = td.lock_fields(root / "base", b"")  # the drifted tree's own digest
    trees = json.loads((root / "patch" / "trees.json").read_text())
    trees.update(base_tree_sha256=base_only["base_tree_sha256"], tree_files=base_only["tree_files"])
    (root / "patch" / "trees.json").write_text(json.dumps(trees))
    result = _apply(root, tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "error: [patch-apply] the patch applies only with an offset or fuzz" in out, out
    assert "offset 1 line" in out


@needs_patch
def test_apply_script_refuses_a_patched_tree_that_is_not_the_locks(tmp_path):
    root = _scratch_root(tmp_path)
    trees = json.loads((root / "patch" / "trees.json").read_text())
    trees["patched_tree_sha256"] = "0" * 64
    trees["tree_files"]["patched_changes"]["megatron/core/new_mod.py"] = "0" * 16
    (root / "patch" / "trees.json").write_text(json.dumps(trees))
    result = _apply(root, tmp_path)
    assert result.returncode == 13
    assert "error: [patched-tree]" in result.stderr
    assert "first differing file: megatron/core/new_mod.py (changed)" in result.stderr


@needs_patch
def test_apply_script_refuses_a_context_without_tree_digests(tmp_path):
    root = _scratch_root(tmp_path)
    (root / "patch" / "trees.json").unlink()
    result = _apply(root, tmp_path)
    assert result.returncode == 13 and "has no tree digests" in result.stderr


# --------------------------------------------------------------------------- host side

@pytest.fixture
def inputs(tmp_path) -> Inputs:
    tree = _tree(tmp_path / "tree")
    patch = tmp_path / "megatron.patch"
    patch.write_text(GOOD_PATCH)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"patch": {"name": "x.patch", "sha256": sha256_file(patch)}}))
    lock = tmp_path / "lock.json"
    lock.write_text(json.dumps({"date": "2026-01-01", **td.lock_fields(tree, GOOD_PATCH.encode())}))
    return Inputs(tree=tree, patch=patch, manifest=manifest, tree_lock=lock)


@needs_patch
@pytest.mark.parametrize("kind, named", DRIFTS)
def test_preflight_refuses_a_drifted_tree_with_exit_13(inputs, kind, named):
    _drift(inputs.tree, kind)
    with pytest.raises(TreeDrift) as info:
        preflight(inputs, FLAVOURS["cuda"])
    assert info.value.exit_code == 13
    assert f"first differing file: {named}" in info.value.message
    assert "tools/backport --upstream 5139086e" in info.value.hint


@needs_patch
def test_preflight_refuses_a_lock_without_tree_digests(inputs):
    inputs.tree_lock.write_text(json.dumps({"date": "2026-01-01", "schema": 1}))
    with pytest.raises(InputError, match="predates the tree digests") as info:
        preflight(inputs, FLAVOURS["cuda"])
    assert info.value.exit_code == 13


@needs_patch
def test_cli_exits_13_on_a_drifted_tree_before_docker(inputs, capsys, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")  # never reached
    _drift(inputs.tree, "missing")
    with pytest.raises(SystemExit) as info:
        image_cli.main(["build", "--flavour", "cuda", "--tree", str(inputs.tree), "--patch", str(inputs.patch),
                        "--manifest", str(inputs.manifest), "--tree-lock", str(inputs.tree_lock)])
    assert info.value.code == 13
    err = capsys.readouterr().err
    assert "first differing file: megatron/core/other.py (missing)" in err and "hint:" in err


@pytest.mark.parametrize("lines, cls, words", [
    (["Step 12/20 : RUN sh /opt/gdn/bin/apply-patch.sh",
      "error: [base-tree] the pristine tree's sha256 0a0a0a0a0a0a is not the lock's 1b1b1b1b1b1b; "
      "first differing file: megatron/core/other.py (changed)"], TreeDrift,
     "first differing file: megatron/core/other.py (changed)"),
    (["Step 12/20 : RUN sh /opt/gdn/bin/apply-patch.sh", "==> [patch-apply] patch -p1",
      "Hunk #1 succeeded at 2 (offset 1 line).",
      "error: [patch-apply] the patch applies only with an offset or fuzz; the tree is not the one it was made "
      "against:"], TreeDrift, "offset"),
    (["Step 12/20 : RUN sh /opt/gdn/bin/apply-patch.sh", "==> [patch-apply] patch -p1",
      "error: [patch-apply] the patch does not apply with zero fuzz to the pristine tree (a hunk was rejected)"],
     BuildStepFailed, "rejected"),
])
def test_build_errors_of_the_tree_steps_exit_13(lines, cls, words):
    tracker = BuildTracker()
    for line in lines:
        tracker.feed({"stream": line + "\n"})
    tracker.feed({"errorDetail": {"message": "The command returned a non-zero code: 13"}})
    err = classify_build_error(tracker, CPU_BASE_IMAGE)
    assert type(err) is cls and words in str(err)
    assert err.exit_code == (13 if cls is TreeDrift else 9)


# --------------------------------------------------------------------------- gate

class _Image:
    id = "sha256:" + "ab" * 32
    tags = ["gdn-megatron:cpu"]
    labels = {"io.gdn.flavour": "cpu"}


class _Containers:
    def __init__(self, outputs: dict):
        self.outputs, self.commands = outputs, []

    def run(self, image, command, **kw):
        self.commands.append(command)
        return "\n".join(json.dumps(self.outputs[p]) for p in ("/opt/gdn/base", "/opt/gdn/tree")).encode()


class _Client:
    def __init__(self, outputs):
        self.containers = _Containers(outputs)
        self.images = type("I", (), {"get": staticmethod(lambda ref: _Image())})()


def _image_outputs(parent: Path, patched: Path) -> dict:
    return {where: {"sha256": td.tree_digest(p), "files": len(td.listing(p)), "ids": td.file_ids(td.listing(p))}
            for where, p in (("/opt/gdn/base", parent), ("/opt/gdn/tree", patched))}


@needs_patch
def test_gate_digests_the_trees_inside_the_image(inputs, tmp_path):
    patched = tmp_path / "patched"
    shutil.copytree(inputs.tree, patched)
    subprocess.run(["patch", "-p1", "-s", "-i", "-"], cwd=patched, input=GOOD_PATCH, text=True, check=True)
    trees = read_tree_lock(inputs.tree_lock)
    client = _Client(_image_outputs(inputs.tree, patched))
    check = image_tree_check(client, _Image.id, trees)
    assert check["base"]["ok"] and check["patched"]["ok"], check
    assert "/opt/gdn/bin/tree_digest.py /opt/gdn/tree --ids" in client.containers.commands[0][-1]
    assert tree_check_failure(check) is None

    (patched / "megatron" / "core" / "other.py").write_text("drift\n")
    client = _Client(_image_outputs(inputs.tree, patched))
    report = run_gate(client, _Image.id, gpus=False, trees=trees)
    assert not report["ok"] and report["suite"]["part"] == "not run"
    assert "first differing file: megatron/core/other.py (changed)" in report["reason"]
    assert [c["outcome"] for c in report["checks"]] == ["passed", "failed"]
    with pytest.raises(TreeDrift) as info:
        require_gate_ok(report)
    assert info.value.exit_code == 13


def test_junit_cases_and_listed_checks():
    xml = ('<testsuites><testsuite>'
           '<testcase classname="test_image_bridge" name="test_import"/>'
           '<testcase classname="test_image_tree_drift" name="test_x"><failure message="m"/></testcase>'
           '<testcase classname="test_image_config" name="test_y"><skipped/></testcase>'
           '</testsuite></testsuites>')
    assert junit_cases(xml) == {"test_image_bridge::test_import": "passed",
                                    "test_image_config::test_y": "skipped",
                                    "test_image_tree_drift::test_x": "failed"}
