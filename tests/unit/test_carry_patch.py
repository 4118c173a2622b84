"""Carried patches: named refusals, git-apply fidelity per feature, placement, paths (issue 10).

Small base trees of our own in tmp dirs; patches made with git itself (fixed identity, UTC).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from backport.carry import CarryRefused, carried_tree, git_apply_tree, load_carry
from backport.engine import build
from backport.errors import ApplyError, RecipeError
from backport.recipe import load_recipe
from backport.workspace import check_tree_path

from conftest import GIT_ENV, gdn_text, git_diff, recipe_data, write_recipe

pytestmark = pytest.mark.usefixtures("engine_env")

F = '"""m."""\n\n\ndef f(x):\n    y = x + 1\n    return y\n\n\ndef g(x):\n    y = x + 1\n    return y\n'


def _git(cwd: Path, *args: str) -> bytes:
    env = {**os.environ, **GIT_ENV, "HOME": "/nonexistent"}
    return subprocess.run(["git", "-c", "core.autocrlf=false", *args], cwd=cwd, env=env, check=True,
                          capture_output=True).stdout


def make_carry(tmp: Path, base: dict, change, diff_args=("-M",)) -> tuple[Path, Path]:
    """A base tree (dir) from ``base`` {path: bytes} and a carry made by ``change(repo)`` with git diff."""
    repo = tmp / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    for rel, data in base.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_bytes(data)
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "base")
    change(repo)
    _git(repo, "add", "-A")
    patch = _git(repo, "diff", "--cached", "--full-index", *diff_args)
    _git(repo, "reset", "-q", "--hard")
    carry = tmp / "carry.patch"
    carry.write_bytes(patch)
    return carry, repo


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _refused(carry: Path, base: Path) -> CarryRefused:
    with pytest.raises(CarryRefused) as exc:
        carried_tree(carry, base)
    assert exc.value.exit_code == 6
    assert "refused before anything was written" in exc.value.message and exc.value.hint
    return exc.value


# --- named refusals ----------------------------------------------------------------------------

@pytest.mark.parametrize("text", [b"", b"\n\n", b"just some notes\nnot a diff\n"])
def test_empty_or_non_diff_carry_is_not_a_patch(tmp_path, text):
    carry = tmp_path / "notes.patch"
    carry.write_bytes(text)
    exc = _refused(carry, tmp_path)
    assert exc.reason == "not-a-patch" and "notes.patch" in exc.message


@pytest.mark.parametrize("args", [("--binary",), ()])
def test_binary_diff_is_refused_naming_the_file(tmp_path, args):
    carry, repo = make_carry(tmp_path, {"m/blob.bin": b"\0\1\2"}, lambda r: _write(r / "m/blob.bin", b"\0\3"), args)
    exc = _refused(carry, repo)
    assert exc.reason == "binary" and "m/blob.bin" in exc.message


def test_a_refused_section_is_named_as_the_carry_means_it_not_as_git_quotes_it(tmp_path):
    """git quotes a non-ASCII name (C-style, octal escapes, b/ prefix): the refusal names m/café.bin."""
    carry, repo = make_carry(tmp_path, {"m/café.bin": b"\0\1\2"}, lambda r: _write(r / "m/café.bin", b"\0\3"),
                             ("--binary",))
    assert b'"b/m/caf\\303\\251.bin"' in carry.read_bytes()
    exc = _refused(carry, repo)
    assert exc.reason == "binary" and "m/café.bin" in exc.message and "\\303" not in exc.message


def test_zero_context_hunk_is_refused(tmp_path):
    carry, repo = make_carry(tmp_path, {"m.py": F.encode()},
                             lambda r: _write(r / "m.py", F.replace("y = x + 1\n    return y\n\n\ndef g",
                                                                    "y = x + 2\n    return y\n\n\ndef g").encode()),
                             ("-U0",))
    exc = _refused(carry, repo)
    assert exc.reason == "zero-context" and "m.py hunk 1" in exc.message


def test_symlink_in_the_carry_is_refused(tmp_path):
    carry, repo = make_carry(tmp_path, {"m.py": F.encode()}, lambda r: os.symlink("m.py", r / "link.py"))
    exc = _refused(carry, repo)
    assert exc.reason == "symlink" and "link.py" in exc.message


def test_non_utf8_carry_is_refused(tmp_path):
    carry = tmp_path / "latin1.patch"
    carry.write_bytes("--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-\xe9\n+e\n".encode("latin-1"))
    assert _refused(carry, tmp_path).reason == "non-utf8"


def test_already_applied_hunk_says_so(tmp_path):
    new = F.replace("def f(x):\n    y = x + 1", "def f(x):\n    y = x + 5")
    carry, repo = make_carry(tmp_path, {"m.py": F.encode()}, lambda r: _write(r / "m.py", new.encode()))
    (repo / "m.py").write_text(new)  # the base already has the change
    with pytest.raises(ApplyError) as exc:
        carried_tree(carry, repo)
    assert "already applied" in exc.value.message and "context differs" not in exc.value.message
    assert "carry:m.py#1" in exc.value.message and exc.value.exit_code == 6


def test_context_that_differs_is_zero_fuzz_error(tmp_path):
    carry, repo = make_carry(tmp_path, {"m.py": F.encode()},
                             lambda r: _write(r / "m.py", F.replace("x + 1\n    return y\n\n\ndef g", "x + 7\n    return y\n\n\ndef g").encode()))
    (repo / "m.py").write_text(F.replace("def f(x):", "def f(x, z):"))
    with pytest.raises(ApplyError) as exc:
        carried_tree(carry, repo)
    assert "does not apply with zero fuzz" in exc.value.message


# --- features applied exactly as git apply ------------------------------------------------------

CRLF = b"def f(x):\r\n    y = x + 1\r\n    return y\r\n"


@pytest.mark.parametrize("name, base, change, args", [
    ("rename-with-edit", {"a.py": F.encode()},
     lambda r: (os.rename(r / "a.py", r / "b.py"), _write(r / "b.py", F.replace("x + 1", "x + 2", 1).encode())), ("-M",)),
    ("pure-rename", {"a.py": F.encode()}, lambda r: os.rename(r / "a.py", r / "sub/b.py")
     if (r / "sub").mkdir() is None else None, ("-M",)),
    ("copy-with-edit", {"a.py": F.encode()},
     lambda r: _write(r / "c.py", F.replace("x + 1", "x + 3", 1).encode()), ("-C", "--find-copies-harder")),
    ("copy-of-a-file-also-modified", {"a.py": F.encode()},
     lambda r: (_write(r / "c.py", F.replace("x + 1", "x + 3", 1).encode()),
                _write(r / "a.py", F.replace("return y\n\n\ndef g", "return -y\n\n\ndef g").encode())),
     ("-C", "--find-copies-harder")),
    ("mode-only", {"a.py": F.encode()}, lambda r: (r / "a.py").chmod(0o755), ()),
    ("mode-and-edit", {"a.py": F.encode()},
     lambda r: (_write(r / "a.py", F.replace("x + 1", "x + 2", 1).encode()), (r / "a.py").chmod(0o755)), ()),
    ("new-file", {"a.py": F.encode()}, lambda r: _write(r / "new/n.py", b"N = 1\n"), ()),
    ("new-executable", {"a.py": F.encode()}, lambda r: (_write(r / "n.sh", b"echo\n"), (r / "n.sh").chmod(0o755)), ()),
    ("deleted-file", {"a.py": F.encode(), "b.py": b"B = 1\n"}, lambda r: (r / "b.py").unlink(), ()),
    ("no-newline-added", {"a.py": F.encode()}, lambda r: _write(r / "a.py", F.encode().rstrip(b"\n")), ()),
    ("no-newline-removed", {"a.py": F.encode().rstrip(b"\n")}, lambda r: _write(r / "a.py", F.encode()), ()),
    ("no-newline-both", {"a.py": F.encode().rstrip(b"\n")},
     lambda r: _write(r / "a.py", F.encode().rstrip(b"\n") + b"  # x"), ()),
    ("crlf-edit", {"w.py": CRLF}, lambda r: _write(r / "w.py", CRLF.replace(b"x + 1", b"x + 2")), ()),
    ("crlf-insert-at-start-and-end", {"w.py": CRLF}, lambda r: _write(r / "w.py", b"# top\r\n" + CRLF + b"Z = 1\r\n"), ()),
])
def test_feature_equals_git_apply_byte_for_byte(tmp_path, name, base, change, args):
    carry, repo = make_carry(tmp_path, base, change, args)
    assert carry.read_bytes().strip(), name
    for kind in ("copy", "rename", "mode", "deleted", "new"):
        if kind in name.split("-"):
            assert {"copy": b"\ncopy from ", "rename": b"\nrename from ", "mode": b"\nnew mode 100755",
                    "deleted": b"\ndeleted file mode", "new": b"\nnew file mode"}[kind] in carry.read_bytes(), name
    ours = carried_tree(carry, repo)
    ref, message = git_apply_tree(load_carry(carry), repo)
    assert message == "" and ours == ref


def test_placement_refuses_context_found_only_in_another_function(tmp_path):
    """The hunk is made against f; in the tree f's lines differ but g has the same context:
    never placed in g."""
    carry, repo = make_carry(tmp_path, {"m.py": F.encode()},
                             lambda r: _write(r / "m.py", F.replace("x + 1\n    return y\n\n\ndef g", "x + 1\n    return y  # f\n\n\ndef g").encode()),
                             ("-U1",))
    (repo / "m.py").write_text(F.replace("def f(x):\n    y = x + 1", "def f(x):\n    y = x + 10")
                               + "\n\ndef h():\n    pass\n")
    with pytest.raises(ApplyError) as exc:
        carried_tree(carry, repo)
    assert "belongs in f" in exc.value.message and "only in g" in exc.value.message


def test_placement_refuses_two_matches_in_the_same_symbol(tmp_path):
    body = "def f(x):\n    y = 1\n    y = 1\n    y = 1\n    y = 1\n    y = 1\n    return y\n"
    carry, repo = make_carry(tmp_path, {"m.py": body.encode()},
                             lambda r: _write(r / "m.py", body.replace("    return y", "    y = 2\n    return y").encode()),
                             ("-U1",))
    (repo / "m.py").write_text(body.replace("def f(x):\n", "def f(x):\n    y = 1\n    y = 1\n    return y\n"))
    with pytest.raises(ApplyError) as exc:
        carried_tree(carry, repo)
    assert "times inside f" in exc.value.message and "does not guess" in exc.value.message


def test_offset_is_warned_and_recorded(tmp_path):
    new = F.replace("def g(x):\n    y = x + 1", "def g(x):\n    y = x + 2")
    carry, repo = make_carry(tmp_path, {"m.py": F.encode()}, lambda r: _write(r / "m.py", new.encode()))
    (repo / "m.py").write_text("# one more line\n" + F)
    from backport.carry import apply_carry, check_paths
    from backport.workspace import Workspace
    from backport.carry import read_base

    warnings, origins = [], {}
    c = load_carry(carry)
    check_paths(c, repo)
    apply_carry(c, Workspace(), lambda p: read_base(repo, p), repo, origins, warnings.append)
    assert origins["carry:m.py#1"]["offset"] == 1 and origins["carry:m.py#1"]["symbol"] == "g"
    assert warnings == ["warning: carried hunk carry:m.py#1 placed at offset +1 lines"]


# --- paths stay inside the tree --------------------------------------------------------------------

@pytest.mark.parametrize("path", ["../../escaped.py", "megatron/../../escaped.py", "/tmp/gdn-abs-escape.py"])
def test_carry_path_leaving_the_tree_is_refused_before_any_write(tmp_path, path):
    tree = tmp_path / "deep" / "tree"
    tree.mkdir(parents=True)
    target = "b/" + path if not path.startswith("/") else path
    carry = tmp_path / "evil.patch"
    carry.write_text(f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ {target}\n"
                     "@@ -0,0 +1 @@\n+ESCAPED = True\n")
    with pytest.raises(ApplyError) as exc:
        carried_tree(carry, tree)
    assert exc.value.exit_code == 6 and path in exc.value.message
    assert not (tmp_path / "escaped.py").exists() and not (tmp_path / "deep" / "escaped.py").exists()
    assert not Path("/tmp/gdn-abs-escape.py").exists()


def test_carry_path_through_a_symlink_leading_out_is_refused(tmp_path):
    tree = tmp_path / "tree"
    (tree / "megatron").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, tree / "megatron" / "link")
    carry = tmp_path / "evil.patch"
    carry.write_text("diff --git a/megatron/link/x.py b/megatron/link/x.py\nnew file mode 100644\n--- /dev/null\n"
                     "+++ b/megatron/link/x.py\n@@ -0,0 +1 @@\n+X = 1\n")
    with pytest.raises(ApplyError) as exc:
        carried_tree(carry, tree)
    assert "megatron/link/x.py" in exc.value.message and "symlink leading out" in exc.value.message
    assert list(outside.iterdir()) == []


def test_carry_rename_header_leaving_the_tree_is_refused(tmp_path):
    (tmp_path / "tree").mkdir()
    carry = tmp_path / "evil.patch"
    carry.write_text("diff --git a/m.py b/m.py\nsimilarity index 100%\nrename from m.py\nrename to ../m.py\n")
    with pytest.raises(ApplyError) as exc:
        carried_tree(carry, tmp_path / "tree")
    assert "'../m.py'" in exc.value.message


def test_check_tree_path_refuses_a_symlink_leading_out_with_the_given_error(tmp_path):
    (tmp_path / "t").mkdir()
    os.symlink("/etc", tmp_path / "t" / "etc")
    with pytest.raises(RecipeError) as exc:
        check_tree_path("etc/passwd", tmp_path / "t", RecipeError, what="recipe step s: path")
    assert exc.value.exit_code == 5 and "etc/passwd" in exc.value.message
    os.symlink("megatron", tmp_path / "t" / "inside")
    (tmp_path / "t" / "megatron").mkdir()
    assert check_tree_path("inside/x.py", tmp_path / "t") == "inside/x.py"


@pytest.mark.parametrize("field, value", [
    ("path", "../escaped.py"), ("path", "/tmp/escaped.py"), ("path", "megatron/../../escaped.py"),
    ("template", "../../backport/cli.py"),
])
def test_recipe_add_file_leaving_the_tree_is_recipe_error(tmp_path, fake_repos, field, value):
    data = recipe_data(fake_repos)
    step = next(s for s in data["steps"] if s["kind"] == "add_file")
    step[field] = value
    with pytest.raises(RecipeError) as exc:
        load_recipe(write_recipe(tmp_path / "r.yaml", data))
    assert exc.value.exit_code == 5 and value in exc.value.message


@pytest.mark.parametrize("spelling", ["megatron/core/./utils.py", "megatron//core/utils.py", "megatron/core/utils.py/"])
def test_a_step_path_not_in_normal_form_is_refused(tmp_path, fake_repos, spelling):
    """Two spellings of one file would slip past the steps that compare paths (hostile trial:
    './' in a transform's path made it edit a copy that never reached the patch, exit 0)."""
    data = recipe_data(fake_repos)
    step = next(s for s in data["steps"] if s.get("kind") in ("adaptation", "fix"))
    step["path"] = spelling
    with pytest.raises(RecipeError) as exc:
        load_recipe(write_recipe(tmp_path / "r.yaml", data))
    assert exc.value.exit_code == 5 and "not in normal form" in exc.value.message


def test_every_step_path_is_checked(tmp_path, fake_repos):
    data = recipe_data(fake_repos)
    for s in data["steps"]:
        if "path" in s:
            s["path"] = "../" + s["path"]
    with pytest.raises(RecipeError) as exc:
        load_recipe(write_recipe(tmp_path / "r.yaml", data))
    with_path = [s["kind"] for s in data["steps"] if "path" in s]
    assert set(with_path) == {"upstream_file", "transplant", "add_file", "adaptation", "fix"}
    assert exc.value.message.count("leaves the tree root") == len(with_path)


def test_engine_refuses_escaping_carry_before_writing(tmp_path, recipe, make_options):
    carry = tmp_path / "evil.patch"
    carry.write_text("diff --git a/../../pwned.py b/../../pwned.py\nnew file mode 100644\n--- /dev/null\n"
                     "+++ b/../../pwned.py\n@@ -0,0 +1 @@\n+PWNED = 1\n")
    with pytest.raises(ApplyError) as exc:
        build(make_options(recipe, carry=carry))
    assert exc.value.exit_code == 6 and "'../../pwned.py'" in exc.value.message


# --- through the engine: the output patch reproduces what was carried ---------------------------------

def test_engine_carries_rename_mode_delete_and_crlf_and_patch_reproduces_them(tmp_path, fake_repos, recipe,
                                                                               make_options):
    gdn = gdn_text()
    bridge = "def bridge():\n    return 'gdn'\n"
    text = git_diff(tmp_path / "src",
                    {"megatron/core/ssm/gated_delta_net.py": gdn, "megatron/bridge/models/gdn_bridge.py": bridge,
                     "megatron/core/bridge_only.py": "ONLY_IN_BRIDGE = True\n"},
                    {"megatron/bridge/models/gdn_bridge.py": None,
                     "megatron/bridge/models/gdn_bridge_v2.py": bridge + "\n\nV2 = True\n",
                     "megatron/core/bridge_only.py": None,
                     "megatron/core/windows.py": "A = 1\r\nB = 2\r\n"})
    carry = tmp_path / "down.patch"
    carry.write_text(text, newline="")
    b = build(make_options(recipe, carry=carry))
    patch = b.patch.decode()
    assert "+A = 1\r\n" in patch and "deleted file mode" in patch
    files = {f["path"]: f["status"] for f in b.manifest["files"]}
    assert files["megatron/bridge/models/gdn_bridge.py"] == "deleted"
    assert files["megatron/bridge/models/gdn_bridge_v2.py"] == "added"
    assert files["megatron/core/bridge_only.py"] == "deleted"
    checks = {c["check"]: c for c in b.manifest["verification"]}
    assert checks["applies"]["ok"] and checks["carry_survival"]["ok"]
    assert "carry:megatron/bridge/models/gdn_bridge_v2.py#rename" in b.manifest["carry"]["hunks"]


def test_upstream_offsets_are_warned_and_shown_in_manifest_md(recipe, make_options):
    from backport.manifest_md import render_markdown

    messages = []
    b = build(make_options(recipe), progress=messages.append)
    assert "warning: upstream hunk megatron/core/utils.py#1 placed at offset -3 lines" in messages
    assert sum("warning:" in m for m in messages) == 2  # once per hunk, not again for the determinism run
    md = render_markdown(b.manifest)
    assert "Placed at an offset from their header line (2): `megatron/core/utils.py#1` -3" in md
    assert "| `megatron/core/utils.py#1` | upstream-verbatim | applied | -3 |" in md


# --- dialects other than `git diff` (issue 23) ---------------------------------------------------

def _gnu_diff_carry(tmp: Path, base: dict, changed: dict) -> tuple[Path, Path]:
    """A base tree ``tmp/repo`` from ``base`` and a carry made by GNU ``diff -ruN a b`` (no git lines).

    ``changed`` maps paths to their new bytes; paths absent from ``base`` are created.
    """
    repo, old, new = tmp / "repo", tmp / "a", tmp / "b"
    for root, files in ((repo, base), (old, base), (new, {**base, **changed})):
        for rel, data in files.items():
            _write(root / rel, data)
    _git(repo, "init", "-q")  # git apply (the reference) runs in a repository
    proc = subprocess.run(["diff", "-ruN", "a", "b"], cwd=tmp, capture_output=True, env={"TZ": "UTC", "LC_ALL": "C"})
    assert proc.returncode == 1, proc.stderr
    carry = tmp / "carry.patch"
    carry.write_bytes(proc.stdout)
    return carry, repo


def test_section_without_diff_git_line_carries_like_git_apply(tmp_path):
    # A plain `diff -u` section: `---`/`+++` with dates, no `diff --git` header line at all.
    carry, repo = _gnu_diff_carry(tmp_path, {"a.py": F.encode()}, {"a.py": F.replace("x + 1", "x + 2", 1).encode()})
    text = carry.read_bytes()
    plain = text.replace(b"diff -ruN a/a.py b/a.py\n", b"")  # as a hand-edited patch has it
    assert not plain.startswith(b"diff ") and b"\n--- a/a.py\t" in b"\n" + plain
    carry.write_bytes(plain)
    ours = carried_tree(carry, repo)
    ref, message = git_apply_tree(load_carry(carry), repo)
    assert message == "" and ours == ref
    assert ours["a.py"][0] == F.replace("x + 1", "x + 2", 1).encode()


def test_diff_ruN_new_file_is_a_creation_like_git_apply(tmp_path):
    carry, repo = _gnu_diff_carry(tmp_path, {"a.py": F.encode()}, {"new/n.py": b"N = 1\nM = 2\n"})
    assert b"1970-01-01" in carry.read_bytes() and b"@@ -0,0 +1,2 @@" in carry.read_bytes()
    loaded = load_carry(carry)
    assert [(f.kind, f.old_path, f.new_path) for f in loaded.files] == [("add", None, "new/n.py")]
    ours = carried_tree(carry, repo)
    ref, message = git_apply_tree(loaded, repo)
    assert message == "" and ours == ref and ours["new/n.py"][0] == b"N = 1\nM = 2\n"


def test_git_diff_adding_lines_to_an_empty_file_is_not_read_as_a_creation(tmp_path):
    # git writes `@@ -0,0 +1 @@` for an existing empty file too; its own headers decide, not -0,0.
    from unidiff import PatchSet

    from backport.carry import _whole_side_empty
    carry, _ = make_carry(tmp_path, {"a.py": F.encode(), "e.py": b""}, lambda r: _write(r / "e.py", b"E = 1\n"))
    (pfile,) = PatchSet(carry.read_text())
    assert pfile[0].source_start == 0 and pfile[0].source_length == 0
    assert not _whole_side_empty(pfile, "source")


def test_carry_from_a_pipe_is_read_once_fully(tmp_path):
    # `--carry /dev/stdin` or `<(...)`: a pipe yields its bytes once; the run reads the carry
    # several times (digest, parse, determinism re-run), so it works on a snapshot.
    from backport.cli import _carry_read_once

    data = b"--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x\n+y\n"
    r, w = os.pipe()
    os.write(w, data)
    os.close(w)
    try:
        snap = _carry_read_once(Path(f"/dev/fd/{r}"))
    finally:
        os.close(r)
    assert snap.is_file() and snap.read_bytes() == data and snap.read_bytes() == data
    assert snap.name == str(r)
    regular = tmp_path / "c.patch"
    regular.write_bytes(data)
    assert _carry_read_once(regular) == regular and _carry_read_once(None) is None


def test_crlf_throughout_the_carry_is_refused_naming_line_endings(tmp_path):
    # A Windows editor saved the whole carry with CRLF; the base file has LF. GNU patch -p1
    # refuses it too ("different line endings"); the refusal must say so, not only "context".
    carry, repo = make_carry(tmp_path, {"a.py": F.encode()},
                             lambda r: _write(r / "a.py", F.replace("x + 1", "x + 2", 1).encode()))
    carry.write_bytes(carry.read_bytes().replace(b"\n", b"\r\n"))
    with pytest.raises(ApplyError) as info:
        carried_tree(carry, repo)
    exc = info.value
    assert exc.exit_code == 6
    assert "line endings differ" in exc.message and "CRLF" in exc.message and "LF" in exc.message


@pytest.mark.parametrize("base, after", [
    ({"a.py": F.encode(), "e.py": b""}, {"e.py": b"a\nb\n"}),      # an existing empty file gains lines
    ({"a.py": F.encode(), "x.py": b"l1\nl2\n"}, {"x.py": b""}),    # a file emptied but kept
])
def test_diff_ruN_minus_0_0_with_a_real_date_is_a_modification(tmp_path, base, after):
    # Only an epoch date on the empty side means "created"/"deleted"; a real date is a file that
    # exists and is (or becomes) empty, and git apply modifies it (hostile trial).
    carry, repo = _gnu_diff_carry(tmp_path, base, after)
    assert b"1970-01-01" not in carry.read_bytes()
    assert [f.kind for f in load_carry(carry).files] == ["modify"]
    ours = carried_tree(carry, repo)
    ref, message = git_apply_tree(load_carry(carry), repo)
    assert message == "" and ours == ref


def test_epoch_is_recognised_in_any_zone():
    from backport.carry import _is_epoch

    assert _is_epoch("1970-01-01 00:00:00.000000000 +0000")
    assert _is_epoch("1969-12-31 19:00:00.000000000 -0500")
    assert _is_epoch("1970-01-01 01:00:00 +0100")
    assert not _is_epoch("2026-12-02 11:22:33.121019009 +0000") and not _is_epoch(None) and not _is_epoch("junk")


def test_git_diff_filling_an_empty_file_applies_like_git_apply(tmp_path):
    carry, repo = make_carry(tmp_path, {"a.py": F.encode(), "e.py": b""}, lambda r: _write(r / "e.py", b"E = 1\n"))
    ours = carried_tree(carry, repo)
    ref, message = git_apply_tree(load_carry(carry), repo)
    assert message == "" and ours == ref and ours["e.py"][0] == b"E = 1\n"


def test_zero_context_insertion_at_the_top_of_a_non_empty_file_stays_refused(tmp_path):
    carry, repo = make_carry(tmp_path, {"a.py": F.encode()}, lambda r: _write(r / "a.py", b"# top\n" + F.encode()),
                             ("-U0",))
    assert b"@@ -0,0 +1 @@" in carry.read_bytes()
    with pytest.raises(ApplyError) as info:
        carried_tree(carry, repo)
    assert info.value.exit_code == 6


# --- file names: diff --git vs ---/+++, quoting (issue 23) -----------------------------------------

_TWO = {"x.py": b"a\nb\nc\n", "y.py": b"p\nq\nr\n"}
_EDIT_Y = "--- a/y.py\n+++ b/y.py\n@@ -1,3 +1,3 @@\n p\n-q\n+Q\n r\n"
_EDIT_X = "--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"


def _base_repo(tmp: Path, files: dict) -> Path:
    repo = tmp / "repo"
    for rel, data in files.items():
        _write(repo / rel, data)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "base")
    return repo


