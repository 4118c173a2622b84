"""All-or-nothing outputs: kill the writer (SIGKILL) after each of its steps, then check.

Two real builds of the fake recipe (``A``: 2026-01-02; ``B``: another date, and ``C``: the
same date with a carried patch, so every output keeps its name and changes its bytes) are
written over each other by a forked child process that kills itself after step ``k`` of
:func:`backport.output.write`, for every ``k``. After each kill:

* before recovery: ``manifests/lock.json`` is whole and is the old or the new lock; when it
  is the new one, every output of the new set is in place; when it is the old one, every
  file of the old set is on disk (in place, or moved aside in the journal folder);
* :func:`backport.output.recover` (what the next run does first) leaves exactly the old set
  or exactly the new set, byte for byte (trees included), and no journal;
* a normal write afterwards succeeds and leaves the new set.

A second test kills the recovery itself after each of its steps (from the kill point with
the most to undo), then recovers again. ``GDN_KILL_REPORT=<file>`` writes the table of kill
points (step, what the disk held, what recovery did) as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import traceback
import types
from pathlib import Path

import pytest

from backport import output
from backport.engine import build

from conftest import STUB_PYTHON, recipe_data, write_recipe

pytestmark = pytest.mark.usefixtures("engine_env")
REPO = Path(__file__).resolve().parents[2]

def _spec(tmp: Path, name: str, b) -> Path:
    (tmp / f"{name}.patch").write_bytes(b.patch)
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({"patch": str(tmp / f"{name}.patch"), "manifest": b.manifest,
                                "base_tree": str(b.base_tree)}), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def builds(fake_repos, tmp_path_factory):
    """Builds A (2026-01-02), B (2026-01-03) and C (2026-01-02 with a carried patch)."""
    from backport.options import Options

    from conftest import git_diff, gdn_text

    tmp = tmp_path_factory.mktemp("atomic-builds")
    recipe = write_recipe(tmp / "fake.yaml", recipe_data(fake_repos))
    carry = tmp / "carry.patch"
    carry.write_text(git_diff(tmp / "carry-src", {"megatron/core/ssm/gated_delta_net.py": gdn_text()},
                              {"megatron/core/ssm/gated_delta_net.py": gdn_text() + "\nCARRIED = 1\n"}))

    def make(date, **kw):
        return build(Options(recipe=recipe, megatron_lm=str(fake_repos.mlm), megatron_bridge=str(fake_repos.bridge_repo),
                             cache_dir=tmp / "cache", date=date, python=STUB_PYTHON, **kw))

    out = {"A": make("20260102"), "B": make("20260103"), "C": make("20260102", carry=carry)}
    return tmp, out


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file and symlink under ``root`` except the tool's state folder (lock, journal)."""
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel == output.STATE or rel.startswith(output.STATE + "/"):
            continue
        if path.is_symlink():
            files[rel] = b"->" + os.readlink(path).encode()
        elif path.is_file():
            files[rel] = path.read_bytes()
    return files


