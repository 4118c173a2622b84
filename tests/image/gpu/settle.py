"""Set an older suite run's failures beside a newer run's figures for the same check ids.

    python tests/image/gpu/settle.py OLD/summary.json NEW/summary.json [--match cp4]

For every check id that failed in OLD (optionally only ids matching ``--match``, a regex),
prints a Markdown row: the id, OLD's failing tensors with their worst bound ratio (module and
old-vs-new levels) or normalized RMS (kernel level), and NEW's verdict with the same figures
for those tensors. Written to settle run 1's CP=4 misses (TF32) against a ``tf32x3`` run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def _fig(check: dict) -> str:
    if "worst_bound_ratio" in check:
        return f"{check['worst_bound_ratio']:.3g}"
    if "nrms" in check:
        return f"nRMS {check['nrms']:.2g}"
    return "-"


def rows(old: dict, new: dict, match: str = "") -> list:
    out = ["| check id | old: failing tensors (bound ratio) | new: passed | new: same tensors |",
           "| --- | --- | --- | --- |"]
    for rid, e in old["results"].items():
        if e["passed"] or (match and not re.search(match, rid)):
            continue
        bad = {k: c for k, c in e["checks"].items() if not c.get("passed")}
        n = new["results"].get(rid)
        if n is None:
            verdict, same = "not run", "-"
        else:
            verdict = "yes" if n["passed"] else "**no**"
            same = ", ".join(f"{k} {_fig(n['checks'].get(k, {}))}" for k in bad) or "-"
        out.append(f"| {rid} | {', '.join(f'{k} {_fig(c)}' for k, c in bad.items()) or e.get('error', '-')}"
                   f" | {verdict} | {same} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--match", default="")
    a = ap.parse_args(argv)
    with open(a.old) as f:
        old = json.load(f)
    with open(a.new) as f:
        new = json.load(f)
    print("\n".join(rows(old, new, a.match)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
