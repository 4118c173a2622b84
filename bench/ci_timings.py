"""CI timing: how long `bash .ci/run` takes, per step and per test, on this machine.

Owns results/pipeline/ci-timings.{json,md}. Three commands:

* ``record``: clone this repository's HEAD into a scratch folder (a clean clone: uncommitted
  changes are not in it), run ``CI=true bash .ci/run`` there with a fresh backport cache, and
  write the figures of that run (``--out``, default results/pipeline/). Exit status: .ci/run's.
* ``write REPORTS``: the same figures from a finished run's report folder (``build/ci``).
* ``table REPORTS``: print the step table of a finished run (stdout).

Figures: ``steps`` are the rows of ``build/ci/steps.tsv`` (seconds, wall clock; the image chain,
``dockerd``, ``base`` and ``gate``, overlaps ``test-host``, so steps do not add up to the total),
``test`` is ``test-host + test-gated`` (the README's test suites outside the image), and
``slowest_tests`` the 25 slowest test cases across every JUnit XML of the run, the gate's
in-image suite included (``gate::`` ids).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from image_pipeline.gate import junit_records  # noqa: E402

#: Step names the issue's table reads, in .ci/run's order.
STEP_ORDER = ("venv", "cuda-lock", "check-patch", "patch", "dockerd", "base", "gate", "test-host",
              "wait-gate", "test-gated", "test")


def read_steps(reports: Path) -> dict:
    """``{step: {"seconds": int, "status": str}}`` from ``reports/steps.tsv`` (malformed rows skipped)."""
    steps = {}
    path = reports / "steps.tsv"
    if not path.is_file():
        raise SystemExit(f"error: {path} is missing or not a file; run `bash .ci/run` first (it writes the step table)")
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) != 3 or not parts[1].strip().isdigit():
            continue
        steps[parts[0]] = {"seconds": int(parts[1]), "status": parts[2]}
    return steps


def _junit(xml: Path) -> dict:
    """The JUnit file's records, or {} with a warning when it is unreadable (a run cut short)."""
    try:
        return junit_records(xml.read_text(encoding="utf-8", errors="replace"))
    except Exception as exc:  # noqa: BLE001 - a truncated file from a killed run: say so, go on
        print(f"warning: {xml} is unreadable ({exc}); its tests are left out of the figures", file=sys.stderr)
        return {}


def _gate_cases(reports: Path) -> dict:
    path = reports / "gate-report-cases.json"
    try:
        cases = json.loads(path.read_text(encoding="utf-8")).get("cases", {}) if path.is_file() else {}
    except (OSError, ValueError, AttributeError) as exc:
        print(f"warning: {path} is unreadable ({exc}); the gate's tests are left out of the figures", file=sys.stderr)
        return {}
    if not isinstance(cases, dict):
        print(f"warning: {path}: 'cases' is not a mapping of test id to outcome; the gate's tests are left out of "
              "the figures (run the gate again: `make gate`)", file=sys.stderr)
        return {}
    # A case the figures can use: an outcome (text) and its seconds (a number).
    good = {k: v for k, v in cases.items() if isinstance(v, dict) and isinstance(v.get("outcome"), str)
            and isinstance(v.get("seconds", 0.0), (int, float)) and not isinstance(v.get("seconds"), bool)}
    if len(good) != len(cases):
        print(f"warning: {path}: left out {len(cases) - len(good)} cases without a text outcome and numeric seconds "
              f"(e.g. {next(k for k in cases if k not in good)!r}); run the gate again (`make gate`)", file=sys.stderr)
    return good


def suite_records(reports: Path) -> dict:
    """``{suite: {test id: {"outcome", "seconds"}}}``: each ``junit-<suite>.xml`` of the run, and
    the gate's in-image suite as ``gate`` (ids prefixed ``gate::``), each file read once."""
    out = {xml.stem[len("junit-"):]: _junit(xml) for xml in sorted(reports.glob("junit-*.xml"))}
    gate = _gate_cases(reports)
    if gate:
        out["gate"] = {f"gate::{tid}": case for tid, case in gate.items()}
    return out


def slowest_tests(records: dict, top: int = 25) -> list:
    """``[[test id, seconds], ...]``, the ``top`` slowest across :func:`suite_records`."""
    seen = [(tid, case.get("seconds", 0.0)) for suite in records.values() for tid, case in suite.items()]
    seen.sort(key=lambda item: (-item[1], item[0]))
    return [[tid, round(s, 1)] for tid, s in seen[:top]]


