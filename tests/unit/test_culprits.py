"""Every refusal names its real cause, and a lock never records a skipped check (issue 36).

Each test feeds one fault through the CLI (throwaway repositories of ``conftest``; the import
check runs with the stub interpreter ``STUB_PYTHON`` where a run must run every check) and
asserts the exit code and the culprit named in the first ``error:`` line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from backport import output
from backport.cli import cli

from conftest import STUB_PYTHON, recipe_data, write_recipe

pytestmark = pytest.mark.usefixtures("engine_env")


@pytest.fixture
def args(tmp_path, fake_repos):
    """A full run (every check, the stub interpreter) of the fake recipe into ``tmp_path/out``."""
    recipe = write_recipe(tmp_path / "fake.yaml", recipe_data(fake_repos))
    return ["--recipe", str(recipe), "--megatron-lm", str(fake_repos.mlm), "--megatron-bridge",
            str(fake_repos.bridge_repo), "--cache-dir", str(tmp_path / "cache"), "--python", STUB_PYTHON,
            "--out", str(tmp_path / "out")]


def skip(args: list) -> list:
    """``args`` with the import check skipped (``--no-import-check`` in place of ``--python``)."""
    i = args.index("--python")
    return args[:i] + ["--no-import-check"] + args[i + 2:]


def run(args: list, expect: int):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == expect, result.output
    return result


def first_error(stderr: str) -> str:
    """The first ``error:`` line; the line after it must be the ``hint:``."""
    lines = stderr.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    assert lines[i + 1].startswith("hint: "), stderr
    return lines[i]


def snapshot(path: Path) -> tuple:
    """(bytes, mtime_ns) of ``path``: a rewrite with the same bytes changes the mtime."""
    return path.read_bytes(), path.stat().st_mtime_ns


# --- a lock is a statement that every check ran ------------------------------------------------

def test_a_run_that_skips_a_check_writes_its_outputs_and_leaves_the_lock_alone(args, tmp_path):
    out = tmp_path / "out"
    run(args + ["--date", "2026-01-02"], 0)
    lock = snapshot(out / output.LOCK)
    refused = run(skip(args) + ["--date", "2026-01-03"], 2)  # another date is a new release: refused, as --release is
    assert "excludes --no-import-check (as --release does)" in first_error(refused.stderr)
    assert snapshot(out / output.LOCK) == lock
    result = run(skip(args) + ["--date", "2026-01-02"], 0)
    assert snapshot(out / output.LOCK) == lock
    said = [line for line in result.stderr.splitlines() if line.startswith("lock: ")]
    assert said == [f"lock: {out / output.LOCK} left alone (dated 2026-01-02): this run skipped the import check "
                    "(--no-import-check), and a lock states that every check ran; the other outputs were written. "
                    "Run without --no-import-check to write or check the lock."]
    assert not [line for line in result.stdout.splitlines() if line.startswith(("lock:", "release:"))]
    latest = json.loads((out / "patches/latest/manifest.json").read_text())
    assert output.skipped_checks(latest) == [("imports", "--no-import-check")]  # the outputs were written


def test_a_run_that_skips_a_check_creates_no_lock(args, tmp_path):
    out = tmp_path / "out"
    result = run(skip(args) + ["--date", "2026-01-02"], 0)
    assert not (out / output.LOCK).exists()
    assert (out / "patches/latest/megatron.patch").is_file()
    assert f"lock: {out / output.LOCK} not written (there was none): this run skipped the import check" in result.stderr


def test_release_with_a_skipped_check_is_refused_before_any_work(args, tmp_path):
    result = run(skip(args) + ["--release"], 2)
    assert "--release makes a new lock" in first_error(result.stderr)
    assert "excludes --no-import-check" in first_error(result.stderr)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_check_with_a_skipped_check_on_correct_outputs_exits_0_and_says_what_it_did_not_check(args, tmp_path):
    out = tmp_path / "out"
    run(args, 0)
    before = {p: snapshot(p) for p in out.rglob("*") if p.is_file() and "build" not in p.parts}
    result = run(skip(args) + ["--check"], 0)
    notes = [line for line in result.stderr.splitlines() if line.startswith("check: not checked")]
    assert notes == [f"check: not checked: the import check (--no-import-check); its result was taken as written in "
                     f"{out / 'patches/megatron'}/{json.loads((out / output.LOCK).read_text())['patch']['name'][:-6]}"
                     ".manifest.json (the run that wrote it ran it); everything else is compared as usual"]
    assert "manifests/lock.json: identical" in result.stdout
    assert {p: snapshot(p) for p in before} == before  # --check writes nothing


def test_check_with_a_skipped_check_still_finds_a_difference(args, tmp_path):
    out = tmp_path / "out"
    run(args, 0)
    patch = out / "patches/latest/megatron.patch"
    patch.write_bytes(patch.read_bytes() + b"\n")
    result = run(skip(args) + ["--check"], 8)
    assert "patches/latest/megatron.patch (differs)" in first_error(result.stderr)


def test_check_with_a_skipped_check_of_the_lock_alone_says_the_manifest_digest_is_not_compared(args, tmp_path):
    out = tmp_path / "out"
    run(args, 0)
    for rel in ("patches", "build/tree"):
        shutil.rmtree(out / rel)
    result = run(skip(args) + ["--check"], 0)
    assert "so the lock's manifest_sha256 is not compared" in result.stderr
    assert "manifests/lock.json: identical but manifest_sha256, not compared (--no-import-check)" in result.stdout
    lock = json.loads((out / output.LOCK).read_text())
    lock["patch"]["sha256"] = "0" * 64
    (out / output.LOCK).write_text(json.dumps(lock))
    result = run(skip(args) + ["--check"], 8)
    assert "manifests/lock.json (differs: patch " in first_error(result.stderr)


def test_full_check_of_outputs_a_skipping_run_wrote_names_the_flag(args, tmp_path):
    run(args, 0)
    run(skip(args), 0)
    result = run(args + ["--check"], 8)
    lines = result.stderr.splitlines()
    assert "patches/latest/manifest.json (differs)" in first_error(result.stderr)
    hint = lines[lines.index(first_error(result.stderr)) + 1]
    assert hint.startswith(f"hint: patches/latest in {tmp_path / 'out'} was written by a run with --no-import-check "
                           "(it skipped the import check (--no-import-check)), which left manifests/lock.json alone: "
                           f"run `tools/backport --out {tmp_path / 'out'}` without --no-import-check")
    run(args, 0)  # the hint's own route
    run(args + ["--check"], 0)


def test_a_killed_switch_of_a_skipping_run_rolls_forward_and_never_touches_the_lock(make_options, recipe, tmp_path):
    from backport.engine import build

    out = tmp_path / "out"
    output.write(build(make_options(recipe)), out)
    lock = snapshot(out / output.LOCK)
    skipping = build(make_options(recipe, import_check=False, date="20260103"))

    class Killed(Exception):
        pass

    def kill(step):
        if step == "put new patches/latest/manifest.json in place":
            raise Killed

    with pytest.raises(Killed):
        output.write(skipping, out, on_step=kill)
    assert output.recover(out) == (f"completed the switch of a killed run (it skipped a check, so it left "
                                   f"{output.LOCK} alone)")
    assert json.loads((out / "patches/latest/manifest.json").read_text())["date"] == "2026-01-03"
    assert snapshot(out / output.LOCK) == lock
    assert not (out / output.TXN).exists()


# --- a damaged cache entry is named as damaged, with the command that repairs it ---------------

def _own_pack(entry: Path) -> Path:
    """Repack the cache entry into one pack of its own (a clone from a local path hard-links the
    fixture's packs: damaging those would damage the fixture) and return it."""
    from conftest import git

    git(entry, "repack", "-a", "-d", "-q")
    for extra in (entry / "objects" / "pack").glob("*.bitmap"):
        extra.unlink()
    (pack,) = (entry / "objects" / "pack").glob("*.pack")
    assert pack.stat().st_nlink == 1
    return pack


def _rewrite(path: Path, data: bytes) -> None:
    path.unlink()  # a new file: never write through a hard link
    path.write_bytes(data)


def _truncate_pack(entry: Path) -> str:
    pack = _own_pack(entry)
    _rewrite(pack, pack.read_bytes()[: pack.stat().st_size // 2])
    return f"{pack} ({pack.stat().st_size} bytes) is not the pack its index names (truncated or overwritten"


def _remove_pack(entry: Path) -> str:
    pack = _own_pack(entry)
    pack.unlink()
    return f"{pack.with_suffix('.idx')} has no {pack.name} (a missing pack)"


def _corrupt_index(entry: Path) -> str:
    idx = _own_pack(entry).with_suffix(".idx")
    data = bytearray(idx.read_bytes())
    for i in range(8 + 256 * 4, 8 + 256 * 4 + 8):  # the first object name of the table
        data[i] ^= 0xFF
    _rewrite(idx, bytes(data))
    return f"{idx} fails its own checksum (a corrupt pack index)"


def _half_written_ref(entry: Path) -> str:
    from conftest import git

    ref = git(entry, "symbolic-ref", "HEAD").strip()
    sha = git(entry, "rev-parse", "HEAD").strip()
    (entry / ref).parent.mkdir(parents=True, exist_ok=True)
    (entry / ref).write_text(sha[:7])
    return f"its refs cannot be read (a half-written ref?): `git for-each-ref` said: warning: ignoring broken ref {ref}"


def _half_written_packed_refs(entry: Path) -> str:
    packed = entry / "packed-refs"
    _rewrite(packed, packed.read_bytes()[:30])
    return "its refs cannot be read (a half-written ref?): `git for-each-ref` said: fatal: unterminated line in"


def _ref_to_a_lost_object(entry: Path) -> str:
    (entry / "refs" / "heads" / "lost").write_text("0123456789abcdef0123456789abcdef01234567\n")
    return "refs/heads/lost points at objects the cache lacks (a lost pack or object)"


def _missing_objects_folder(entry: Path) -> str:
    shutil.rmtree(entry / "objects")
    return "it is not a git repository any more: fatal: not a git repository"


def _garbled_config(entry: Path) -> str:
    (entry / "config").write_text("[core\ngarbage\n")
    return "git cannot open it: fatal: bad config line 1 in file"


def _a_file_in_its_place(entry: Path) -> str:
    shutil.rmtree(entry)
    entry.write_text("not a repository\n")
    return "it is a file, not a bare repository folder"


@pytest.mark.parametrize("damage, offline", [
    (_truncate_pack, True), (_truncate_pack, False), (_remove_pack, False), (_corrupt_index, True),
    (_half_written_ref, False), (_half_written_packed_refs, False), (_ref_to_a_lost_object, True),
    (_missing_objects_folder, True), (_garbled_config, False), (_a_file_in_its_place, False)])
def test_a_damaged_cache_entry_is_named_with_the_command_that_repairs_it(args, tmp_path, damage, offline):
    """Hostile trial: a pack truncated to half was reported as "cache lacks N commits ... --offline
    was given"; following that hint fetched a second pack, and later runs used the broken entry
    silently. Every kind of damage is named, every run refuses it, and deleting the entry repairs it."""
    run(args + ["--no-trees"], 0)
    entry = tmp_path / "cache" / "megatron-lm.git"
    said = damage(entry)
    flags = args + ["--no-trees"] + (["--offline"] if offline else [])
    for _again in range(2):  # never used silently afterwards: the next run refuses it too
        result = run(flags, 3)
        error = first_error(result.stderr)
        assert error.startswith(f"error: megatron-lm: the cache {entry} cannot be read (damaged): {said}"), error
        assert "lacks" not in error.split("(damaged)")[0] and "fetching" not in result.stderr
        hint = result.stderr.splitlines()[result.stderr.splitlines().index(error) + 1]
        assert hint.startswith(f"hint: Delete the damaged cache entry (`rm -rf {entry}`;"), hint
        assert ("without --offline" in hint) == offline
    subprocess.run(["rm", "-rf", str(entry)], check=True)  # the hint's own command
    run(args + ["--no-trees"], 0)


def test_a_damaged_local_mirror_is_named_as_the_source_not_the_cache(args, tmp_path, fake_repos):
    from conftest import git

    mirror = tmp_path / "mirror.git"
    git(tmp_path, "clone", "-q", "--bare", "--no-local", str(fake_repos.mlm), str(mirror))
    said = _truncate_pack(mirror)
    result = run(_set(args, "--megatron-lm", str(mirror)), 3)
    error = first_error(result.stderr)
    assert error.startswith(f"error: megatron-lm: the source {mirror} is damaged: "), error
    assert not (tmp_path / "cache" / "megatron-lm.git").exists()
    assert said.split(" (")[0].split("/")[-1] in error


def _set(args: list, flag: str, value: str) -> list:
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


# --- --check names the pin, not the files ------------------------------------------------------

def test_check_with_another_bridge_names_the_pin_and_the_locks_value_first(args, tmp_path, fake_repos):
    """Hostile trial: --check --bridge <other> exited 8 rightly, but first warned that tree files
    were ones "the tool did not write", and its hint spoke of --carry."""
    out = tmp_path / "out"
    run(args, 0)
    lock = json.loads((out / output.LOCK).read_text())
    result = run(args + ["--check", "--bridge", fake_repos.bridge_other[:10]], 8)
    error = first_error(result.stderr)
    assert error == (f"error: the pins of this check differ from {out / output.LOCK}: megatron_bridge "
                     f"{lock['pins']['megatron_bridge'][:12]} in the lock, {fake_repos.bridge_other[:10]} in this check "
                     "(--bridge); every output differs with other pins, so nothing else was compared"), error
    assert "did not write" not in result.stderr and "warning:" not in result.stderr
    assert "opening sources" not in result.stderr  # named before the build, which other pins may fail
    hint = result.stderr.splitlines()[result.stderr.splitlines().index(error) + 1]
    assert hint.startswith("hint: To check with the lock's pins: drop --bridge") and "--carry" not in hint
    run(args + ["--check", "--bridge", lock["pins"]["megatron_bridge"][:8]], 0)  # the lock's own pin, short
    run(args + ["--check"], 0)  # the hint's route


def test_check_of_a_build_on_other_pins_names_them_too(args, tmp_path, fake_repos):
    """The same refusal after the build (pins that only the build resolves: the base that the
    Bridge commit's .dev.commit names)."""
    from backport.errors import CheckMismatch

    run(args + ["--no-trees"], 0)
    lock = json.loads((tmp_path / "out" / output.LOCK).read_text())
    other = dict(lock["pins"], megatron_bridge=fake_repos.bridge_other, mcore_base=fake_repos.i1)
    with pytest.raises(CheckMismatch) as exc:
        output.refuse_other_pins(tmp_path / "out", other)
    assert exc.value.message.startswith(
        f"the pins of this check differ from {tmp_path / 'out' / output.LOCK}: megatron_bridge "
        f"{lock['pins']['megatron_bridge'][:12]} in the lock, {fake_repos.bridge_other[:12]} in this check (--bridge); "
        f"mcore_base {lock['pins']['mcore_base'][:12]} in the lock, {fake_repos.i1[:12]} in this check (the "
        ".dev.commit of that Megatron-Bridge commit)")


def test_check_with_another_upstream_names_it(args, tmp_path, fake_repos):
    run(args + ["--no-trees"], 0)
    result = run(args + ["--check", "--upstream", fake_repos.side], 8)
    assert first_error(result.stderr).startswith(
        f"error: the pins of this check differ from {tmp_path / 'out' / output.LOCK}: upstream "
        f"{fake_repos.upstream[:12]} in the lock, {fake_repos.side[:12]} in this check (--upstream)")
    assert f"hint: To check with the lock's pins: pass --upstream {fake_repos.upstream[:12]} (the lock's)" \
        in result.stderr


def test_an_offline_cache_entry_of_another_repository_names_where_it_was_cloned_from(args, tmp_path, fake_repos):
    run(args + ["--no-trees"], 0)
    cache = tmp_path / "cache"
    shutil.rmtree(cache / "megatron-lm.git")
    shutil.copytree(cache / "megatron-bridge.git", cache / "megatron-lm.git")
    result = run(args + ["--no-trees", "--offline"], 3)
    error = first_error(result.stderr)
    assert error.startswith(f"error: megatron-lm: the cache {cache / 'megatron-lm.git'} lacks "), error
    hint = result.stderr.splitlines()[result.stderr.splitlines().index(error) + 1]
    assert f"the entry was cloned from {fake_repos.bridge_repo}, not from {fake_repos.mlm}" in hint


# --- other refusals fed by hand ------------------------------------------------------------------

@pytest.mark.parametrize("python, printed", [("/bin/true", "nothing"), ("/bin/echo", "'-W ignore -c import ")])
def test_a_python_that_does_not_run_the_probe_is_named_not_a_bug_nor_a_pass(args, python, printed):
    """Hostile trial: --python /bin/true ended in "unexpected IndexError" (exit 1), and
    --python /bin/echo passed the import check."""
    result = run(_set(args, "--python", python) + ["--no-trees"], 7)
    error = first_error(result.stderr)
    assert error.startswith(f"error: verification check 'imports' failed: --python {python} exited 0 but did not run "
                            f"the import probe (it printed {printed}"), error
    assert error.endswith("not the probe's version line): it is not a Python interpreter")


def test_check_of_a_folder_with_nothing_in_it_says_so_before_any_work(args, tmp_path):
    (tmp_path / "out").mkdir()
    result = run(args + ["--check"], 8)
    assert first_error(result.stderr).startswith(f"error: nothing to check in {tmp_path / 'out'}: there is no "
                                                 "manifests/lock.json and no output there")
    assert "opening sources" not in result.stderr  # refused before the build


def test_check_without_the_lock_names_the_lock(args, tmp_path):
    run(args, 0)
    (tmp_path / "out" / output.LOCK).unlink()
    result = run(args + ["--check"], 8)
    error = first_error(result.stderr)
    assert "manifests/lock.json (missing)" in error
    hint = result.stderr.splitlines()[result.stderr.splitlines().index(error) + 1]
    assert hint.startswith(f"hint: manifests/lock.json is missing from {tmp_path / 'out'} (the other outputs are "
                           f"there): write it with a plain run (`tools/backport --out {tmp_path / 'out'}`)")
    assert "git checkout" not in hint  # --out is no git work tree
    (tmp_path / "out" / ".git").mkdir()
    hint = run(args + ["--check"], 8).stderr.splitlines()[-1]
    assert "restore it (`git checkout manifests/lock.json`)" in hint


def test_check_of_a_lock_pinning_an_unknown_bridge_names_the_lock(args, tmp_path, fake_repos):
    run(args + ["--no-trees"], 0)
    path = tmp_path / "out" / output.LOCK
    lock = json.loads(path.read_text())
    lock["pins"]["megatron_bridge"] = "0" * 40
    path.write_text(json.dumps(lock))
    result = run(args + ["--check"], 4)
    assert first_error(result.stderr).startswith(f"error: {path} pins Megatron-Bridge 000000000000, which --check "
                                                 "takes from it: megatron-bridge: ")


def test_a_lock_that_is_a_folder_is_named_not_a_killed_run(args, tmp_path):
    """Hostile trial: it read "recovering <out> from a killed run failed: Is a directory" (exit 1)."""
    out = tmp_path / "out"
    (out / output.LOCK).mkdir(parents=True)
    for extra, code in ((["--no-trees"], 2), (["--check"], 8)):
        result = run(args + extra, code)
        assert first_error(result.stderr) == f"error: {out / output.LOCK} is a folder, not the lock file"
        assert "killed run" not in result.stderr


def test_a_mirror_that_is_not_there_names_where_its_path_came_from(args, tmp_path, monkeypatch):
    i = args.index("--megatron-lm")
    monkeypatch.setenv("MEGATRON_LM_REPO", str(tmp_path / "gone"))
    result = run(args[:i] + args[i + 2:], 3)
    error = first_error(result.stderr)
    assert error.startswith(f"error: megatron-lm: clone of {tmp_path / 'gone'} (MEGATRON_LM_REPO) failed: "), error
    hint = result.stderr.splitlines()[result.stderr.splitlines().index(error) + 1]
    assert hint.startswith(f"hint: {tmp_path / 'gone'} does not exist: point --megatron-lm (or MEGATRON_LM_REPO; "
                           "this value came from MEGATRON_LM_REPO)")
    (tmp_path / "plain-folder").mkdir()
    result = run(_set(args, "--megatron-lm", str(tmp_path / "plain-folder")), 3)
    assert "(--megatron-lm) failed" in first_error(result.stderr)
    assert f"hint: {tmp_path / 'plain-folder'} is not a git repository: " in result.stderr


@pytest.mark.parametrize("journal, problem", [
    ('{"schema": 1}', "no list of targets"),
    ("[1, 2]", "not a JSON object"),
    (None, "target '../../victim.txt' is not an output path"),
])
def test_a_journal_this_tool_never_writes_is_named_and_nothing_is_moved(args, tmp_path, journal, problem):
    """Hostile trial: a journal of the wrong shape ended in "unexpected KeyError" (exit 1), and one
    naming a target outside --out had that file deleted by the roll-back."""
    out = tmp_path / "out"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    txn = out / output.TXN
    txn.mkdir(parents=True)
    if journal is None:
        journal = json.dumps({"schema": 1, "targets": ["../../victim.txt"], "existed": {"../../victim.txt": False},
                              "lock_sha256": "0" * 64})
    (txn / "journal.json").write_text(journal)
    result = run(args + ["--no-trees"], 1)
    assert first_error(result.stderr) == (f"error: the journal {txn / 'journal.json'} of a killed run is not one "
                                          f"this tool writes ({problem}); nothing was moved")
    assert victim.read_text() == "keep me\n"
    shutil.move(txn, tmp_path / "txn-aside")  # the hint's route
    run(args + ["--no-trees"], 0)


def _write_then_edit_the_recipe(args, tmp_path, fake_repos) -> None:
    """Write the outputs and their lock, then edit the recipe (one step's reason) after it."""
    run(args + ["--no-trees"], 0)
    data = recipe_data(fake_repos)
    data["steps"][0]["why"] = "edited after the lock was written"
    write_recipe(tmp_path / "fake.yaml", data)


def test_check_after_a_recipe_edit_names_the_recipe(args, tmp_path, fake_repos):
    _write_then_edit_the_recipe(args, tmp_path, fake_repos)
    result = run(args + ["--check"], 8)
    error = first_error(result.stderr)
    assert "manifests/lock.json (differs: " in error and "recipe changed (sha256)" in error
    hint = result.stderr.splitlines()[result.stderr.splitlines().index(error) + 1]
    assert hint.startswith("hint: The recipe fake.yaml is not the one manifests/lock.json was written with (sha256 ")


def test_a_same_day_lock_change_names_the_input_that_changed(args, tmp_path, fake_repos):
    """Hostile trial: every same-day change blamed "the recipe, the pins or the tool's code"."""
    _write_then_edit_the_recipe(args, tmp_path, fake_repos)
    result = run(args + ["--no-trees"], 0)
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("lock: ")]
    assert ". The recipe changed since the lock was committed (same date)" in line, line


def test_a_damaged_pack_shared_by_hard_link_names_the_mirror_not_only_the_copy(args, tmp_path):
    """Hostile trial (issue 45): a cache cloned from a local mirror shares its packs by hard link;
    damaged in place, it was "only a copy" (delete it), then the next clone said "the source is
    damaged". The message says the pack is shared and sends the user to the mirror first."""
    run(args + ["--no-trees"], 0)
    entry = tmp_path / "cache" / "megatron-lm.git"
    pack = _own_pack(entry)  # a pack of its own (the fixture's stay untouched), then shared:
    os.link(pack, tmp_path / "mirror-copy.pack")  # as git clone of a local mirror leaves it
    data = pack.read_bytes()
    with open(pack, "r+b") as fh:  # damaged in place: every hard link sees it
        fh.truncate(len(data) // 2)
    result = run(args + ["--no-trees", "--offline"], 3)
    error = first_error(result.stderr)
    assert "hard links shared with another repository" in error, error
    hint = result.stderr.splitlines()[result.stderr.splitlines().index(error) + 1]
    assert hint.startswith("hint: Check the mirror first (`git -C ") and f"rm -rf {entry}" in hint, hint
