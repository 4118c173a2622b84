"""Differential test of the carry applier against ``git apply`` (seeded generator, small corpus).

Each case builds small base files in a throwaway repository (LF and CRLF, with and without a
final newline, one executable), changes them at random (edits, insertions at the file start
and end, deletions of lines, renames and copies with and without edits, mode changes, new
and deleted files, no-newline ends, repeated blocks that make placement ambiguous) and makes
the carried patch with ``git diff`` itself (``-U3``, sometimes ``-U1``/``-U0``, ``-M``/``-C``).
For every case the tool either reproduces ``git apply``'s tree byte for byte (content and
mode) - and its own output patch, applied with ``patch -p1 --fuzz=0`` to the pristine files,
gives that same tree - or it refuses with a named reason. The tally is printed (``-s``).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from backport.carry import REFUSALS, CarryRefused, carry_workspace
from backport.patchfile import make_patch
from backport.errors import ApplyError

from conftest import GIT_ENV

SEEDS = range(60)  # the CI corpus: small on purpose (about 5 s on a loaded 2-core machine)
NAMED = ("already applied", "does not apply with zero fuzz", "belongs in", "the tool does not guess",
         "does not exist in the base tree", "already exists in the base tree")


def _git(cwd: Path, *args: str, input: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, **GIT_ENV, "HOME": "/nonexistent"}
    return subprocess.run(["git", "-c", "core.autocrlf=false", "-c", "core.filemode=true", *args], cwd=cwd,
                          env=env, check=check, capture_output=True, input=input)


def _body(rng: random.Random, name: str, repeat: bool) -> list[str]:
    lines = [f'"""{name} (generated test data)."""', ""]
    for i in range(rng.randint(2, 4)):
        lines += ["", f"def {name}_{i}(x):", f"    y = x + {i}"]
        if repeat:
            lines += ["    y = y * 2", "    y = y * 2", "    return y"]
        lines += ["    return y" if not repeat else "    # end"]
    return lines


def _join(lines: list[str], crlf: bool, final_newline: bool) -> bytes:
    eol = "\r\n" if crlf else "\n"
    text = eol.join(lines) + (eol if final_newline else "")
    return text.encode()


def _make_case(rng: random.Random, root: Path) -> tuple[Path, bytes, list[str]]:
    """Base repo under root/base (committed) and a carried patch; returns (base dir, patch, ops)."""
    base = root / "base"
    base.mkdir()
    _git(base, "init", "-q")
    files = {}
    for k in range(rng.randint(2, 4)):
        name = f"mod{k}"
        spec = {"crlf": rng.random() < 0.25, "final": rng.random() < 0.85, "repeat": rng.random() < 0.2,
                "exec": rng.random() < 0.15}
        lines = _body(rng, name, spec["repeat"])
        path = base / "megatron" / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_join(lines, spec["crlf"], spec["final"]))
        path.chmod(0o755 if spec["exec"] else 0o644)
        files[f"megatron/{name}.py"] = (lines, spec)
    _git(base, "add", "-A")
    _git(base, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "base")

    ops = []
    for rel in sorted(files):
        lines, spec = files[rel]
        lines = list(lines)
        path = base / rel
        op = rng.choice(["edit", "insert-start", "insert-end", "delete-line", "rename", "rename-edit", "copy-edit",
                         "mode", "mode-edit", "no-newline", "add-newline", "delete-file", "keep", "edit-twice"])
        ops.append(op)
        if spec["crlf"] and op != "keep":
            ops.append("crlf")
        if not spec["final"] and op != "keep":
            ops.append("no-final-newline-base")
        if op == "keep":
            continue
        if op == "delete-file":
            path.unlink()
            continue
        if op in ("edit", "rename-edit", "copy-edit", "mode-edit", "edit-twice"):
            for _ in range(2 if op == "edit-twice" else 1):
                i = rng.randrange(2, len(lines))
                lines[i] = lines[i] + f"  # carried {rng.randint(0, 99)}"
        if op == "insert-start":
            lines[:0] = ["# carried header"]
        if op == "insert-end":
            lines += ["", "CARRIED = True"]
        if op == "delete-line":
            del lines[rng.randrange(2, len(lines))]
        final = spec["final"]
        if op == "no-newline":
            final = False
            lines[-1] += "  # no newline now"
        if op == "add-newline":
            final = True
        data = _join(lines, spec["crlf"], final)
        target = path
        if op in ("rename", "rename-edit"):
            target = path.with_name(path.stem + "_renamed.py")
            path.unlink()
        if op == "copy-edit":
            target = path.with_name(path.stem + "_copy.py")
        if op in ("rename", "rename-edit") and op == "rename":
            data = path.read_bytes() if path.exists() else _join(files[rel][0], spec["crlf"], spec["final"])
        target.write_bytes(data)
        if op in ("mode", "mode-edit"):
            target.chmod(0o644 if spec["exec"] else 0o755)
        elif op in ("rename", "rename-edit", "copy-edit"):
            target.chmod(0o755 if spec["exec"] else 0o644)
    if rng.random() < 0.2:
        new = base / "megatron" / "carried_new.py"
        new.write_bytes(_join(["NEW = 1", "OTHER = 2"], rng.random() < 0.3, rng.random() < 0.8))
        ops.append("new-file")
    _git(base, "add", "-A")
    context = rng.choices(["-U3", "-U1", "-U0"], weights=[8, 1, 1])[0]
    detect = rng.choice(["-M", "-C", "--find-copies-harder", "--no-renames"])
    patch = _git(base, "diff", "--cached", "--no-color", "--full-index", context, detect,
                 "--src-prefix=a/", "--dst-prefix=b/").stdout
    _git(base, "reset", "-q", "--hard")  # back to the pristine base
    ops += [context, detect]
    return base, patch, ops


def _tree(root: Path, paths: set[str]) -> dict:
    out = {}
    for p in sorted(paths):
        f = root / p
        out[p] = (f.read_bytes(), "100755" if os.stat(f).st_mode & 0o111 else "100644") if f.is_file() else None
    return out


def _paths(patch: bytes) -> set[str]:
    out = set()
    for line in patch.decode().splitlines():
        if line.startswith("diff --git "):
            a, b = line[len("diff --git "):].split(" ")
            out |= {a[2:], b[2:]}
    return out


def _reason(exc: ApplyError) -> str:
    if isinstance(exc, CarryRefused):
        return exc.reason
    for name in NAMED:
        if name in exc.message:
            return name
    raise AssertionError(f"refusal without a named reason: {exc.message}")


def run_case(seed: int, tmp: Path) -> tuple[str, list[str]]:
    """One generated case: ("compared", ops) or ("refused: <reason>", ops); asserts on any divergence."""
    rng = random.Random(seed)
    base, patch, ops = _make_case(rng, tmp)
    if not patch.strip():
        return "empty-diff", ops
    paths = _paths(patch)
    ref_root = tmp / "git-apply"
    shutil.copytree(base, ref_root, symlinks=True)
    proc = _git(ref_root, "apply", "--whitespace=nowarn", "-", input=patch, check=False)
    carry = tmp / "carry.patch"
    carry.write_bytes(patch)
    try:
        _, ws = carry_workspace(carry, base)
    except ApplyError as exc:
        return f"refused: {_reason(exc)}", ops
    assert proc.returncode == 0, f"seed {seed}: the tool applied what git apply refuses: {proc.stderr.decode()}"
    want = _tree(ref_root, paths)
    have = {}
    for p in paths:
        st = ws.files[p]
        mode = st.mode or ("100755" if (base / p).is_file() and os.stat(base / p).st_mode & 0o111 else "100644")
        have[p] = (st.text.encode(), mode) if st.exists else None
    assert have == want, f"seed {seed} ({ops}): carried tree differs from git apply's"
    # the tool's own output patch reproduces the same tree on the pristine files with GNU patch
    out_patch = make_patch(ws.changed(), "header\n\n", base).encode()
    pristine = tmp / "gnu-patch"
    shutil.copytree(base, pristine, symlinks=True)
    gnu = subprocess.run(["patch", "-p1", "--fuzz=0", "--batch", "--no-backup-if-mismatch", "-r", "-"],
                         cwd=pristine, input=out_patch, capture_output=True)
    assert gnu.returncode == 0, f"seed {seed}: GNU patch rejects the output patch: {gnu.stdout.decode()}"
    assert b"offset" not in gnu.stdout and b"fuzz" not in gnu.stdout
    assert _tree(pristine, paths) == want, f"seed {seed} ({ops}): GNU patch of the output gives other bytes"
    return "compared", ops


def test_generated_carries_equal_git_apply_or_are_refused_by_name(tmp_path, capsys):
    tally, features = Counter(), Counter()
    for seed in SEEDS:
        case = tmp_path / f"case{seed}"
        case.mkdir()
        verdict, ops = run_case(seed, case)
        tally[verdict] += 1
        if verdict == "compared":
            features.update(set(ops))
    with capsys.disabled():
        print(f"\ncarry differential: {len(SEEDS)} generated carries: "
              + ", ".join(f"{k} {v}" for k, v in sorted(tally.items()))
              + "\n  features in the compared cases: " + ", ".join(f"{k} {v}" for k, v in sorted(features.items())))
    for feature in ("rename", "rename-edit", "copy-edit", "mode", "mode-edit", "no-newline", "add-newline",
                    "delete-file", "insert-start", "insert-end", "crlf", "new-file"):
        assert features[feature] > 0, f"the corpus compared no case with {feature}"
    assert tally["compared"] >= len(SEEDS) // 2, tally  # the corpus exercises application, not only refusals
    assert all(k == "compared" or k == "empty-diff" or k.removeprefix("refused: ") in set(REFUSALS) | set(NAMED)
               for k in tally)


@pytest.mark.parametrize("seed", [1000, 1001])
def test_each_case_is_deterministic(tmp_path, seed):
    """Same seed, same verdict and operations (the corpus is reproducible)."""
    a = run_case(seed, _fresh(tmp_path / "a"))
    b = run_case(seed, _fresh(tmp_path / "b"))
    assert a == b


def _fresh(path: Path) -> Path:
    path.mkdir()
    return path
