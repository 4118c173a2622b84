"""Every exit code in the README's table, triggered through the CLI, and every failure path:
one ``error:`` line naming what failed (step or path), then a ``hint:`` line; no traceback
unless ``--debug`` (it goes to a log file whose path is printed).

Also: inputs validated before any work (``--python``, ``--date`` range, SOURCE_DATE_EPOCH),
a read-only ``patches/latest`` and a full disk (simulated), and a run under ``LC_ALL=C
PYTHONUTF8=0`` with non-ASCII text in the recipe and the carried patch.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from backport import engine, output
from backport.cli import cli

from conftest import STUB_PYTHON, default_signals, git_diff, recipe_data, write_recipe

pytestmark = pytest.mark.usefixtures("engine_env")
REPO = Path(__file__).resolve().parents[2]


def readme_table() -> dict[int, str]:
    """exit code -> meaning, from the README's exit-code table."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| (.+) \|$", text, re.M)}


@pytest.fixture
def base_args(tmp_path, fake_repos):
    recipe = write_recipe(tmp_path / "fake.yaml", recipe_data(fake_repos))
    return ["--recipe", str(recipe), "--megatron-lm", str(fake_repos.mlm), "--megatron-bridge", str(fake_repos.bridge_repo),
            "--cache-dir", str(tmp_path / "cache"), "--python", STUB_PYTHON, "--date", "2026-01-02",
            "--out", str(tmp_path / "out")]


def _recipe(tmp_path, fake_repos, edit) -> str:
    data = recipe_data(fake_repos)
    edit(data)
    return str(write_recipe(tmp_path / "edited.yaml", data))


def _set(args: list, flag: str, value: str) -> list:
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def _invoke(args, **kw):
    result = CliRunner().invoke(cli, args, **kw)
    return result


def assert_error_lines(stderr: str, first: str) -> None:
    """stderr ends with exactly 'error: <one line>' then 'hint: <one line>'; no traceback."""
    lines = stderr.rstrip("\n").splitlines()
    assert "Traceback" not in stderr
    assert lines[-2].startswith("error: ") and first in lines[-2], stderr
    assert lines[-1].startswith("hint: ") and len(lines[-1]) > len("hint: ") + 10, stderr


def _add_forbidden(data):
    data["excluded"] = data["excluded"][1:]
    data["steps"].append({"id": "take-extras", "kind": "upstream_hunks", "hunks": ["megatron/core/extras.py#1"],
                          "why": "brings the forbidden name in"})


def _add_existing(data):
    data["steps"].append({"id": "add-again", "kind": "add_file", "path": "megatron/core/utils.py",
                          "template": "gdn_context_parallel.py", "why": "fails: the file exists"})


def test_the_readme_table_lists_exactly_the_codes_the_tool_uses():
    from backport import errors
    from image_pipeline import errors as image_errors

    table = readme_table()
    classes = {}
    for module in (errors, image_errors):
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, errors.PipelineError):
                classes.setdefault(obj.exit_code, set()).add(obj.__name__)
    assert set(table) == set(classes) | {0, 130, 143}, (sorted(table), sorted(classes))  # 130 ^C, 143 SIGTERM
    assert all(table[code].startswith("image:") for code in range(9, 15))
    for name, code in {"DockerUnavailable": 10, "DiskSpaceError": 11, "GateFailed": 12, "InputError": 13,
                       "BaseImageMissing": 14, "BuildStepFailed": 9}.items():
        assert getattr(image_errors, name).exit_code == code


CASES = {
    # code: (argument change, text in the error line, word(s) in the README row)
    2: (lambda a, t, r: a + ["--dry-run", "--check"], "exclude each other", "usage"),
    3: (lambda a, t, r: a + ["--offline"], "--offline was given", "offline cache lacks a commit"),
    4: (lambda a, t, r: a + ["--upstream", "0123456789ab"], "0123456789ab not found in", "unknown/ambiguous SHA"),
    5: (lambda a, t, r: _set(a, "--recipe", str(t / "missing.yaml")), "cannot read recipe", "recipe"),
    6: (lambda a, t, r: _set(a, "--recipe", _recipe(t, r, _add_existing)), "already exists in the base tree", "apply"),
    7: (lambda a, t, r: _set(a, "--recipe", _recipe(t, r, _add_forbidden)), "verification check 'forbidden_strings'",
        "verification check failed"),
    8: (lambda a, t, r: a + ["--check"], "nothing to check in", "`--check` found differences"),
}