def counts(records: dict) -> dict:
    """Passed/skipped/failed/error test cases per suite of :func:`suite_records`."""
    out = {}
    for suite, cases in records.items():
        outcomes = [c.get("outcome") for c in cases.values()]
        out[suite] = {k: outcomes.count(k) for k in ("passed", "skipped", "failed", "error")}
    return out


def figures(reports: Path, commit: str, total_s: int, cores: int) -> dict:
    """The ci-timings.json record of one finished run (see the module docstring)."""
    rows = read_steps(reports)
    records = suite_records(reports)
    steps = {name: rows[name]["seconds"] for name in STEP_ORDER if name in rows}
    if "test-host" in steps or "test-gated" in steps:
        steps["test"] = steps.get("test-host", 0) + steps.get("test-gated", 0)
    for name, row in rows.items():
        steps.setdefault(name, row["seconds"])
    return {"commit": commit, "cores": cores, "total_s": total_s, "steps": steps,
            "status": {name: row["status"] for name, row in rows.items()},
            "tests": counts(records), "slowest_tests": slowest_tests(records)}


def markdown(data: dict) -> str:
    """results/pipeline/ci-timings.md: the total first, then steps and the slowest tests."""
    lines = [f"# CI timing: {data['total_s']} s ({data['total_s'] / 60:.1f} min) for `bash .ci/run`", "",
             f"Clean clone of `{data['commit'][:12]}`, `CI=true bash .ci/run`, {data['cores']} cores, "
             f"fresh backport cache{'; ' + data['note'] if data.get('note') else ''}. The image chain "
             "(dockerd, base, gate) runs beside `test-host`, so steps overlap. Regenerate with "
             "`python3 bench/ci_timings.py record`.", "", "| step | seconds |", "|---|---:|"]
    lines += [f"| {name} | {s} |" for name, s in data["steps"].items()]
    lines += ["", "| suite | passed | skipped | failed |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {c['passed']} | {c['skipped']} | {c['failed'] + c['error']} |"
              for name, c in data["tests"].items()]
    lines += ["", "Slowest tests (seconds):", "", "| test | s |", "|---|---:|"]
    lines += [f"| `{tid}` | {s} |" for tid, s in data["slowest_tests"]]
    return "\n".join(lines) + "\n"


def write(data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "ci-timings.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    (out / "ci-timings.md").write_text(markdown(data), encoding="utf-8")
    print(out / "ci-timings.json")


def record(args) -> int:
    import git

    commit = git.Repo(REPO).head.commit.hexsha
    scratch = Path(tempfile.mkdtemp(prefix="gdn-ci-"))
    clone = scratch / "repo"
    git.Repo.clone_from(str(REPO), str(clone))
    env = {**os.environ, "CI": "true", "GDN_BACKPORT_CACHE": str(scratch / "cache")}
    print(f"ci_timings: running .ci/run in {clone} (commit {commit[:12]})", file=sys.stderr)
    t0 = time.monotonic()
    rc = subprocess.run(["bash", ".ci/run"], cwd=clone, env=env).returncode
    total = int(round(time.monotonic() - t0))
    print(f"ci_timings: .ci/run exited {rc} after {total} s", file=sys.stderr)
    data = figures(clone / "build" / "ci", commit, total, os.cpu_count() or 0)
    data["exit_code"] = rc
    if args.note:
        data["note"] = args.note
    if rc == 0:
        write(data, Path(args.out))
    else:
        print(json.dumps(data, indent=2))
        print(f"error: .ci/run failed (exit {rc}); nothing written to {args.out}. Its reports: {clone}/build/ci",
              file=sys.stderr)
    if not args.keep and rc == 0:
        subprocess.run(["rm", "-rf", str(scratch)], check=False)
    return rc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="clean clone of HEAD, CI=true bash .ci/run, write the figures")
    rec.add_argument("--out", default=str(REPO / "results" / "pipeline"))
    rec.add_argument("--keep", action="store_true", help="keep the scratch clone")
    rec.add_argument("--note", default="", help="one line on the machine (load, Docker cache state)")
    wr = sub.add_parser("write", help="figures from a finished run's reports folder")
    wr.add_argument("reports", type=Path)
    wr.add_argument("--commit", required=True)
    wr.add_argument("--total", type=int, required=True)
    wr.add_argument("--out", default=str(REPO / "results" / "pipeline"))
    tb = sub.add_parser("table", help="print a finished run's step table")
    tb.add_argument("reports", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "record":
        return record(args)
    if args.cmd == "write":
        if args.total < 0:
            parser.error("--total is the run's seconds, 0 or more")
        write(figures(args.reports, args.commit, args.total, os.cpu_count() or 0), Path(args.out))
        return 0
    for name, row in read_steps(args.reports).items():
        print(f"{name}\t{row['seconds']}\t{row['status']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