def _child(root: Path, spec: Path, mode: str, kill_at: int) -> int:
    """Run ``output.write`` (mode "write") or ``output.recover`` in a forked child that SIGKILLs
    itself right after its step ``kill_at``: it dies as a killed tool would (no ``finally``, no
    atexit). Returns the child's status: 0 (it finished first) or -9. A fork, not a new
    interpreter: the child needs no imports, and the kill points are many."""
    data = json.loads(Path(spec).read_text(encoding="utf-8"))
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            count = [0]

            def hook(_name):
                count[0] += 1
                if count[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

            if mode == "write":
                b = types.SimpleNamespace(patch=Path(data["patch"]).read_bytes(), manifest=data["manifest"],
                                          base_tree=Path(data["base_tree"]))
                output.write(b, root, trees=True, on_step=hook)
            else:
                output.recover(root, on_step=hook)
            code = 0
        except BaseException:  # noqa: BLE001 - reported by the parent's assertion
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    assert rc in (0, -9), f"the {mode} child exited {rc} (its traceback is above)"
    return rc


def _held(root: Path, old: dict, new: dict) -> str:
    """Check the invariant before recovery; return what the disk holds, in words."""
    lock = (root / output.LOCK).read_bytes()
    txn = root / output.TXN
    journal = (txn / "journal.json").exists()
    moved = sorted(p.relative_to(txn / "old").as_posix() for p in (txn / "old").glob("**/*")
                   if p.is_file()) if (txn / "old").exists() else []
    if lock == new[output.LOCK] and lock != old[output.LOCK]:
        assert snapshot(root) == new, "the new lock is in place but the new set is not complete"
        state = "new lock; new set complete in place"
    else:
        assert lock == old[output.LOCK], "the lock on disk is neither the old nor the new one"
        for rel, data in old.items():  # every old file is on disk: in place or moved aside
            here = root / rel
            aside = txn / "old" / rel
            assert (here.is_file() and here.read_bytes() == data) or (aside.is_file() and aside.read_bytes() == data), rel
        placed = sum(1 for rel, data in new.items()
                     if old.get(rel) != data and (root / rel).is_file() and (root / rel).read_bytes() == data)
        state = ("old lock; " + ("journal" if journal else "no journal") + (", staging folder" if txn.exists() else "")
                 + f"; {len(moved)} old files moved aside; {placed} new files in place")
    return state


def _kill_points(tmp, builds, old_name, new_name, report):
    old_b, new_b = builds[old_name], builds[new_name]
    ref = tmp / f"ref-{old_name}{new_name}"
    output.write(old_b, ref)
    old = snapshot(ref)
    names = []
    output.write(new_b, ref, on_step=names.append)
    new = snapshot(ref)
    assert old != new and names
    spec = _spec(tmp, new_name, new_b)
    for k in range(1, len(names) + 1):
        root = tmp / f"k-{old_name}{new_name}-{k}"
        output.write(old_b, root)
        assert _child(root, spec, "write", k) == -9
        held = _held(root, old, new)
        did = output.recover(root)
        after = snapshot(root)
        assert after in (old, new), f"kill after step {k} ({names[k - 1]}): recovery left a mixed set"
        assert not (root / output.TXN).exists()
        result = "old set" if after == old else "new set"
        if k < names.index(f"commit {output.LOCK}") + 1:
            assert result == "old set"
        else:
            assert result == "new set"
        output.write(new_b, root)  # a normal run afterwards succeeds ...
        assert snapshot(root) == new  # ... and leaves the new set
        report.append({"change": f"{old_name}->{new_name}", "kill_after": k, "step": names[k - 1], "on_disk": held,
                       "recovery": did, "result": result})
        shutil.rmtree(root)
    return len(names)


def test_kill_at_every_write_step_leaves_the_old_or_the_new_set(builds):
    tmp, b = builds
    report: list = []
    counts = {f"{o}->{n}": _kill_points(tmp, b, o, n, report) for o, n in (("A", "B"), ("A", "C"))}
    if os.environ.get("GDN_KILL_REPORT"):
        Path(os.environ["GDN_KILL_REPORT"]).write_text(json.dumps({"kill_points": counts, "runs": report}, indent=1))
    assert all(n >= 20 for n in counts.values()), counts  # 7 files + 2 trees staged, 8 targets switched, lock


def test_kill_during_recovery_is_recovered_again(builds):
    """From the last step before the commit (everything switched, the lock still old), the
    roll-back has the most to undo: kill it after each of its steps, then recover again."""
    tmp, b = builds
    ref = tmp / "rec-ref"
    output.write(b["A"], ref)
    old = snapshot(ref)
    names = []
    output.write(b["B"], ref, on_step=names.append)
    last = names.index(f"commit {output.LOCK}")  # kill after the step before the commit
    spec = _spec(tmp, "B", b["B"])
    probe = tmp / "rec-probe"
    output.write(b["A"], probe)
    assert _child(probe, spec, "write", last) == -9
    steps = []
    output.recover(probe, on_step=steps.append)
    # 5 targets existed (remove the new one, move the old one back), 3 were new (remove), journal
    assert snapshot(probe) == old and len(steps) == 5 * 2 + 3 + 1, steps
    for j in range(1, len(steps) + 1):
        root = tmp / f"rec-{j}"
        output.write(b["A"], root)
        assert _child(root, spec, "write", last) == -9
        assert _child(root, spec, "recover", j) == -9
        output.recover(root)
        assert snapshot(root) == old, f"recovery killed after its step {j} ({steps[j - 1]})"
        assert not (root / output.TXN).exists()
        shutil.rmtree(root)


def test_a_failed_switch_rolls_back_and_says_so(builds, tmp_path, monkeypatch):
    """A read-only patches/latest (simulated: root ignores permissions): the rename into it
    fails; the old set is back in place, the lock was never replaced, the error names the
    step and path and ends with a hint."""
    _, b = builds
    output.write(b["A"], tmp_path)
    old = snapshot(tmp_path)
    real = os.rename

    def refuse(src, dst, *a, **k):
        if str(dst).endswith("patches/latest/manifest.md"):
            raise PermissionError(13, "Permission denied", str(dst))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", refuse)
    with pytest.raises(output.WriteError) as exc:
        output.write(b["B"], tmp_path)
    assert exc.value.exit_code == 1
    assert "switching in patches/latest/manifest.md failed: Permission denied" in exc.value.message
    assert "rolled back: the previous outputs are in place" in exc.value.message
    assert "Make " in exc.value.hint and "writable" in exc.value.hint
    assert snapshot(tmp_path) == old
    assert not (tmp_path / output.TXN).exists()
    output.check(b["A"], tmp_path)  # --check still passes against the old outputs


def test_a_full_disk_while_staging_leaves_the_old_set(builds, tmp_path, monkeypatch):
    import errno

    _, b = builds
    output.write(b["A"], tmp_path)
    old = snapshot(tmp_path)

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / output.TXN / "new/build/tree/base"))

    monkeypatch.setattr(output, "copy_tree", full)
    with pytest.raises(output.WriteError) as exc:
        output.write(b["B"], tmp_path)
    assert "staging build/tree/base" in exc.value.message and "No space left on device" in exc.value.message
    assert "nothing was switched in" in exc.value.message
    assert exc.value.hint.startswith("Free space on the file system holding")
    assert snapshot(tmp_path) == old and not (tmp_path / output.TXN).exists()


def test_leftovers_of_older_versions_are_removed(builds, tmp_path):
    _, b = builds
    output.write(b["A"], tmp_path)
    (tmp_path / ".gdn-stage-abc/patches").mkdir(parents=True)
    shutil.copytree(tmp_path / "build/tree/base", tmp_path / "build/tree/base.old")
    (tmp_path / output.TXN / "new").mkdir(parents=True)  # a staging folder without journal
    done = output.recover(tmp_path)
    assert ".gdn-stage-abc" in done and "build/tree/base.old" in done and "unfinished staging" in done
    assert not (tmp_path / ".gdn-stage-abc").exists() and not (tmp_path / "build/tree/base.old").exists()
    assert not (tmp_path / output.TXN).exists()


def test_git_ignores_the_state_folder():
    proc = subprocess.run(["git", "check-ignore", "-q", f"{output.TXN}/new/patches/latest/megatron.patch"], cwd=REPO)
    assert proc.returncode == 0
