"""Differential test of the carry applier against ``git apply`` (seeded generator, small corpus).

Each case builds small base files in a throwaway repository (LF and CRLF, with and without a
final newline, some executable), changes them at random (edits, insertions at the file start
and end, deletions of lines, renames and copies with and without edits, mode changes, new
and deleted files, no-newline ends, repeated blocks that make placement ambiguous) and makes
the carried patch in one of the dialects of :data:`DIALECTS` (``git diff`` itself with
``-U3``, sometimes ``-U1``/``-U0``, ``-M``/``-C``; sections without a ``diff --git`` line;
GNU ``diff -ruN``; the whole carry saved with CRLF; non-ASCII file names quoted by git or
written in UTF-8; ``git format-patch`` mail). For every case the tool either reproduces
``git apply``'s tree byte for byte (content and mode, every file of the tree) - and its own
output patch passes ``git apply --check`` on the pristine files without a word on stderr
and, applied with ``patch -p1 --fuzz=0``, gives that same tree - or it refuses with a named
reason. The tally per dialect is printed (``-s``).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from backport.carry import REFUSALS, CarryRefused, carry_workspace
from backport.patchfile import make_patch
from backport.errors import ApplyError

from conftest import GIT_ENV

#: How the carried patch of a case is written (case ``seed`` uses ``DIALECTS[seed % 7]``).
DIALECTS = ("git", "no-diff-git", "diff-ruN", "crlf-carry", "quoted-names", "utf8-names", "format-patch")
SEEDS = range(70)  # the CI corpus: small on purpose (10 cases per dialect, well under a minute on 2 cores)
NAMED = ("line endings differ", "already applied", "does not apply with zero fuzz", "belongs in",
         "the tool does not guess", "does not exist in the base tree", "already exists in the base tree")


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


def _make_case(rng: random.Random, root: Path, dialect: str = "git") -> tuple[Path, bytes, list[str]]:
    """Base repo under root/base (committed) and a carried patch in ``dialect``; returns
    (base dir, patch, ops)."""
    base = root / "base"
    base.mkdir()
    _git(base, "init", "-q")
    files = {}
    for k in range(rng.randint(2, 4)):
        name = f"mod{k}"
        spec = {"crlf": rng.random() < 0.25, "final": rng.random() < 0.85, "repeat": rng.random() < 0.2,
                "exec": rng.random() < 0.2}
        lines = _body(rng, name, spec["repeat"])
        stem = f"{name}_été" if dialect in ("quoted-names", "utf8-names") and k % 2 == 0 else name
        path = base / "megatron" / f"{stem}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_join(lines, spec["crlf"], spec["final"]))
        path.chmod(0o755 if spec["exec"] else 0o644)
        files[f"megatron/{stem}.py"] = (lines, spec)
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
        if spec["exec"] and op != "keep":
            ops.append("exec")
        if not rel.isascii() and op != "keep":
            ops.append("non-ascii-name")
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
    patch = _dialect_patch(dialect, base, root, context, detect)
    _git(base, "reset", "-q", "--hard")  # back to the pristine base
    _git(base, "clean", "-qfdx")
    ops += [context, detect]
    return base, patch, ops


def _dialect_patch(dialect: str, base: Path, root: Path, context: str, detect: str) -> bytes:
    """The staged change of ``base`` as a carried patch written in ``dialect``."""
    diff = ["diff", "--cached", "--no-color", "--full-index", context, detect, "--src-prefix=a/", "--dst-prefix=b/"]
    quote = ["-c", f"core.quotepath={'true' if dialect == 'quoted-names' else 'false'}"]
    if dialect == "format-patch":  # mail headers, a --- stat block, and the "-- " signature trailer
        _git(base, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m",
             "carry: downstream change\n\nA body line\n--- a/not/a/header.py\nand another.")
        patch = _git(base, *quote, "format-patch", "-1", "--stdout", "--full-index", context, detect).stdout
        _git(base, "reset", "-q", "--soft", "HEAD~1")
        assert patch.startswith(b"From ") and b"\n-- \n" in patch and b"\n---\n" in patch
        return patch
    if dialect == "diff-ruN":  # GNU diff of two directories: no git lines, -N creations/deletions
        new, old = root / "b", root / "a"
        shutil.copytree(base, new, ignore=shutil.ignore_patterns(".git"))
        _git(base, "stash", "-q")
        shutil.copytree(base, old, ignore=shutil.ignore_patterns(".git"))
        _git(base, "stash", "pop", "-q")
        proc = subprocess.run(["diff", "-ruN", context, "a", "b"], cwd=root, capture_output=True,
                              env={"TZ": "UTC", "LC_ALL": "C", "PATH": os.environ["PATH"]})
        assert proc.returncode in (0, 1), proc.stderr
        shutil.rmtree(new)
        shutil.rmtree(old)
        return proc.stdout
    patch = _git(base, *quote, *diff).stdout
    if dialect == "no-diff-git":  # plain sections: drop diff --git and index where nothing else needs them
        out = []
        for section in re.split(rb"(?m)^(?=diff --git )", patch):
            head = section.split(b"\n@@ ", 1)[0].split(b"\n")
            if len(head) >= 4 and head[1].startswith(b"index ") and head[2].startswith(b"--- a/"):
                section = b"\n".join(head[2:]) + section[len(b"\n".join(head)):]
            out.append(section)
        return b"".join(out)
    if dialect == "crlf-carry":  # a Windows editor saved the whole carry
        return patch.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
    return patch


def _tree(root: Path, paths: set[str]) -> dict:
    out = {}
    for p in sorted(paths):
        f = root / p
        out[p] = (f.read_bytes(), "100755" if os.stat(f).st_mode & 0o111 else "100644") if f.is_file() else None
    return out


def _paths(*roots: Path) -> set[str]:
    """Every file under the roots (tree-relative), .git left out."""
    return {f.relative_to(r).as_posix() for r in roots for f in r.rglob("*") if ".git" not in f.parts and f.is_file()}


def _reason(exc: ApplyError) -> str:
    if isinstance(exc, CarryRefused):
        return exc.reason
    for name in NAMED:
        if name in exc.message:
            return name
    raise AssertionError(f"refusal without a named reason: {exc.message}")


def run_case(seed: int, tmp: Path) -> tuple[str, list[str]]:
    """One generated case: ("compared", ops) or ("refused: <reason>", ops); asserts on any divergence.

    The dialect is ``DIALECTS[seed % len(DIALECTS)]`` and is the first of ``ops``."""
    rng = random.Random(seed)
    dialect = DIALECTS[seed % len(DIALECTS)]
    base, patch, ops = _make_case(rng, tmp, dialect)
    ops.insert(0, dialect)
    if not patch.strip():
        return "empty-diff", ops
    ref_root = tmp / "git-apply"
    shutil.copytree(base, ref_root, symlinks=True)
    proc = _git(ref_root, "apply", "--whitespace=nowarn", "-", input=patch, check=False)
    paths = _paths(base, ref_root)
    carry = tmp / "carry.patch"
    carry.write_bytes(patch)
    try:
        _, ws = carry_workspace(carry, base)
    except ApplyError as exc:
        return f"refused: {_reason(exc)}", ops
    assert proc.returncode == 0, f"seed {seed}: the tool applied what git apply refuses: {proc.stderr.decode()}"
    want = _tree(ref_root, paths)
    have = _tree(base, paths)
    for p in paths & set(ws.files):
        st = ws.files[p]
        mode = st.mode or ("100755" if (base / p).is_file() and os.stat(base / p).st_mode & 0o111 else "100644")
        have[p] = (st.text.encode(), mode) if st.exists else None
    assert have == want, f"seed {seed} ({ops}): carried tree differs from git apply's"
    # the tool's own output patch: git apply --check on the pristine files is silent (modes
    # and names as git reads them; CRLF content is the user's whitespace), and GNU patch gives the same tree
    out_patch = make_patch(ws.changed(), "header\n\n", base).encode()
    pristine = tmp / "gnu-patch"
    shutil.copytree(base, pristine, symlinks=True)
    check = _git(pristine, "apply", "--check", "--whitespace=nowarn", "-", input=out_patch, check=False)
    assert check.returncode == 0 and check.stderr == b"", f"seed {seed} ({ops}): {check.stderr.decode()}"
    gnu = subprocess.run(["patch", "-p1", "--fuzz=0", "--batch", "--no-backup-if-mismatch", "-r", "-"],
                         cwd=pristine, input=out_patch, capture_output=True)
    assert gnu.returncode == 0, f"seed {seed}: GNU patch rejects the output patch: {gnu.stdout.decode()}"
    assert b"offset" not in gnu.stdout and b"fuzz" not in gnu.stdout
    assert _tree(pristine, paths) == want, f"seed {seed} ({ops}): GNU patch of the output gives other bytes"
    return "compared", ops


def _refused(counts: Counter) -> int:
    return sum(v for k, v in counts.items() if k.startswith("refused"))


def test_generated_carries_equal_git_apply_or_are_refused_by_name(tmp_path, capsys):
    tally, features, per_dialect = Counter(), Counter(), {d: Counter() for d in DIALECTS}
    for seed in SEEDS:
        case = tmp_path / f"case{seed}"
        case.mkdir()
        verdict, ops = run_case(seed, case)
        tally[verdict] += 1
        per_dialect[ops[0]][verdict] += 1
        if verdict == "compared":
            features.update(set(ops))
    with capsys.disabled():
        print(f"\ncarry differential: {len(SEEDS)} generated carries: "
              + ", ".join(f"{k} {v}" for k, v in sorted(tally.items()))
              + "\n  per dialect (compared with git apply / refused by name):\n"
              + "".join(f"    {d}: compared {c['compared']}, refused {_refused(c)}"
                        + "".join(f"; {k} {v}" for k, v in sorted(c.items()) if k != "compared") + "\n"
                        for d, c in per_dialect.items())
              + "  features in the compared cases: " + ", ".join(f"{k} {v}" for k, v in sorted(features.items())))
    for feature in ("rename", "rename-edit", "copy-edit", "mode", "mode-edit", "no-newline", "add-newline",
                    "delete-file", "insert-start", "insert-end", "crlf", "new-file", "exec", "non-ascii-name"):
        assert features[feature] > 0, f"the corpus compared no case with {feature}"
    for dialect, counts in per_dialect.items():
        if dialect != "crlf-carry":  # CRLF against LF files: refused by name (GNU patch refuses it too)
            assert counts["compared"] > 0, f"the corpus compared no case in dialect {dialect}: {counts}"
    assert per_dialect["crlf-carry"]["refused: line endings differ"] > 0, per_dialect["crlf-carry"]
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