@pytest.mark.parametrize("text, edited", [
    ("diff --git a/x.py b/x.py\nindex 1111111..2222222 100644\n" + _EDIT_Y, "y.py"),  # another file entirely
    ("diff --git a/x.py b/x.py\n" + _EDIT_Y, "y.py"),                                 # no index line
    ("diff --git a/x.py b/z.py\n" + _EDIT_X, "x.py"),                                 # only its b/ side differs
])
def test_diff_git_line_naming_other_paths_than_the_minus_plus_lines(tmp_path, text, edited):
    # git apply takes the names from ---/+++ (the diff --git line is only its default), as
    # GNU patch does; unidiff alone stopped with "Target without source". Warned by name.
    from backport.carry import apply_carry, check_paths, read_base
    from backport.workspace import Workspace

    repo = _base_repo(tmp_path, _TWO)
    carry = tmp_path / "names.patch"
    carry.write_text(text)
    loaded = load_carry(carry)
    assert [(f.kind, f.old_path, f.new_path) for f in loaded.files] == [("modify", edited, edited)]
    warnings = []
    check_paths(loaded, repo)
    apply_carry(loaded, Workspace(), lambda p: read_base(repo, p), repo, {}, warnings.append)
    assert len(warnings) == 1 and "its diff --git line names a/x.py" in warnings[0]
    assert f"its ---/+++ lines a/{edited} b/{edited}" in warnings[0] and "---/+++ names are used" in warnings[0]
    ours = carried_tree(carry, repo)
    ref, message = git_apply_tree(load_carry(carry), repo)
    assert message == "" and ours == ref and ours[edited][0] != _TWO[edited]
    out = subprocess.run(["git", "apply", "--check", "-v", str(carry)], cwd=repo, capture_output=True, text=True)
    assert f"Checking patch {edited}..." in out.stderr  # git's own reading, for the record