@pytest.mark.parametrize("code", sorted(CASES))
def test_each_documented_code_is_what_the_tool_exits_with(code, base_args, tmp_path, fake_repos):
    change, in_error, in_row = CASES[code]
    (tmp_path / "out").mkdir()
    result = _invoke(change(base_args, tmp_path, fake_repos))
    assert result.exit_code == code, result.output
    assert_error_lines(result.stderr, in_error)
    assert result.stdout == ""
    assert in_row in readme_table()[code]


def test_exit_0_and_the_lock_note(base_args, tmp_path):
    result = _invoke(base_args + ["--no-trees"])
    assert result.exit_code == 0, result.output
    assert result.stderr.count("error:") == 0
    assert "manifests/lock.json written (there was none in --out; dated 2026-01-02, " in result.stdout
    again = _invoke(base_args + ["--no-trees"])
    assert "lock: manifests/lock.json unchanged (dated 2026-01-02, as the previous run wrote it)" in again.stdout
    assert "success" in readme_table()[0]


def test_back_from_a_carry_a_plain_run_says_the_lock_equals_the_committed_one(base_args, tmp_path):
    """--out is a git work tree with the lock committed; a carry run rewrote the lock; the plain run
    that goes back says the lock equals the committed one, not "changed ... commit the lock"."""
    out = tmp_path / "out"
    assert _invoke(base_args + ["--no-trees"]).exit_code == 0
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "commit.gpgsign=false"]
    env = {**os.environ, "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}
    subprocess.run(git + ["init", "-q"], cwd=out, check=True, env=env)
    subprocess.run(git + ["add", output.LOCK], cwd=out, check=True, env=env)
    subprocess.run(git + ["commit", "-qm", "lock"], cwd=out, check=True, env=env)
    lock_path = out / output.LOCK
    carried = json.loads(lock_path.read_text(encoding="utf-8"))
    carried["patch"]["sha256"] = "2" * 64  # what a carry run leaves
    lock_path.write_bytes(output.canonical_json(carried))
    back = _invoke(base_args + ["--no-trees", "--offline"])
    assert back.exit_code == 0, back.output
    assert "lock: manifests/lock.json equals the committed lock (dated 2026-01-02); the previous run's lock " \
           "differed (patch " in back.stdout
    assert "commit the lock" not in back.stdout


def test_plain_run_reproduces_the_lock_date_and_a_release_says_what_changed(base_args, tmp_path):
    assert _invoke(base_args + ["--no-trees"]).exit_code == 0
    lock = (tmp_path / "out" / output.LOCK).read_bytes()
    plain = _set(base_args, "--date", "x")
    plain = plain[:plain.index("--date")] + plain[plain.index("--date") + 2:]
    result = _invoke(plain + ["--no-trees", "--offline"])  # today is not 2026-01-02
    assert result.exit_code == 0, result.output
    assert "date 2026-01-02 from " in result.stderr and "unchanged" in result.stdout
    assert (tmp_path / "out" / output.LOCK).read_bytes() == lock
    released = _invoke(plain + ["--no-trees", "--offline", "--release"], env={"SOURCE_DATE_EPOCH": "1767398400"})
    assert released.exit_code == 0, released.output
    assert "release: manifests/lock.json changed: date 2026-01-02 -> 2026-01-03; patch 20260102-" in released.stdout
    assert "Commit it to publish this release" in released.stdout


def test_a_stale_lock_is_named_field_by_field_by_check_and_by_a_plain_run(base_args, tmp_path):
    """The lock was committed before the recipe/code changed: --check says which fields differ,
    and a plain run (same date) says so instead of calling it a release."""
    assert _invoke(base_args + ["--no-trees"]).exit_code == 0
    lock_path = tmp_path / "out" / output.LOCK
    lock = json.loads(lock_path.read_text(encoding="utf-8"))
    lock["recipe"]["sha256"] = "0" * 64
    lock["patch"]["sha256"] = "1" * 64
    lock_path.write_bytes(output.canonical_json(lock))
    checked = _invoke(base_args + ["--check", "--offline"])
    assert checked.exit_code == 8, checked.output
    assert "manifests/lock.json (differs: patch " in checked.stderr
    assert "(111111111111) -> " in checked.stderr and "recipe changed (sha256)" in checked.stderr
    rerun = _invoke(base_args + ["--no-trees", "--offline"])
    assert rerun.exit_code == 0, rerun.output
    assert "lock: manifests/lock.json changed: patch " in rerun.stdout
    assert "changed since the lock was committed (same date)" in rerun.stdout and "release:" not in rerun.stdout


def test_busy_is_15_and_interrupted_is_130(base_args, tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        from pathlib import Path
        sys.path.insert(0, sys.argv[1])
        from backport import locks
        with locks.hold(Path(sys.argv[2]), "test"):
            print("held", flush=True)
            sys.stdin.readline()
    """), str(REPO), str(tmp_path / "out" / output.OUTPUT_LOCK)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        busy = subprocess.run([sys.executable, str(REPO / "tools/backport"), *base_args, "--no-wait"],
                              capture_output=True, text=True)
        assert busy.returncode == 15
        assert_error_lines(busy.stderr, "is in use by another run")
        assert "--no-wait" in readme_table()[15]
        waiting = subprocess.Popen([sys.executable, str(REPO / "tools/backport"), *base_args],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=default_signals)  # SIGINT handled, even if this run ignores it
        assert waiting.stderr.readline().startswith("waiting for the output folder")
        waiting.send_signal(signal.SIGINT)
        _, err = waiting.communicate(timeout=60)
        assert waiting.returncode == 130
        assert_error_lines(err, "interrupted while waiting for the lock of the output folder")
        assert "interrupted" in readme_table()[130]
    finally:
        holder.communicate("go\n", timeout=30)


# --- exit 1: system failures and unexpected errors --------------------------------------------

def test_read_only_patches_latest_is_one_line_and_the_old_outputs_stay(base_args, tmp_path, monkeypatch):
    assert _invoke(base_args).exit_code == 0
    before = {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file() and ".gdn" not in p.parts}
    real = os.rename

    def read_only(src, dst, *a, **k):  # root ignores chmod, so the refusal is simulated
        if "patches/latest" in str(dst) or "patches/latest" in str(src) and "txn" in str(dst):
            raise OSError(errno.EROFS, "Read-only file system", str(dst))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", read_only)
    result = _invoke(_set(base_args, "--date", "2026-01-03"))
    assert result.exit_code == 1, result.output
    assert_error_lines(result.stderr, "switching in patches/latest/")
    assert "Read-only file system" in result.stderr and "rolled back" in result.stderr
    assert "hint: Make " in result.stderr and "writable" in result.stderr
    after = {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file() and ".gdn" not in p.parts}
    assert after == before  # the lock was not replaced: --check still passes
    monkeypatch.undo()
    assert _invoke(base_args + ["--check", "--offline"]).exit_code == 0


def test_full_disk_is_one_line_with_the_path_and_a_hint(base_args, tmp_path, monkeypatch):
    def full(src, dst):
        raise shutil.Error([(str(src / "megatron/core/utils.py"), str(dst / "megatron/core/utils.py"),
                             "[Errno 28] No space left on device")])

    monkeypatch.setattr(output, "copy_tree", full)
    result = _invoke(base_args)
    assert result.exit_code == 1, result.output
    assert_error_lines(result.stderr, "No space left on device")
    assert "megatron/core/utils.py" in result.stderr and "nothing was switched in" in result.stderr
    assert "hint: Free space on the file system holding" in result.stderr
    assert not (tmp_path / "out" / output.LOCK).exists()


def test_full_disk_in_the_cache_goes_through_the_top_level_handler(base_args, tmp_path, monkeypatch):
    from backport import tree

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "cache/trees/x.partial/megatron"))

    monkeypatch.setattr(tree, "tree_digest", full)
    result = _invoke(base_args)
    assert result.exit_code == 1, result.output
    assert_error_lines(result.stderr, "assembling the base tree failed: No space left on device: ")
    assert "hint: Free space on the file system holding" in result.stderr and "The traceback is in " in result.stderr


def test_unexpected_error_logs_the_traceback_and_debug_prints_it(base_args, tmp_path, monkeypatch):
    def boom(*_a, **_k):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(engine, "build", boom)
    result = _invoke(base_args)
    assert result.exit_code == 1
    assert_error_lines(result.stderr, "failed: unexpected RuntimeError: boom")
    log = Path(re.search(r"The traceback is in (\S+)\.$", result.stderr.splitlines()[-1]).group(1))
    assert "Traceback" in log.read_text() and "RuntimeError: boom" in log.read_text()
    assert log.is_relative_to(tmp_path / "cache")
    for flag in ("--debug", "-v"):
        debug = _invoke(base_args + [flag])
        assert debug.exit_code == 1 and "Traceback" in debug.stderr and "(traceback above)" in debug.stderr


# --- inputs checked before any work ------------------------------------------------------------

@pytest.mark.parametrize("args, env, in_error", [
    (["--python", "/nonexistent/python3"], {}, "--python /nonexistent/python3: no such executable interpreter"),
    (["--python", "no-such-python-xyz"], {}, "--python no-such-python-xyz: no such executable interpreter"),
    (["--date", "1969-12-31"], {}, "--date '1969-12-31' is out of range"),
    (["--date", "10000-01-01"], {}, "--date '10000-01-01' is not YYYY-MM-DD"),
    (["--date", "2026-02-30"], {}, "--date '2026-02-30' is not a day of the calendar"),
    (["--date", "20261301"], {}, "--date '20261301' is not a day of the calendar"),
    (["--date", "0000-01-01"], {}, "--date '0000-01-01' is out of range"),  # was "not YYYY-MM-DD"
    (["--date", "2026-11-30 "], {}, "--date '2026-11-30 ' is not YYYY-MM-DD"),
    ([], {"SOURCE_DATE_EPOCH": "-1"}, "SOURCE_DATE_EPOCH='-1' is out of range"),
    ([], {"SOURCE_DATE_EPOCH": "99999999999999"}, "SOURCE_DATE_EPOCH='99999999999999' is out of range"),
    ([], {"SOURCE_DATE_EPOCH": "1e9"}, "SOURCE_DATE_EPOCH='1e9' is not an integer"),
])
def test_bad_inputs_exit_2_before_any_work(base_args, tmp_path, args, env, in_error):
    base = [a for a in base_args if a != "--no-import-check"] if "--python" in args else base_args
    if env:
        i = base.index("--date")
        base = base[:i] + base[i + 2:]
    for mode in ([], ["--dry-run"], ["--check"]):
        result = _invoke(base + args + mode, env=env)
        assert result.exit_code == 2, result.output
        assert_error_lines(result.stderr, in_error)
        assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


# --- a non-UTF-8 locale ------------------------------------------------------------------------

def test_runs_under_the_c_locale_with_non_ascii_inputs(tmp_path, fake_repos):
    data = recipe_data(fake_repos)
    data["steps"][0]["why"] = "new upstream module, taken whole (café, naïve, 'ü' — ✓)"
    recipe = write_recipe(tmp_path / "fake.yaml", data)
    bridge_file = "def bridge():\n    return 'gdn'\n"
    carry = tmp_path / "ü carry ✓.patch"  # a non-ASCII file name goes into the manifest
    carry.write_text(git_diff(tmp_path / "carry-src", {"megatron/bridge/models/gdn_bridge.py": bridge_file},
                              {"megatron/bridge/models/gdn_bridge.py": bridge_file + "\n# café ✓ résumé\n"}),
                     encoding="utf-8")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""}
    probe = subprocess.run([sys.executable, "-c", "import locale, sys; print(locale.getpreferredencoding(), sys.stdout.encoding)"],
                           env=env, capture_output=True, text=True)
    assert "utf" not in probe.stdout.lower(), probe.stdout  # the locale really is not UTF-8
    args = [sys.executable, str(REPO / "tools/backport"), "--recipe", str(recipe), "--megatron-lm", str(fake_repos.mlm),
            "--megatron-bridge", str(fake_repos.bridge_repo), "--cache-dir", str(tmp_path / "cache"),
            "--python", STUB_PYTHON, "--date", "2026-01-02", "--out", str(tmp_path / "out"), "--carry", str(carry)]
    proc = subprocess.run(args, env=env, capture_output=True)
    assert b"Traceback" not in proc.stderr
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    patch = (tmp_path / "out/patches/latest/megatron.patch").read_bytes().decode("utf-8")
    assert "+# café ✓ résumé" in patch
    assert "café, naïve" in (tmp_path / "out/patches/latest/manifest.md").read_text(encoding="utf-8")
    manifest = json.loads((tmp_path / "out/patches/latest/manifest.json").read_text(encoding="utf-8"))
    assert manifest["carry"]["name"] == "ü carry ✓.patch"
    checked = subprocess.run(args + ["--check", "--offline"], env=env, capture_output=True)
    assert checked.returncode == 0, checked.stderr.decode(errors="replace")
    failed = subprocess.run(args + ["--date", "2026-13-01"], env=env, capture_output=True)
    assert failed.returncode == 2 and b"Traceback" not in failed.stderr


def test_the_users_git_config_does_not_change_the_bytes(tmp_path, fake_repos):
    """diff.noprefix / diff.algorithm in a global config or in GIT_CONFIG_COUNT: same patch."""
    recipe = write_recipe(tmp_path / "fake.yaml", recipe_data(fake_repos))
    cfg = tmp_path / "gitconfig"
    cfg.write_text("[diff]\n\tnoprefix = true\n\talgorithm = histogram\n[core]\n\tautocrlf = true\n",
                   encoding="utf-8")

    def run(cache, extra_env):
        out = tmp_path / f"out-{cache}"
        args = [sys.executable, str(REPO / "tools/backport"), "--recipe", str(recipe), "--megatron-lm",
                str(fake_repos.mlm), "--megatron-bridge", str(fake_repos.bridge_repo), "--cache-dir",
                str(tmp_path / cache), "--python", STUB_PYTHON, "--no-trees", "--date", "2026-01-02", "--out", str(out)]
        proc = subprocess.run(args, env={**os.environ, **extra_env}, capture_output=True)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        return (out / "patches/latest/megatron.patch").read_bytes()

    plain = run("c1", {})
    assert run("c2", {"GIT_CONFIG_GLOBAL": str(cfg)}) == plain
    assert run("c3", {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "diff.algorithm",
                      "GIT_CONFIG_VALUE_0": "patience", "GIT_CONFIG_PARAMETERS": "'diff.noprefix'='true'"}) == plain


@pytest.mark.parametrize("args, in_error", [
    (["--bogus"], "No such option '--bogus'"),
    (["--carry", "/nonexistent/carry.patch"], "Invalid value for '--carry'"),
    (["--cache-dir"], "requires an argument"),
])
def test_click_usage_errors_end_with_a_hint(args, in_error):
    """Errors found by the flag parser itself keep the error:/hint: form (exit 2, stdout empty)."""
    proc = subprocess.run([sys.executable, str(REPO / "tools/backport"), *args], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert_error_lines(proc.stderr, in_error)
    assert "Usage:" not in proc.stderr


@pytest.mark.parametrize("content", ['{"date": "2026-13-45"}', "not json", '{"date": "1969-12-31"}'])
def test_a_corrupt_lock_is_a_usage_error_in_a_plain_run_and_a_release_replaces_it(base_args, tmp_path, content):
    plain = base_args[:base_args.index("--date")] + base_args[base_args.index("--date") + 2:]
    (tmp_path / "out" / "manifests").mkdir(parents=True)
    (tmp_path / "out" / output.LOCK).write_text(content, encoding="utf-8")
    result = _invoke(plain + ["--no-trees"])
    assert result.exit_code == 2, result.output
    assert_error_lines(result.stderr, "is not a lock with a valid date")
    assert "git checkout manifests/lock.json" in result.stderr and "--release" in result.stderr
    checked = _invoke(plain + ["--check"])
    assert checked.exit_code == 8
    released = _invoke(plain + ["--no-trees", "--release"], env={"SOURCE_DATE_EPOCH": "1767398400"})
    assert released.exit_code == 0, released.output
    assert output.lock_date(tmp_path / "out") == "2026-01-03"


def test_sigterm_during_the_import_check_exits_143_and_leaves_no_child(tmp_path, base_args):
    """SIGTERM while the import check's interpreter runs: exit 143 naming the step, and the
    interpreter and the verify folder are gone (VerifyTree is left through its context manager)."""
    import signal
    import time

    hang = tmp_path / "hang-python"
    marker = tmp_path / "hang.pid"
    hang.write_text(f"#!/bin/sh\necho $$ > {marker}\nexec sleep 300\n")
    hang.chmod(0o755)
    args = [a if a != STUB_PYTHON else str(hang) for a in base_args]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, str(REPO / "tools/backport"), *args], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env=env, preexec_fn=default_signals)
    for _ in range(600):
        if marker.exists() and marker.read_text().strip():
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    logs = [p.read_text()[-1500:] for p in tmp_path.glob("cache/logs/*.log")]
    assert proc.returncode == 143, (proc.returncode, err[-300:], logs)
    assert "error: terminated (SIGTERM) while " in err
    child = int(marker.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
    assert not list(tmp_path.glob("gdn-verify-*"))
