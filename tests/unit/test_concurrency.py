"""One run at a time per output folder, a cache that cannot be corrupted, shallow mirrors.

Runs ``tools/backport`` as real processes on the fake repositories (no import check):
two runs in one output folder started 0.5 s apart, two runs sharing an empty cache, a
held lock with and without ``--no-wait``. Cache entries that are incomplete or corrupt are
rebuilt, never reused; a shallow mirror is named as such and never enters the cache.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from backport import output
from backport.errors import SourceError
from backport.sources import is_shallow, open_source
from backport.tree import assemble_base_tree, verify_entry

from conftest import STUB_PYTHON, git, recipe_data, write_recipe

pytestmark = pytest.mark.usefixtures("engine_env")
REPO = Path(__file__).resolve().parents[2]


def _args(fake_repos, recipe: Path, cache: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "tools/backport"), "--recipe", str(recipe), "--megatron-lm", str(fake_repos.mlm),
            "--megatron-bridge", str(fake_repos.bridge_repo), "--cache-dir", str(cache), "--out", str(out),
            "--python", STUB_PYTHON, "--date", "2026-01-02", *extra]


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def _wrote(stdout: str) -> list[str]:
    return [line.split("│")[2].strip() for line in stdout.splitlines() if line.startswith("│ wrote ")]


@pytest.fixture
def recipe(tmp_path, fake_repos) -> Path:
    return write_recipe(tmp_path / "fake.yaml", recipe_data(fake_repos))


# tools/backport with the engine's build slowed by 2 s (inside the output lock), so that two runs
# started half a second apart overlap on any machine, loaded or idle.
SLOW_RUN = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from backport import cli, engine
    real_build = engine.build
    def slow_build(*args, **kwargs):
        time.sleep(2.0)
        return real_build(*args, **kwargs)
    engine.build = slow_build
    cli.main(sys.argv[2:])
""")


def _slow(args: list[str]) -> list[str]:
    return [sys.executable, "-c", SLOW_RUN, str(REPO), *args[2:]]