@pytest.mark.parametrize("git_line", ["diff --git a/x.py b/y.py\n", ""])
def test_minus_plus_naming_two_files_without_rename_lines_is_refused(tmp_path, git_line):
    # git apply renames x.py over y.py (diff --git section) or edits y.py (plain section), GNU
    # patch edits x.py: the readings differ, so the tool names it instead of picking one.
    repo = _base_repo(tmp_path, _TWO)
    carry = tmp_path / "two.patch"
    carry.write_text(git_line + _EDIT_X.replace("+++ b/x.py", "+++ b/y.py"))
    exc = _refused(carry, repo)
    assert exc.reason == "names-differ" and "--- names x.py, +++ names y.py" in exc.message
    assert "rename from" in exc.hint


NAME = "megatron/café ü.py"


@pytest.mark.parametrize("quotepath", ["true", "false"])
@pytest.mark.parametrize("dialect", ["git", "plain"])
def test_non_ascii_file_names_quoted_or_not_carry_like_git_apply(tmp_path, quotepath, dialect):
    # core.quotepath=true (git's default) writes "a/caf\303\251 \303\274.py"; false writes UTF-8.
    # An edit, a creation and a rename, each with a non-ASCII name.
    repo = _base_repo(tmp_path, {NAME: F.encode(), "megatron/é.py": b"E = 1\n"})
    _write(repo / NAME, F.replace("x + 1", "x + 2", 1).encode())
    _write(repo / "megatron/ñew.py", b"N = 1\n")
    os.rename(repo / "megatron/é.py", repo / "megatron/è.py")
    _git(repo, "add", "-A")
    text = _git(repo, "-c", f"core.quotepath={quotepath}", "diff", "--cached", "--full-index", "-M")
    _git(repo, "reset", "-q", "--hard")
    assert (b'"a/megatron/caf\\303\\251 \\303\\274.py"' in text) == (quotepath == "true")
    if dialect == "plain":  # the edit without its diff --git and index lines, as in a hand-edited patch
        lines = text.splitlines(keepends=True)
        at = next(i for i, line in enumerate(lines) if b"caf" in line)
        assert lines[at].startswith(b"diff --git ") and lines[at + 1].startswith(b"index ")
        text = b"".join(lines[:at] + lines[at + 2:])
    carry = tmp_path / "names.patch"
    carry.write_bytes(text)
    loaded = load_carry(carry)
    assert {f.path: f.kind for f in loaded.files} == {NAME: "modify", "megatron/ñew.py": "add",
                                                      "megatron/è.py": "rename"}
    ours = carried_tree(carry, repo)
    ref, message = git_apply_tree(loaded, repo)
    assert message == "" and ours == ref
    assert ours[NAME][0] == F.replace("x + 1", "x + 2", 1).encode() and ours["megatron/é.py"] is None


