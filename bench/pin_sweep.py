#!/usr/bin/env python3
"""Sweep the backport over every Megatron-Bridge pin after ours.

Takes every commit on the Bridge's main branch (first parent) that changed ``.dev.commit``
after the recipe's pin (``pins.megatron_bridge`` of manifests/gdn-chunkwise-cp.yaml), runs
``tools/backport --bridge <commit> --no-import-check`` on each, offline from the local mirrors,
into a scratch ``--out`` per commit (never the repo's own patches/ or manifests/lock.json), and
writes the table as JSON + Markdown (default results/pins/sweep.{json,md}).

Per row: Bridge commit and date, MCore base (its ``.dev.commit``), commits before upstream (or
after it, when the base contains it), verdict (``patch written`` with every verification check
passed, ``refused at step X``, ``native``, or ``refused: <error>``), exit code, the upstream
hunks' dispositions at that base, the native rows' fix statuses, seconds.

    .venv/bin/python bench/pin_sweep.py [--mlm PATH] [--bridge-repo PATH] [--out DIR] [--cache-dir DIR]
"""

from __future__ import annotations


import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from backport.errors import FeatureNative  # noqa: E402  (the native exit code, one source of truth)

MLM = "/work/.mirror/NVIDIA+Megatron-LM/repo"
BRIDGE = "/work/.mirror/NVIDIA-NeMo+Megatron-Bridge/repo"
RECIPE = ROOT / "manifests" / "gdn-chunkwise-cp.yaml"
STEP = re.compile(r"^error: (?:recipe )?step ([a-z0-9-]+)\b", re.M)
FIX = re.compile(r"(?:: |; )([a-z0-9-]+): (needed|already present|not applicable) \(")


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def bridge_commits(bridge_repo: str, pin: str, branch: str = "main") -> list[tuple[str, str]]:
    """(SHA, committer date ISO) of the first-parent commits of ``branch`` after ``pin`` that
    changed ``.dev.commit``, oldest first."""
    out = git(bridge_repo, "log", "--first-parent", "--reverse", "--format=%H %cI", f"{pin}..{branch}",
              "--", ".dev.commit")
    return [tuple(line.split(" ", 1)) for line in out.splitlines() if line.strip()]


def distance(mlm: str, base: str, upstream: str) -> tuple[str, int]:
    """("before", n) when base precedes upstream by n commits, ("contains", n) when base has
    upstream and n commits after it, ("unrelated", 0) otherwise."""
    def anc(a, d):
        return subprocess.run(["git", "-C", mlm, "merge-base", "--is-ancestor", a, d]).returncode == 0
    if git(mlm, "rev-parse", base).strip() == git(mlm, "rev-parse", upstream).strip():
        return "contains", 0
    if anc(base, upstream):
        return "before", int(git(mlm, "rev-list", "--count", f"{base}..{upstream}"))
    if anc(upstream, base):
        return "contains", int(git(mlm, "rev-list", "--count", f"{upstream}..{base}"))
    return "unrelated", 0


def run_one(py: str, sha: str, day: str, mlm: str, bridge_repo: str, cache: str, recipe: Path = RECIPE) -> dict:
    out = tempfile.mkdtemp(prefix="pin-sweep-out-")
    cmd = [py, str(ROOT / "tools/backport"), "--bridge", sha, "--recipe", str(recipe), "--no-import-check", "--no-trees",
           "--megatron-lm", mlm, "--megatron-bridge", bridge_repo, "--cache-dir", cache, "--out", out,
           "--date", day]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = round(time.perf_counter() - t0, 1)
    row = {"exit": p.returncode, "seconds": seconds}
    manifest_path = Path(out) / "patches" / "latest" / "manifest.json"
    if p.returncode == 0 and manifest_path.is_file():
        m = json.loads(manifest_path.read_text())
        checks = m["verification"]
        ok = all(c["ok"] for c in checks if c["check"] != "imports")
        row["verdict"] = "patch written" if ok else "patch written, a check failed"
        row["patch"] = {k: m["patch"][k] for k in ("name", "sha256", "files", "hunks", "added", "removed")}
        row["checks"] = {c["check"]: ("ok" if c["ok"] else "SKIPPED") for c in checks}
        report = m.get("retarget") or {}
        row["steps"] = {s["id"]: s["status"] for s in report.get("steps", [])}
        counts: dict = {}
        for h in report.get("upstream_hunks", []):
            counts[h["status"]] = counts.get(h["status"], 0) + 1
        row["hunks"] = dict(sorted(counts.items()))
        row["adapted_but_verbatim_here"] = sorted(h["id"] for h in report.get("upstream_hunks", [])
                                                  if "applies verbatim at this base" in h["detail"])
        row["not_as_recipe"] = {s["id"]: f"{s['status']}: {s['detail']}" for s in report.get("steps", [])
                                if s["status"].startswith("already")}
    elif p.returncode == FeatureNative.exit_code:
        row["verdict"] = "native"
        row["fixes"] = dict(FIX.findall(p.stderr))
    else:
        step = STEP.search(p.stderr)
        first = next((ln[len("error: "):] for ln in p.stderr.splitlines() if ln.startswith("error: ")), p.stderr[-300:])
        row["verdict"] = f"refused at step {step.group(1)}" if step else f"refused (exit {p.returncode})"
        row["error"] = first[:400]
    shutil.rmtree(out, ignore_errors=True)
    return row


