#!/usr/bin/env python3
"""How the tool's time grows with the size of a carried patch (issue 36: linear carries).

    .venv/bin/python bench/carry_scaling.py [--sizes 250 500 1000 2000] [--tree build/tree/base]
        [--repeat 2] [--out results/pipeline/carry-scaling] [--keep DIR] [--note TEXT]

Generates downstream patches over the real base tree (``build/tree/base``, written by
``make patch``): one inserted comment every 60 lines of each file, ``git diff -U5`` (the shape
of the patch in issue 36), over files taken in a fixed pseudo-random order (sha256 of the path)
until the patch has the wanted number of hunks. The files the recipe changes are left out (a
comment inside the lines an upstream hunk needs is a conflict, exit 6, by design). Each size
is run as ``tools/backport --carry`` next to a plain run, one after the other in one process
set, the import check off in both; the largest size also with the import check on (both
runs). Writes ``<out>.json`` and ``<out>.md``: wall seconds of each ``tools/backport`` process
(the tool time), the engine's own split, the ratio carry / plain, and the load average before
each run (the machine may be shared). Each pair runs ``--repeat`` times (default 2, the
first run of a new carry reads files the page cache may not hold yet); the fastest counts.

This is a benchmark, not a test: it times, so run it on a quiet machine (it takes a few
minutes on 2 cores). Uses the mirrors named by ``MEGATRON_LM_REPO``/``MEGATRON_BRIDGE_REPO``
and the cache of ``GDN_BACKPORT_CACHE`` (warm them with ``make patch`` first).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: the CLI's "time" row: total and per-step seconds (backport.engine.build timings)
TIME_ROW = re.compile(r"time\W+([\d.]+) s \((\w+): sources ([\d.]+), tree ([\d.]+), recipe ([\d.]+), verify ([\d.]+)(?:, write [\d.]+)?\)")
EVERY = 60  # one inserted comment per this many lines
CONTEXT = 5  # git diff -U5
MIN_LINES = 300  # files shorter than this are left out (about 10 hunks a file, as in issue 36)
GIT_ENV = {"GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@localhost", "GIT_COMMITTER_NAME": "bench",
           "GIT_COMMITTER_EMAIL": "bench@localhost", "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
           "TZ": "UTC", "LC_ALL": "C"}


def _git(cwd: Path, *args: str) -> bytes:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")}, **GIT_ENV}
    return subprocess.run(["git", "-c", "core.autocrlf=false", *args], cwd=cwd, env=env, check=True,
                          capture_output=True).stdout


def _insertions(text: str) -> list:
    """0-based line indexes before which a comment goes: every EVERY lines, moved down (at most
    5 lines) where a comment there would not compile (after a backslash continuation)."""
    lines = text.split("\n")
    out = []
    for at in range(EVERY, len(lines) - 1, EVERY):
        for pos in range(at, min(at + 6, len(lines) - 1)):
            if not lines[pos - 1].rstrip().endswith("\\"):
                out.append(pos)
                break
    return out


def _commented(text: str, positions: list, path: str) -> str:
    """``text`` with one comment line inserted before each of ``positions`` (indented like the
    line it precedes)."""
    lines = text.split("\n")
    for k, pos in sorted(enumerate(positions, start=1), key=lambda kv: -kv[1]):
        indent = lines[pos][:len(lines[pos]) - len(lines[pos].lstrip())]
        lines.insert(pos, f"{indent}# downstream note {k} of {path.rsplit('/', 1)[-1]}")
    return "\n".join(lines)


def plan(tree: Path, exclude: set, size: int) -> list:
    """``[(path, positions)]`` whose insertions make ``size`` hunks: files of the tree's
    ``megatron/`` (not in ``exclude``, at least MIN_LINES long) in the order of sha256(path), every one that compiles
    after the insertions, the last one cut to the size."""
    paths = sorted((p.relative_to(tree).as_posix() for p in (tree / "megatron").rglob("*.py")),
                   key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    out, total = [], 0
    for rel in paths:
        if rel in exclude or total >= size:
            continue
        text = (tree / rel).read_text(encoding="utf-8")
        positions = _insertions(text)[:size - total]
        if text.count("\n") < MIN_LINES or not positions:
            continue
        try:
            compile(_commented(text, positions, rel), rel, "exec", dont_inherit=True)
        except SyntaxError:
            continue
        out.append((rel, positions))
        total += len(positions)
    return out


def make_carry(tree: Path, files: list, scratch: Path, dest: Path) -> int:
    """Write the carried patch of ``files`` (from :func:`plan`) to ``dest``; return its hunk count."""
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    _git(scratch, "init", "-q")
    for rel, _ in files:
        (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tree / rel, scratch / rel)
    _git(scratch, "add", "-A")
    _git(scratch, "commit", "-q", "-m", "base")
    for rel, positions in files:
        (scratch / rel).write_text(_commented((tree / rel).read_text(encoding="utf-8"), positions, rel),
                                   encoding="utf-8")
    patch = _git(scratch, "diff", f"-U{CONTEXT}")
    dest.write_bytes(patch)
    return sum(1 for line in patch.splitlines() if line.startswith(b"@@ "))


def run_tool(args: list, label: str) -> dict:
    """One ``tools/backport`` process into a fresh ``--out``: wall seconds, the engine's split, load."""
    out = Path(tempfile.mkdtemp(prefix="gdn-carry-bench-"))
    cmd = [sys.executable, str(REPO / "tools" / "backport"), "--offline", "--no-trees", "--date", "2026-11-30",
           "--out", str(out), *args]
    load = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    m = TIME_ROW.search(proc.stdout)
    rec = {"seconds": round(wall, 2), "rc": proc.returncode, "load_1min_before": round(load[0], 2),
           "steps_s": dict(zip(("engine_total", "sources", "tree", "recipe", "verify"),
                               (float(m.group(k)) for k in (1, 3, 4, 5, 6)))) if m else None}
    print(f"{label}: rc={proc.returncode} {wall:.1f} s (load {load[0]:.2f})", file=sys.stderr)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
    return rec