@pytest.mark.parametrize("name, why", [('"a/caf\\303.py"', "not UTF-8"), ('"a/x\\qy.py"', "malformed"),
                                       ('"a/tab\\there.py"', "control character")])
def test_bad_quoted_names_are_refused_by_name(tmp_path, name, why):
    carry = tmp_path / "q.patch"
    target = name.replace('"a/', '"b/')
    carry.write_text(f"--- {name}\n+++ {target}\n@@ -1 +1 @@\n-x\n+y\n")
    exc = _refused(carry, tmp_path)
    assert exc.reason == "quoted-path" and why in exc.message


def test_unquote_follows_gits_c_style():
    from backport.gitpath import unquote

    assert unquote('"a/caf\\303\\251.py"') == "a/café.py"
    assert unquote('"a/q\\"uote\\\\d.py"') == 'a/q"uote\\d.py'
    assert unquote('"a/t\\tn\\n.py"') == "a/t\tn\n.py"
    assert unquote("a/plain é.py") == "a/plain é.py"
    for bad in ('"a/open', '"a/x"y', '"a/\\9.py"'):
        with pytest.raises(ValueError):
            unquote(bad)


@pytest.mark.parametrize("quotepath", ["true", "false"])
def test_engine_carries_non_ascii_names_into_the_patch_and_manifest(tmp_path, recipe, make_options, quotepath):
    # Was: accepted, then KeyError in patchfile.py (git quoted the output patch's names, the
    # lookup used unidiff's quoted path). The output patch names files in UTF-8, as the manifest.
    from conftest import commit, init_repo

    repo = init_repo(tmp_path / "src")
    commit(repo, {"megatron/core/ssm/gated_delta_net.py": gdn_text()}, "before")
    _write(repo / "megatron/core/café.py", "CAFÉ = 'é'\n".encode())
    _git(repo, "add", "-A")
    text = _git(repo, "-c", f"core.quotepath={quotepath}", "diff", "--cached", "--full-index")
    assert (b"\\303\\251" in text) == (quotepath == "true")
    carry = tmp_path / "down.patch"
    carry.write_bytes(text)
    b = build(make_options(recipe, carry=carry))
    assert "diff --git a/megatron/core/café.py b/megatron/core/café.py\n" in b.patch.decode()
    assert {f["path"]: f["status"] for f in b.manifest["files"]}["megatron/core/café.py"] == "added"
    assert "carry:megatron/core/café.py#1" in b.manifest["carry"]["hunks"]
    assert {c["check"]: c["ok"] for c in b.manifest["verification"]}["carry_survival"]


