"""Outputs never reach outside ``--out``, and never inside the trees of another output folder.

* every output path, and every folder on the way to one below ``--out`` (the tool's state in
  ``build/.gdn`` included), refused when it is a symbolic link: exit 16 naming the link and
  its target; the target's bytes and the link stay as they were, nothing else changes;
* ``--out`` inside ``patches/``, ``build/tree/`` or ``build/.gdn/`` of an output folder (the
  repository root included) and ``--out ""`` refused by name (exit 2) before any work;
* files left in ``build/tree/*`` that the tool did not write: one warning line naming them
  (first five and a count), from a plain run (which still replaces the trees) and ``--check``.

Throwaway folders only; every link points at a folder outside ``--out`` in ``tmp_path``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from backport import output
from backport.cli import REPO_ROOT, cli
from backport.engine import build
from backport.errors import OutputLinkError, UsageError

from conftest import STUB_PYTHON, recipe_data, write_recipe

pytestmark = pytest.mark.usefixtures("engine_env")


@pytest.fixture(scope="module")
def builds(fake_repos, tmp_path_factory):
    """Builds A (2026-01-02) and B (2026-01-03) of the fake recipe."""
    from backport.options import Options

    tmp = tmp_path_factory.mktemp("paths-builds")
    recipe = write_recipe(tmp / "fake.yaml", recipe_data(fake_repos))

    def make(date):
        return build(Options(recipe=recipe, megatron_lm=str(fake_repos.mlm), megatron_bridge=str(fake_repos.bridge_repo),
                             cache_dir=tmp / "cache", date=date, python=STUB_PYTHON))

    return {"A": make("20260102"), "B": make("20260103")}


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file and symlink under ``root`` (links recorded, never followed)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                found[rel] = b"-> " + os.readlink(path).encode()
            elif path.is_file():
                found[rel] = path.read_bytes()
    return found


def _dated(b) -> str:
    return "patches/megatron/" + b.manifest["patch"]["name"]


#: Where a link may stand: each output file, each tree, each folder on the way, the state.
LINKED = ["patches", "patches/latest", "patches/megatron", "patches/latest/megatron.patch",
          "patches/latest/manifest.json", "patches/latest/manifest.md", "DATED", "manifests", "manifests/lock.json",
          "build", "build/tree", "build/tree/base", "build/tree/patched", "build/.gdn", "build/.gdn/txn",
          "build/.gdn/output.lock"]


def _link_out(root: Path, rel: str, outside: Path) -> Path:
    """Move ``root/rel`` (file or folder, when there) to ``outside/...`` and link it back."""
    path = root / rel
    target = outside / rel.replace("/", "_")
    if path.exists():
        shutil.move(str(path), str(target))
    elif rel.endswith((".json", ".md", ".patch", ".lock")):
        target.write_bytes(b"the user's own file\n")
    else:
        target.mkdir()
        (target / "keep.txt").write_bytes(b"the user's own file\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target, target_is_directory=target.is_dir())
    return target


@pytest.mark.parametrize("rel", LINKED)
def test_a_link_at_any_output_path_is_refused_and_its_target_untouched(rel, builds, tmp_path):
    root, outside = tmp_path / "out", tmp_path / "elsewhere"
    outside.mkdir()
    output.write(builds["A"], root)
    rel = _dated(builds["B"]) if rel == "DATED" else rel  # the name B would write
    target = _link_out(root, rel, outside)
    before, before_outside = snapshot(root), snapshot(outside)
    with pytest.raises(OutputLinkError) as exc:
        output.write(builds["B"], root)
    assert exc.value.exit_code == 16
    assert f"{rel} in the output folder {root} is a symbolic link to {target}" in exc.value.message
    assert f"`rm {root / rel}`" in exc.value.hint and "--out" in exc.value.hint
    assert snapshot(outside) == before_outside  # nothing written through the link
    assert snapshot(root) == before  # the link is still a link, nothing else changed
    with pytest.raises(OutputLinkError):  # --check reads through no link either
        output.check(builds["B"], root)
    (root / rel).unlink()  # what the hint says; the target stays
    assert snapshot(outside) == before_outside


@pytest.mark.parametrize("rel", ["patches/latest", "manifests/lock.json", "build/tree/patched"])
def test_a_link_in_a_fresh_output_folder_is_refused_before_anything_is_written(rel, builds, tmp_path):
    root, outside = tmp_path / "out", tmp_path / "elsewhere"
    outside.mkdir()
    root.mkdir()
    _link_out(root, rel, outside)
    before_outside = snapshot(outside)
    with pytest.raises(OutputLinkError):
        output.write(builds["A"], root)
    assert snapshot(outside) == before_outside
    assert list(snapshot(root)) == [rel]  # the link alone: no file, no folder, no lock written


def test_a_dangling_link_is_named_as_dangling(builds, tmp_path):
    root = tmp_path / "out"
    (root / "patches").mkdir(parents=True)
    (root / "patches/latest").symlink_to(tmp_path / "gone")
    with pytest.raises(OutputLinkError) as exc:
        output.write(builds["A"], root)
    assert f"to {tmp_path / 'gone'} (a dangling link)" in exc.value.message
    assert not (tmp_path / "gone").exists()


def test_a_link_made_while_staging_is_refused_before_the_switch(builds, tmp_path, monkeypatch):
    root, outside = tmp_path / "out", tmp_path / "elsewhere"
    outside.mkdir()
    output.write(builds["A"], root)
    before_outside = None
    real = output.copy_tree

    def link_meanwhile(src, dest):  # another program links patches/latest while the trees stage
        nonlocal before_outside
        real(src, dest)
        if before_outside is None:
            _link_out(root, "patches/latest", outside)
            before_outside = snapshot(outside)

    monkeypatch.setattr(output, "copy_tree", link_meanwhile)
    with pytest.raises(OutputLinkError):
        output.write(builds["B"], root)
    assert snapshot(outside) == before_outside
    assert not (root / output.TXN).exists()  # staging removed, nothing switched
    assert (root / output.LOCK).read_bytes() == output.rendered(builds["A"])[output.LOCK]


def test_recovery_refuses_a_linked_state_folder(builds, tmp_path):
    root, outside = tmp_path / "out", tmp_path / "elsewhere"
    outside.mkdir()
    output.write(builds["A"], root)
    target = outside / "txn"
    (target / "new").mkdir(parents=True)
    (target / "journal.json").write_bytes(b"not a journal\n")
    (root / output.TXN).symlink_to(target, target_is_directory=True)
    before_outside = snapshot(outside)
    with pytest.raises(OutputLinkError) as exc:
        output.recover(root)
    assert "build/.gdn/txn in the output folder" in exc.value.message
    assert snapshot(outside) == before_outside


# --- through the CLI --------------------------------------------------------------------------

@pytest.fixture
def base_args(tmp_path, fake_repos):
    recipe = write_recipe(tmp_path / "fake.yaml", recipe_data(fake_repos))
    return ["--recipe", str(recipe), "--megatron-lm", str(fake_repos.mlm), "--megatron-bridge", str(fake_repos.bridge_repo),
            "--cache-dir", str(tmp_path / "cache"), "--python", STUB_PYTHON, "--date", "2026-01-02"]


def _invoke(args):
    return CliRunner().invoke(cli, args)


def _error_lines(stderr: str) -> list[str]:
    lines = stderr.rstrip("\n").splitlines()
    assert "Traceback" not in stderr
    assert lines[-2].startswith("error: ") and lines[-1].startswith("hint: "), stderr
    return lines[-2:]


@pytest.mark.parametrize("rel", ["patches/latest", "patches/megatron", "manifests/lock.json", "build/tree/patched",
                                 "build/.gdn"])
@pytest.mark.parametrize("mode", [[], ["--check"]])
def test_cli_exit_16_names_the_link_and_its_target_before_any_work(rel, mode, base_args, tmp_path, monkeypatch):
    root, outside = tmp_path / "out", tmp_path / "elsewhere"
    outside.mkdir()
    assert _invoke(base_args + ["--out", str(root)]).exit_code == 0
    target = _link_out(root, rel, outside)
    before, before_outside = snapshot(root), snapshot(outside)
    monkeypatch.setattr("backport.engine.build", lambda *a, **k: pytest.fail("built despite the link"))
    result = _invoke(base_args + ["--out", str(root), "--date", "2026-01-03"] + mode)
    assert result.exit_code == 16, result.output
    error, hint = _error_lines(result.stderr)
    assert f"error: {rel} in the output folder {root} is a symbolic link to {target}" in error
    assert f"rm {root / rel}" in hint and "pass --out" in hint
    assert result.stdout == ""
    assert snapshot(outside) == before_outside and snapshot(root) == before


@pytest.mark.parametrize("inside", ["build/tree/patched", "build/tree/base/sub", "build/tree", "patches",
                                    "patches/latest/x", "build/.gdn/out"])
def test_an_out_inside_another_output_folders_trees_is_refused(inside, base_args, tmp_path):
    root = tmp_path / "out"
    assert _invoke(base_args + ["--out", str(root)]).exit_code == 0
    before = snapshot(root)
    result = _invoke(base_args + ["--out", str(root / inside)])
    assert result.exit_code == 2, result.output
    error, hint = _error_lines(result.stderr)
    tree = next(t for t in output.OUTPUT_TREES if inside == t or inside.startswith(t + "/"))
    assert f"--out {root / inside} lies inside {root / tree}" in error and f"output folder {root}" in error
    assert "a folder of its own" in hint
    assert snapshot(root) == before  # nothing written, nested or not
    checked = _invoke(base_args + ["--out", str(root / inside), "--check"])
    assert checked.exit_code == 2 and "lies inside" in checked.stderr


def test_an_out_inside_the_repositorys_trees_and_a_link_into_them_are_refused(base_args, tmp_path):
    nested = REPO_ROOT / "build/tree/patched/elsewhere"
    result = _invoke(base_args + ["--out", str(nested)])
    assert result.exit_code == 2, result.output
    assert "(where a run without --out writes)" in result.stderr
    assert not nested.exists()
    link = tmp_path / "innocent"
    link.symlink_to(REPO_ROOT / "build/tree", target_is_directory=True)
    assert _invoke(base_args + ["--out", str(link / "x")]).exit_code == 2


def test_folders_that_only_look_like_output_trees_are_accepted(tmp_path):
    (tmp_path / "patches").mkdir()  # no lock, no build/.gdn: not an output folder
    output.refuse_nested_out(tmp_path / "patches/mine", REPO_ROOT)
    output.refuse_nested_out(tmp_path / "build/tree/mine", REPO_ROOT)
    (tmp_path / "manifests").mkdir()
    (tmp_path / output.LOCK).write_text("{}")
    output.refuse_nested_out(tmp_path / "build/out", REPO_ROOT)  # build/ itself is not an output tree
    output.refuse_nested_out(tmp_path, REPO_ROOT)
    with pytest.raises(UsageError):
        output.refuse_nested_out(tmp_path / "build/tree/mine", REPO_ROOT)


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_out_is_refused_by_name(value, base_args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for flags in ([], ["--check"], ["--summary"], ["--dry-run"]):
        result = _invoke((base_args if flags != ["--summary"] else []) + ["--out", value] + flags)
        assert result.exit_code == 2, result.output
        error, hint = _error_lines(result.stderr)
        assert f"--out {value!r} names no folder" in error and "--out ." in hint
    assert not (tmp_path / "patches").exists() and not (tmp_path / "build").exists()


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: ") and "did not write" in line]


def test_files_left_in_the_trees_are_named_in_one_warning_line(base_args, tmp_path):
    root = tmp_path / "out"
    args = base_args + ["--out", str(root)]
    first = _invoke(args)
    assert first.exit_code == 0 and _warnings(first.stderr) == []
    again = _invoke(args)  # our own trees replaced: no warning
    assert again.exit_code == 0 and _warnings(again.stderr) == []
    # beside megatron/ (an output set of an --out inside the tree, notes): --check warns only
    left = ["build/tree/base/notes.txt"] + [f"build/tree/patched/patches/latest/f{i}" for i in range(6)]
    for rel in left:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("mine\n")
    (root / "build/tree/patched/megatron/core/__pycache__").mkdir()  # Python's, not named
    (root / "build/tree/patched/megatron/core/__pycache__/x.cpython-312.pyc").write_bytes(b"\0")
    checked = _invoke(args + ["--check"])
    assert checked.exit_code == 0, checked.output  # not a mismatch: a warning
    assert len(_warnings(checked.stderr)) == 1
    assert "a plain run replaces build/tree/base and build/tree/patched and so deletes 7 files" in checked.stderr
    assert all((root / rel).exists() for rel in left)  # --check deletes nothing
    # inside megatron/ it is a mismatch too (the tree digest), and named in the warning as well
    left.append("build/tree/patched/megatron/core/mine.py")
    (root / left[-1]).write_text("mine\n")
    checked = _invoke(args + ["--check"])
    assert checked.exit_code == 8 and "megatron/core/mine.py (extra)" in checked.stderr
    assert "deletes 8 files" in _warnings(checked.stderr)[0]
    result = _invoke(args)
    assert result.exit_code == 0, result.output
    (line,) = _warnings(result.stderr)
    shown = sorted(left)[:5]
    assert line == (f"warning: replacing build/tree/base and build/tree/patched deletes 8 files in {root} that the tool "
                    f"did not write: {', '.join(shown)} and 3 more; keep your own files outside build/tree/ "
                    "(it holds generated trees only)")
    assert not any((root / rel).exists() for rel in left)  # the trees are still replaced
    assert result.stdout.count("wrote") >= 9 and "warning" not in result.stdout


def test_a_release_does_not_count_files_of_the_old_lock_as_the_users(builds, tmp_path):
    """A file the old tree had and the new one drops (the patch changed) is the tool's own."""
    root = tmp_path / "out"
    output.write(builds["A"], root)
    extra = root / "build/tree/patched/megatron/core/old_output.py"
    extra.write_text("from an older patch\n")
    lock = output._json_on_disk(root / output.LOCK)
    lock["tree_files"]["patched_changes"]["megatron/core/old_output.py"] = "0" * 16
    (root / output.LOCK).write_bytes(output.canonical_json(lock))
    said = []
    output.write(builds["B"], root, warn=said.append)
    assert said == []
    (root / "build/tree/base/mine.txt").write_text("mine\n")
    output.write(builds["A"], root, warn=said.append)
    assert len(said) == 1 and "deletes 1 file in" in said[0] and "build/tree/base/mine.txt" in said[0]


