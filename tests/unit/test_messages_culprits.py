"""Refusals that name the real culprit, and surprises said out loud (issue 45, "the wrong culprit"):
a non-UTF-8 locale with non-ASCII carried file names, a literal ``$HOME`` in the cache path, a cache
inside an output folder's trees, a short SHA too short, a Bridge checkout's ``src/`` paths in a
carry, ``check-lock --lock`` of a file that is no lock, a plain run into a ``--bridge`` output folder,
a new date with ``--no-import-check``, and the time row that leaves out writing the outputs.
(``--check`` of outputs written with ``--no-import-check``: tests/unit/test_culprits.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from backport import output
from backport.cli import cli

from conftest import STUB_PYTHON, git_diff, recipe_data, write_recipe

pytestmark = pytest.mark.usefixtures("engine_env")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def args(tmp_path, fake_repos):
    recipe = write_recipe(tmp_path / "fake.yaml", recipe_data(fake_repos))
    return ["--recipe", str(recipe), "--megatron-lm", str(fake_repos.mlm), "--megatron-bridge",
            str(fake_repos.bridge_repo), "--cache-dir", str(tmp_path / "cache"), "--python", STUB_PYTHON,
            "--out", str(tmp_path / "out"), "--no-trees"]


def _set(args: list, flag: str, value: str) -> list:
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def _error(result) -> tuple[str, str]:
    lines = result.stderr.rstrip("\n").splitlines()
    assert "Traceback" not in result.stderr
    assert lines[-2].startswith("error: ") and lines[-1].startswith("hint: "), result.stderr
    return lines[-2], lines[-1]


def test_a_carry_adding_non_ascii_file_names_works_under_the_c_locale(tmp_path, fake_repos):
    recipe = write_recipe(tmp_path / "fake.yaml", recipe_data(fake_repos))
    carry = tmp_path / "names.patch"
    carry.write_text(git_diff(tmp_path / "src", {"megatron/core/README.md": "x\n"},
                              {"megatron/core/README.md": "x\n", "megatron/core/donnée_ü.py": "VALUE = 'é'\n"}),
                     encoding="utf-8")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""}
    cmd = [sys.executable, str(REPO / "tools/backport"), "--recipe", str(recipe), "--megatron-lm", str(fake_repos.mlm),
           "--megatron-bridge", str(fake_repos.bridge_repo), "--cache-dir", str(tmp_path / "cache"),
           "--python", STUB_PYTHON, "--date", "2026-01-02", "--out", str(tmp_path / "out"), "--carry", str(carry)]
    proc = subprocess.run(cmd, env=env, capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert "+VALUE = 'é'" in (tmp_path / "out/patches/latest/megatron.patch").read_text(encoding="utf-8")
    assert os.path.isfile(os.path.join(os.fsencode(tmp_path / "out/build/tree/patched"),
                                       "megatron/core/donnée_ü.py".encode("utf-8")))


@pytest.mark.parametrize("flag", ["--cache-dir", "--megatron-lm"])
def test_a_literal_dollar_home_in_a_path_is_refused_before_any_work(args, tmp_path, flag):
    value = str(tmp_path / "$HOME" / "c")
    result = CliRunner().invoke(cli, _set(args, flag, value))
    assert result.exit_code == 2, result.output
    error, hint = _error(result)
    assert f"{flag} {value} holds a literal `$`/`~`" in error and "expanded" in hint
    assert not (tmp_path / "cache").exists() and not Path(os.environ["HOME"], "c.git.partial").exists()
    assert not list(Path(os.environ["HOME"]).rglob("*.partial"))


@pytest.mark.parametrize("where", ["build/tree/base/cache", "build/.gdn/cache", "patches/cache"])
def test_a_cache_inside_the_outputs_trees_is_refused(args, tmp_path, where):
    result = CliRunner().invoke(cli, _set(args, "--cache-dir", str(tmp_path / "out" / where)))
    assert result.exit_code == 2, result.output
    error, _hint = _error(result)
    tree = "build/tree" if where.startswith("build/tree") else where.rsplit("/", 1)[0]
    assert f"--cache-dir {tmp_path / 'out' / where} lies inside {tmp_path / 'out' / tree}, a folder" in error
    assert not (tmp_path / "out" / where).exists()


@pytest.mark.parametrize("sha, said", [("abc", "is too short for a commit SHA: a short SHA needs at least 4 hex"),
                                       ("a" * 41, "is too long for a commit SHA"),
                                       ("xyz1234", "is not a commit SHA (not hex)")])
def test_a_short_sha_that_is_too_short_is_called_too_short(args, sha, said):
    result = CliRunner().invoke(cli, args + ["--upstream", sha])
    assert result.exit_code == 4, result.output
    error, _hint = _error(result)
    assert said in error


def test_a_bridge_checkouts_src_paths_in_a_carry_are_told_to_drop_src(args, tmp_path, fake_repos):
    bridge_file = "def bridge():\n    return 'gdn'\n"
    carry = tmp_path / "bridge.patch"
    carry.write_text(git_diff(tmp_path / "src", {"src/megatron/bridge/models/gdn_bridge.py": bridge_file},
                              {"src/megatron/bridge/models/gdn_bridge.py": bridge_file + "X = 1\n"}), encoding="utf-8")
    result = CliRunner().invoke(cli, args + ["--carry", str(carry)])
    assert result.exit_code == 6, result.output
    error, hint = _error(result)
    assert "src/megatron/bridge/models/gdn_bridge.py has the path of a Megatron-Bridge checkout" in error
    assert hint.startswith("hint: Drop `src/`")


def test_check_lock_of_a_file_that_is_no_lock_names_the_file_not_pypi(tmp_path, monkeypatch):
    from image_pipeline import lock
    from image_pipeline.errors import InputError

    monkeypatch.setattr(lock, "_pip", lambda *a, **k: pytest.fail("pip ran on a file that is no lock"))
    wrong = tmp_path / "notes.txt"
    wrong.write_text("just some notes\nnumpy>=1\n", encoding="utf-8")
    target = lock.target_for("cuda", "0.4.2")
    with pytest.raises(InputError) as exc:
        lock.check_locks([(wrong, target)])
    assert f"{wrong} is not a requirements lock" in exc.value.message and "PyPI" not in exc.value.hint


def test_a_plain_run_into_a_bridge_output_folder_says_it_goes_back_to_the_recipes_pins(args, tmp_path, fake_repos):
    out = tmp_path / "out"
    (out / "manifests").mkdir(parents=True)
    (out / output.LOCK).write_text(json.dumps({"date": "2026-01-02", "pins": {
        "megatron_bridge": "b" * 40, "mcore_base": fake_repos.i1, "bridge_dev_commit": fake_repos.i1}}))
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert (f"warning: {out / output.LOCK} pins Megatron-Bridge bbbbbbbbbbbb, MCore base {fake_repos.i1[:12]} "
            "(written with --bridge); this run has no --bridge and goes back to the recipe's pins") in result.stderr
    assert "run with --bridge bbbbbbbbbbbb." in result.stderr


def test_a_new_date_with_no_import_check_is_refused_as_release_is(args, tmp_path):
    i = args.index("--python")
    skip = args[:i] + ["--no-import-check"] + args[i + 2:]
    assert CliRunner().invoke(cli, args + ["--date", "2026-01-02"]).exit_code == 0
    result = CliRunner().invoke(cli, skip + ["--date", "2026-02-03"])
    assert result.exit_code == 2, result.output
    error, _hint = _error(result)
    assert "--date dates this run 2026-02-03" in error and "excludes --no-import-check (as --release does)" in error
    same = CliRunner().invoke(cli, skip + ["--date", "2026-01-02"])
    assert same.exit_code == 0, same.output


def test_the_time_row_includes_writing_the_outputs(args):
    result = CliRunner().invoke(cli, args + ["--date", "2026-01-02"])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if line.lstrip("│ ").startswith("time"))
    assert ", write " in row, row


def test_a_cache_under_a_regular_file_names_that_file(args, tmp_path):
    (tmp_path / "afile").write_text("", encoding="utf-8")
    result = CliRunner().invoke(cli, _set(args, "--cache-dir", str(tmp_path / "afile" / "cache")))
    assert result.exit_code == 1, result.output
    error, hint = _error(result)
    assert error.endswith(f": Not a directory: {tmp_path / 'afile'}"), error
    assert hint.startswith(f"hint: {tmp_path / 'afile'} is a file where a folder is needed"), hint