# --- file modes in the output patch (issue 23) -------------------------------------------------------

def test_output_patch_keeps_100755_of_an_edited_executable_and_git_apply_check_is_silent(tmp_path):
    # The index lines said 100644 for a 755 file (the base's mode was not read), so git apply
    # --check of our own output warned "has type 100755, expected 100644".
    from backport.carry import carry_workspace
    from backport.patchfile import make_patch

    base = {"tool.py": F.encode(), "plain.py": F.encode(), "gone.py": b"G = 1\n", "moved.py": F.encode()}

    def change(r):
        _write(r / "tool.py", F.replace("x + 1", "x + 2", 1).encode())
        _write(r / "plain.py", F.replace("x + 1", "x + 3", 1).encode())
        (r / "gone.py").unlink()
        os.rename(r / "moved.py", r / "moved_to.py")
        _write(r / "moved_to.py", F.replace("x + 1", "x + 4", 1).encode())

    repo = tmp_path / "repo"
    for rel, data in base.items():
        _write(repo / rel, data)
    for rel in ("tool.py", "gone.py", "moved.py"):
        (repo / rel).chmod(0o755)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "base")
    change(repo)
    _git(repo, "add", "-A")
    carry = tmp_path / "carry.patch"
    carry.write_bytes(_git(repo, "diff", "--cached", "--full-index", "-M"))
    _git(repo, "reset", "-q", "--hard")
    _, ws = carry_workspace(carry, repo)
    out = make_patch(ws.changed(), "header\n\n", repo)
    sections = {s.split(" ", 1)[0]: s for s in out.split("diff --git a/")[1:]}
    assert sections["tool.py"].splitlines()[1].endswith(" 100755")
    assert sections["plain.py"].splitlines()[1].endswith(" 100644")
    assert "deleted file mode 100755" in sections["gone.py"]
    assert "new file mode 100755" in sections["moved_to.py"] and "deleted file mode 100755" in sections["moved.py"]
    check = subprocess.run(["git", "apply", "--check", "-"], cwd=repo, input=out.encode(), capture_output=True)
    assert check.returncode == 0 and check.stderr == b""
    applied = subprocess.run(["git", "apply", "-"], cwd=repo, input=out.encode(), capture_output=True)
    assert applied.returncode == 0 and applied.stderr == b""
    assert os.stat(repo / "tool.py").st_mode & 0o111 and os.stat(repo / "moved_to.py").st_mode & 0o111