def test_two_runs_in_one_folder_half_a_second_apart(tmp_path, fake_repos, recipe):
    out, cache = tmp_path / "out", tmp_path / "cache"
    first = _start(_slow(_args(fake_repos, recipe, cache, out)))
    time.sleep(0.5)
    second = _start(_slow(_args(fake_repos, recipe, cache, out)))
    (rc1, out1, err1), (rc2, out2, err2) = _finish(first), _finish(second)
    assert (rc1, rc2) == (0, 0), err1 + err2
    assert "Traceback" not in err1 + err2
    waited = [err for err in (err1, err2) if f"waiting for the output folder {out}" in err]
    assert len(waited) == 1, (err1, err2)  # one run waited, saying for what (and who holds it)
    assert "another run holds it (pid " in waited[0]
    # Both list the same files, and the files on disk are what they list: one complete set.
    assert _wrote(out1) == _wrote(out2) and _wrote(out1)
    stem = f"patches/megatron/20260102-{fake_repos.base[:9]}"
    names = [f"{stem}.patch", f"{stem}.manifest.json", f"{stem}.manifest.md", "patches/latest/megatron.patch",
             "patches/latest/manifest.json", "patches/latest/manifest.md", output.LOCK, *output.TREES]
    assert sorted(_wrote(out1)) == sorted(str(out / rel) for rel in names)
    checked = subprocess.run(_args(fake_repos, recipe, cache, out, "--check", "--offline"), capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert not (out / output.TXN).exists()


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from backport import locks
    with locks.hold(Path(sys.argv[2]), "test"):
        print("held", flush=True)
        sys.stdin.readline()  # released when the test writes a line
""")


def _hold(lock: Path) -> subprocess.Popen:
    """A process holding ``lock`` until a line is written to its stdin."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(REPO), str(lock)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_no_wait_refuses_with_its_own_exit_code_and_waiting_says_what_for(tmp_path, fake_repos, recipe):
    out, cache = tmp_path / "out", tmp_path / "cache"
    holder = _hold(out / output.OUTPUT_LOCK)
    try:
        refused = subprocess.run(_args(fake_repos, recipe, cache, out, "--no-wait"), capture_output=True, text=True)
        assert refused.returncode == 15, refused.stderr
        assert refused.stderr.startswith(f"error: the output folder {out} is in use by another run (pid {holder.pid}")
        assert "\nhint: Wait for that run to finish" in refused.stderr and "--no-wait" in refused.stderr
        assert not (out / "manifests").exists()
        waiting = _start(_args(fake_repos, recipe, cache, out, "--no-trees"))
        first = waiting.stderr.readline()
        assert first.startswith(f"waiting for the output folder {out}: another run holds it (pid {holder.pid}"), first
        assert waiting.poll() is None  # still waiting
    finally:
        holder.communicate("release\n", timeout=30)
    rc, _, err = _finish(waiting)
    assert rc == 0, err
    assert "… got the output folder" in err
    assert (out / output.LOCK).exists()


def test_two_runs_sharing_an_empty_cache(tmp_path, fake_repos, recipe):
    cache = tmp_path / "cache"
    procs = [_start(_args(fake_repos, recipe, cache, tmp_path / f"out{i}", "--no-trees")) for i in (1, 2)]
    results = [_finish(p) for p in procs]
    assert [r[0] for r in results] == [0, 0], [r[2] for r in results]
    entry = cache / "trees" / f"{fake_repos.bridge[:9]}-{fake_repos.base[:9]}"
    assert verify_entry(entry, fake_repos.bridge, fake_repos.base) is None
    record = json.loads((entry / ".complete").read_text())
    assert record["files"] == 9  # 5 MCore files + 3 Bridge-only + 1 overlaid, all present
    assert not list((cache / "trees").glob("*.partial")) and not list(cache.glob("*.partial"))
    one, two = (tmp_path / f"out{i}/patches/latest/megatron.patch" for i in (1, 2))
    assert one.read_bytes() == two.read_bytes()


@pytest.mark.parametrize("damage", ["delete a file", "change a file", "add a file", "no record", "old record",
                                    "truncated record"])
def test_incomplete_or_corrupt_tree_entry_is_rebuilt(tmp_path, fake_repos, damage, capfd):
    cache = tmp_path / "cache"
    mlm = open_source("megatron-lm", str(fake_repos.mlm), cache)
    bridge = open_source("megatron-bridge", str(fake_repos.bridge_repo), cache)
    root = assemble_base_tree(bridge, fake_repos.bridge, mlm, fake_repos.base, cache)
    good = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    utils = root / "megatron/core/utils.py"
    text = utils.read_text()
    {
        "delete a file": lambda: utils.unlink(),
        "change a file": lambda: utils.write_text(text + "# changed\n"),
        "add a file": lambda: (root / "megatron/extra.py").write_text("x = 1\n"),
        "no record": lambda: (root / ".complete").unlink(),
        "old record": lambda: (root / ".complete").write_text(f"bridge {fake_repos.bridge}\nmcore {fake_repos.base}\n"),
        "truncated record": lambda: (root / ".complete").write_text('{"bridge": '),
    }[damage]()
    assert verify_entry(root, fake_repos.bridge, fake_repos.base) is not None
    capfd.readouterr()
    assert assemble_base_tree(bridge, fake_repos.bridge, mlm, fake_repos.base, cache) == root
    assert f"warning: cached base tree {root} is " in capfd.readouterr().err
    assert verify_entry(root, fake_repos.bridge, fake_repos.base) is None
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == good
    assert utils.read_text() == text


def test_a_partial_entry_of_a_killed_run_is_not_used(tmp_path, fake_repos):
    cache = tmp_path / "cache"
    mlm = open_source("megatron-lm", str(fake_repos.mlm), cache)
    bridge = open_source("megatron-bridge", str(fake_repos.bridge_repo), cache)
    entry = cache / "trees" / f"{fake_repos.bridge[:9]}-{fake_repos.base[:9]}"
    (entry.with_name(entry.name + ".partial") / "megatron/core").mkdir(parents=True)  # killed mid-build
    root = assemble_base_tree(bridge, fake_repos.bridge, mlm, fake_repos.base, cache)
    assert verify_entry(root, fake_repos.bridge, fake_repos.base) is None
    assert not entry.with_name(entry.name + ".partial").exists()


@pytest.fixture
def shallow_mlm(tmp_path, fake_repos) -> Path:
    path = tmp_path / "shallow-mlm"
    git(tmp_path, "clone", "-q", "--bare", "--depth", "1", "--no-single-branch", f"file://{fake_repos.mlm}", str(path))
    assert is_shallow(path)
    return path


def test_shallow_mirror_is_named_and_never_cached(tmp_path, shallow_mlm, fake_repos):
    cache = tmp_path / "cache"
    with pytest.raises(SourceError) as exc:
        open_source("megatron-lm", str(shallow_mlm), cache, (fake_repos.base,))
    assert exc.value.exit_code == 3
    assert f"{shallow_mlm} is a shallow clone: fetch its full history" in exc.value.message
    assert "fetch --unshallow" in exc.value.hint
    assert not (cache / "megatron-lm.git").exists() and not (cache / "megatron-lm.git.partial").exists()
    # A cache that is already complete is not fetched into from a shallow mirror either.
    open_source("megatron-lm", str(fake_repos.mlm), cache)
    with pytest.raises(SourceError, match="shallow clone: fetch its full history"):
        open_source("megatron-lm", str(shallow_mlm), cache, ("0123456789abcdef0123456789abcdef01234567",))
    assert not is_shallow(cache / "megatron-lm.git")


def test_shallow_cache_from_an_older_version_is_cloned_again(tmp_path, shallow_mlm, fake_repos):
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copytree(shallow_mlm, cache / "megatron-lm.git", symlinks=True)
    source = open_source("megatron-lm", str(fake_repos.mlm), cache, (fake_repos.base,))
    assert not is_shallow(cache / "megatron-lm.git")
    assert source.count_between(fake_repos.base, fake_repos.upstream) == 3


def test_cli_names_a_shallow_mirror_with_exit_3(tmp_path, shallow_mlm, fake_repos, recipe):
    args = _args(fake_repos, recipe, tmp_path / "cache", tmp_path / "out")
    args[args.index("--megatron-lm") + 1] = str(shallow_mlm)
    proc = subprocess.run(args, capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    assert "shallow clone: fetch its full history" in proc.stderr and "\nhint: " in proc.stderr
    assert "not an ancestor" not in proc.stderr


def test_the_lock_owner_note_gives_the_whole_command_or_says_it_is_cut(monkeypatch):
    """A waiting run shows who holds the lock: the whole command line (hostile trial: argv was
    cut after five arguments without a word), or a cut one that ends in an ellipsis."""
    from backport import locks

    argv = ["tools/backport", "--carry", "/tmp/a.patch", "--no-import-check", "--out", "/tmp/o",
            "--release", "--date", "2026-12-03"]
    monkeypatch.setattr("sys.argv", argv)
    assert locks._command_line() == " ".join(argv)
    monkeypatch.setattr("sys.argv", ["tools/backport", "--carry", "x" * 400])
    cut = locks._command_line()
    assert len(cut) == 300 and cut.endswith("…")