def test_an_out_inside_the_tools_cache_is_refused_before_any_work(tmp_path):
    """--out in (or at) the cache would put the outputs and their lock into a cached base tree,
    which then fails its digest and is rebuilt (hostile trial: a RecursionError, a corrupted
    cache entry)."""
    from click.testing import CliRunner

    from backport.cli import cli

    cache = tmp_path / "cache"
    entry = cache / "trees" / "2faedbf6f-85bced0ae" / "megatron"
    entry.mkdir(parents=True)
    for out in (entry, cache):
        result = CliRunner().invoke(cli, ["--cache-dir", str(cache), "--out", str(out), "--python", STUB_PYTHON])
        assert result.exit_code == 2, result.output
        assert "lies inside the tool's cache" in result.stderr
        assert sorted(p.name for p in entry.iterdir()) == []  # nothing written, no lock taken there


@pytest.mark.parametrize("flag", ["--bridge", "--upstream", "--mcore-base"])
def test_an_empty_pin_flag_is_refused_not_taken_as_the_recipes_pin(tmp_path, flag):
    from click.testing import CliRunner

    from backport.cli import cli

    result = CliRunner().invoke(cli, [flag, "", "--allow-pin-mismatch", "--out", str(tmp_path / "o"),
                                      "--cache-dir", str(tmp_path / "c"), "--python", STUB_PYTHON])
    assert result.exit_code == 2, result.output
    assert f"{flag} '' names no commit" in result.stderr