# --- git format-patch mail, CRLF headers (issue 23) ---------------------------------------------------

def test_format_patch_mail_carries_like_git_apply(tmp_path):
    # From/Subject headers, a message with a "--- a/..." line and a "-- " line, the --- stat
    # block, and the "-- \n2.x" signature trailer: the mail parts are not sections.
    repo = _base_repo(tmp_path, {"a.py": F.encode(), "tool.py": F.encode()})
    (repo / "tool.py").chmod(0o755)
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "exec")
    _write(repo / "a.py", F.replace("x + 1", "x + 2", 1).encode())
    _write(repo / "tool.py", F.replace("return y\n\n\ndef g", "return -y\n\n\ndef g").encode())
    _write(repo / "new.py", b"N = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m",
         "downstream: three changes\n\nWhy, in a body line.\n--- a/not_a_file.py\n-- \nnot a signature")
    mail = _git(repo, "format-patch", "-1", "--stdout", "--full-index")
    _git(repo, "reset", "-q", "--hard", "HEAD~1")
    assert mail.startswith(b"From ") and b"\nSubject: [PATCH] downstream" in mail
    assert b"\n---\n a.py " in mail and mail.rstrip().endswith(b"\n-- \n" + mail.rstrip().rsplit(b"\n", 1)[1])
    carry = tmp_path / "0001-downstream.patch"
    carry.write_bytes(mail)
    loaded = load_carry(carry)
    assert [(f.kind, f.path) for f in loaded.files] == [("modify", "a.py"), ("add", "new.py"), ("modify", "tool.py")]
    assert [len(f.hunks) for f in loaded.files] == [1, 1, 1]
    ours = carried_tree(carry, repo)
    ref, message = git_apply_tree(loaded, repo)
    assert message == "" and ours == ref and ours["tool.py"][1] == "100755"