def _changed_by_recipe(py: str) -> set:
    """Paths the plain run's patch changes (read from a dry plain run's manifest)."""
    out = Path(tempfile.mkdtemp(prefix="gdn-carry-bench-"))
    try:
        subprocess.run([py, str(REPO / "tools" / "backport"), "--offline", "--no-trees", "--no-import-check",
                        "--date", "2026-11-30", "--out", str(out)], cwd=REPO, check=True, capture_output=True)
        manifest = json.loads((out / "patches" / "latest" / "manifest.json").read_text())
        return {f["path"] for f in manifest["files"]}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _markdown(res: dict) -> str:
    rows = ["| hunks | files | import check | plain s | carry s | carry / plain | carry: recipe s | carry: verify s "
            "| load (1 min) before plain / carry |", "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in res["runs"]:
        cs = r["carry"]["steps_s"] or {}
        rows.append(f"| {r['hunks']} | {r['files']} | {'on' if r['import_check'] else 'off'} | "
                    f"{r['plain']['seconds']:.1f} | {r['carry']['seconds']:.1f} | {r['ratio']:.2f}x | "
                    f"{cs.get('recipe', float('nan')):.1f} | {cs.get('verify', float('nan')):.1f} | "
                    f"{r['plain']['load_1min_before']:.2f} / {r['carry']['load_1min_before']:.2f} |")
    goal = res["goal"]
    return "\n".join([
        "# Carry scaling (issue 36)", "",
        f"`bench/carry_scaling.py`, {res['date_utc']}, {res['cpu_count']} CPUs ({res['host']}), Python "
        f"{res['python_version']}. Each carry: one inserted comment every {EVERY} lines, `git diff -U{CONTEXT}`, "
        "over base-tree files in a fixed order (the recipe's files left out); each carry run is next to a "
        "plain run (`tools/backport --offline --no-trees --out <tmp>`, the same flags without `--carry`). "
        f"Seconds are the wall time of the `tools/backport` process (the tool time), the fastest of "
        f"{res['repeat']} runs of each (plain and carry alternately; every run is in the JSON); recipe/verify are "
        "the engine's own split of that run (verify includes the determinism re-run, which applies the carry "
        "again).", "",
        *rows, "",
        f"Goal: {goal['hunks']} hunks at most {goal['max_ratio_no_import_check']}x plain with the import check "
        f"off (measured {goal['ratio_no_import_check']:.2f}x: {'met' if goal['met_ratio'] else 'NOT met'}), "
        f"under {goal['max_seconds_import_check']} s with it on (measured {goal['seconds_import_check']:.1f} s: "
        f"{'met' if goal['met_seconds'] else 'NOT met'}).", "",
        f"Load: the machine is shared; the 1-minute load average before each run is in the table "
        f"(the run's own process adds about 1). {res.get('note', '')}".rstrip(), ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[250, 500, 1000, 2000], help="hunk counts (default: %(default)s)")
    ap.add_argument("--tree", default=str(REPO / "build" / "tree" / "base"), help="base tree (default: %(default)s)")
    ap.add_argument("--out", default=str(REPO / "results" / "pipeline" / "carry-scaling"),
                    help="output stem: writes STEM.json and STEM.md (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=2,
                    help="runs of each (plain, carry) pair; the fastest of each is reported (default: %(default)s)")
    ap.add_argument("--keep", help="write the generated carried patches to this folder too")
    ap.add_argument("--note", default="", help="a sentence for the Markdown (e.g. what else ran meanwhile)")
    args = ap.parse_args(argv)
    tree = Path(args.tree)
    if not (tree / "megatron" / "core" / "ssm" / "gated_delta_net.py").is_file():
        ap.error(f"--tree {tree} holds no megatron/core/ssm/gated_delta_net.py: build the base tree first "
                 "(`make patch`, README) or pass --tree")
    py = sys.executable
    exclude = _changed_by_recipe(py)
    work = Path(tempfile.mkdtemp(prefix="gdn-carry-scaling-"))
    runs = []
    try:
        cases = [(s, False) for s in args.sizes] + [(max(args.sizes), True)]
        for size, import_check in cases:
            files = plan(tree, exclude, size)
            carry = work / f"carry-{size}.patch"
            hunks = make_carry(tree, files, work / "scratch", carry)
            if args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(carry, Path(args.keep) / carry.name)
            check = ["--python", py] if import_check else ["--no-import-check"]
            tag = f"{hunks} hunks, import check {'on' if import_check else 'off'}"
            plains, carrieds = [], []
            for k in range(args.repeat):  # alternately, so that both see the same load
                plains.append(run_tool(check, f"plain ({tag}) #{k + 1}"))
                carrieds.append(run_tool([*check, "--carry", str(carry)], f"carry ({tag}) #{k + 1}"))
                if plains[-1]["rc"] or carrieds[-1]["rc"]:
                    print("a run failed; see its stderr above", file=sys.stderr)
                    return 1
            plain = min(plains, key=lambda r: r["seconds"])
            carried = min(carrieds, key=lambda r: r["seconds"])
            runs.append({"hunks": hunks, "files": len(files), "carry_bytes": carry.stat().st_size,
                         "import_check": import_check, "plain": plain, "carry": carried,
                         "ratio": round(carried["seconds"] / plain["seconds"], 3),
                         "all_seconds": {"plain": [r["seconds"] for r in plains],
                                         "carry": [r["seconds"] for r in carrieds]}})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    big = max(args.sizes)
    off = next(r for r in runs if r["hunks"] >= big * 0.95 and not r["import_check"])
    on = next(r for r in runs if r["import_check"])
    res = {
        "command": "bench/carry_scaling.py --sizes " + " ".join(map(str, args.sizes)),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
        "cpu_count": os.cpu_count(), "python_version": platform.python_version(),
        "carry_shape": f"one comment line every {EVERY} lines, git diff -U{CONTEXT}, recipe files excluded",
        "repeat": args.repeat,
        "runs": runs,
        "goal": {"hunks": off["hunks"], "max_ratio_no_import_check": 4, "ratio_no_import_check": off["ratio"],
                 "met_ratio": off["ratio"] <= 4, "max_seconds_import_check": 60,
                 "seconds_import_check": on["carry"]["seconds"], "met_seconds": on["carry"]["seconds"] < 60},
        "note": args.note,
    }
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    stem.with_suffix(".md").write_text(_markdown(res))
    print(_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