def markdown(data: dict) -> str:
    lines = [f"# Pin sweep: the backport onto every Megatron-Bridge pin after {data['pin'][:12]}", "",
             f"Generated by `bench/pin_sweep.py` on {data['date_utc']} (`tools/backport --bridge <commit> "
             "--no-import-check`, offline from the local mirrors, a scratch --out per commit). Upstream "
             f"`{data['upstream'][:12]}`. Seconds are wall time on a loaded 2-core machine.", "",
             "| Bridge commit | date | MCore base | commits before upstream | verdict | exit | upstream hunks at this base | notes | s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["rows"]:
        where, n = r["distance"]
        before = str(n) if where == "before" else (f"contains upstream (+{n})" if where == "contains" else where)
        hunks = ", ".join(f"{k} {v}" for k, v in r.get("hunks", {}).items())
        if r["verdict"] == "native":
            notes = "; ".join(f"{k}: {v}" for k, v in r.get("fixes", {}).items())
        elif "error" in r:
            notes = r["error"][:200]
        else:
            notes = "; ".join([f"`{r['patch']['name']}` {r['patch']['files']} files, {r['patch']['hunks']} hunks, "
                               f"checks {', '.join(k for k, v in r['checks'].items() if v == 'ok')} ok"]
                              + [f"{k}: {v}" for k, v in r.get("not_as_recipe", {}).items()]
                              + ([f"{len(r['adapted_but_verbatim_here'])} adapted hunks would apply verbatim here"]
                                 if r.get("adapted_but_verbatim_here") else []))
        lines.append(f"| `{r['bridge'][:12]}` | {r['date'][:10]} | `{r['mcore_base'][:12]}` | {before} | "
                     f"{r['verdict']} | {r['exit']} | {hunks} | {notes.replace('|', '/')} | {r['seconds']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mlm", default=os.environ.get("MEGATRON_LM_REPO", MLM))
    ap.add_argument("--bridge-repo", default=os.environ.get("MEGATRON_BRIDGE_REPO", BRIDGE))
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "pins")
    ap.add_argument("--cache-dir", default=None, help="backport cache (default: the tool's own)")
    ap.add_argument("--python", default=str(ROOT / ".venv/bin/python"))
    ap.add_argument("--recipe", type=Path, default=RECIPE, help="recipe whose Bridge pin starts the sweep")
    ap.add_argument("--limit", type=int, default=0, help="only the first N commits (0: all)")
    args = ap.parse_args(argv)
    pins = yaml.safe_load(args.recipe.read_text())["pins"]
    cache = args.cache_dir or os.environ.get("GDN_BACKPORT_CACHE") or str(Path.home() / ".cache" / "gdn-backport")
    commits = bridge_commits(args.bridge_repo, pins["megatron_bridge"])
    if args.limit:
        commits = commits[:args.limit]
    rows = []
    for sha, date in commits:
        base = git(args.bridge_repo, "show", f"{sha}:.dev.commit").strip()
        row = {"bridge": sha, "date": date, "mcore_base": base, "distance": distance(args.mlm, base, pins["upstream"])}
        row.update(run_one(args.python, sha, date[:10], args.mlm, args.bridge_repo, cache, args.recipe))
        print(f"{sha[:12]} {date[:10]} base {base[:12]} {row['distance']}: {row['verdict']} ({row['seconds']} s)",
              flush=True)
        rows.append(row)
    data = {"pin": pins["megatron_bridge"], "upstream": pins["upstream"],
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (args.out / "sweep.md").write_text(markdown(data))
    print(f"wrote {args.out / 'sweep.json'} and {args.out / 'sweep.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