def test_crlf_carry_deleting_a_file_is_refused_naming_line_endings(tmp_path):
    # unidiff missed "deleted file mode 100644\r" and stopped with "Target without source".
    carry, repo = make_carry(tmp_path, {"a.py": F.encode(), "b.py": b"B = 1\n"}, lambda r: (r / "b.py").unlink())
    carry.write_bytes(carry.read_bytes().replace(b"\n", b"\r\n"))
    assert [f.kind for f in load_carry(carry).files] == ["delete"]
    with pytest.raises(ApplyError) as info:
        carried_tree(carry, repo)
    assert info.value.exit_code == 6 and "line endings differ" in info.value.message


def test_crlf_carry_of_a_mode_change_is_refused_naming_line_endings(tmp_path):
    # No hunk to compare; git apply refuses the CRLF header ("lacks filename information").
    carry, repo = make_carry(tmp_path, {"a.py": F.encode()}, lambda r: (r / "a.py").chmod(0o755), ())
    carry.write_bytes(carry.read_bytes().replace(b"\n", b"\r\n"))
    exc = _refused(carry, repo)
    assert exc.reason == "git-apply-differs" and "line endings" in exc.message and "dos2unix" in exc.hint


def _two_hunk_carry(tmp: Path) -> tuple[Path, Path]:
    base = {"m.py": F.encode()}
    carry, repo = make_carry(tmp, base, lambda r: (r / "m.py").write_text(
        F.replace("    y = x + 1\n    return y\n\n\ndef g", "    y = x + 2\n    return y\n\n\ndef g")
         .replace("def g(x):\n    y = x + 1", "def g(x):\n    y = x + 3")), diff_args=("-U1",))
    base_dir = tmp / "base"
    _write(base_dir / "m.py", F.encode())
    return carry, base_dir


@pytest.mark.parametrize("edit, line", [
    (lambda t: t.replace("@@ -4,3 +4,3 @@", "@@ -4,4 +4,4 @@", 1), "after the hunk '@@ -4,4 +4,4 @@"),
    (lambda t: t.replace("\n     return y\n", "\n\treturn y\n", 1), "in the hunk '@@ -4,3 +4,3 @@"),
    (lambda t: t.replace("@@ -9,3 +9,3 @@", "@@ -9,5 +9,5 @@", 1), "in its last hunk '@@ -9,5 +9,5 @@"),
])
def test_hand_edited_hunk_that_cannot_be_parsed_is_named_with_its_line_and_hunk(tmp_path, edit, line):
    """A hand edit leaving wrong @@ counts, or a tab where the leading space was: exit 6, the carry's line
    number and the hunk named, and the hint says to recount (never a traceback, never a partial carry)."""
    carry, base = _two_hunk_carry(tmp_path)
    text = carry.read_text()
    assert "@@ -4,3 +4,3 @@" in text, text
    carry.write_text(edit(text))
    with pytest.raises(ApplyError) as exc:
        carried_tree(carry, base)
    assert exc.value.exit_code == 6
    msg = str(exc.value)
    assert msg.startswith("carried patch carry.patch cannot be parsed ") and line in msg, msg
    assert "@@ line counts" in msg and "Recount" in exc.value.hint


def test_format_patch_series_changing_one_file_twice_says_to_squash(tmp_path):
    """Two `diff --git` sections of one file (a format-patch series, quilt patches concatenated): refused by
    name, the hint says how to make one section."""
    carry, base = _two_hunk_carry(tmp_path)
    text = carry.read_text()
    head, first, second = text.split("\n@@ -")
    carry.write_text(head + "\n@@ -" + first + "\n" + head.split("index ")[0] + "--- a/m.py\n+++ b/m.py\n@@ -"
                     + second)
    exc = _refused(carry, base)
    assert exc.reason == "twice" and "m.py" in str(exc)
    assert "git diff FIRST^ LAST" in exc.hint


@pytest.mark.parametrize("dialect", ["git-no-prefix", "svn"])
def test_paths_without_a_b_prefixes_are_refused_naming_the_file_and_the_fix(tmp_path, dialect):
    """`git diff --no-prefix`, or an svn diff (`Index:` line, `(revision N)` after a tab): exit 6 naming the
    file, the hint says to use plain `git diff` or write a/ and b/ names."""
    base = {"m.py": F.encode()}
    carry, _ = make_carry(tmp_path, base, lambda r: (r / "m.py").write_text(F.replace("x + 1", "x + 2", 1)),
                          diff_args=("--no-prefix",))
    if dialect == "svn":
        body = carry.read_text().split("\n", 2)[2].replace("--- m.py", "--- m.py\t(revision 7)")
        carry.write_text("Index: m.py\n" + "=" * 67 + "\n" + body.replace("+++ m.py", "+++ m.py\t(working copy)"))
    base_dir = tmp_path / "base"
    _write(base_dir / "m.py", F.encode())
    exc = _refused(carry, base_dir)
    assert exc.reason == "no-prefix" and ": m.py: " in str(exc), str(exc)
    assert "--no-prefix" in exc.hint and "a/<path>" in exc.hint
