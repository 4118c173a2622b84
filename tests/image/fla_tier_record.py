"""Write the record of one run of the real-FLA CPU tier (``make test-fla-interpret FLA=...``).

Usage: ``python tests/image/fla_tier_record.py RUN_DIR RESULTS_DIR``. ``RUN_DIR`` holds pytest's
``junit.xml`` and the tier's ``tier.json`` (written by ``test_image_fla_interpret`` when
``GDN_FLA_TIER_RECORD`` is set); the record goes to ``RESULTS_DIR/fla<digits>.json``: the FLA,
triton, numpy and torch versions, the patch it ran (``patches/latest/megatron.patch`` sha256),
pytest's counts and seconds, the tier's wall and CPU seconds, and the failed item ids. Exit 1
when a file is missing (nothing written), else 0; the counts say whether the tier passed.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def junit_counts(path: Path) -> dict:
    """``{"tests", "failures", "errors", "skipped", "passed", "seconds"}`` of a pytest junit file."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["seconds"] = round(float(suite.get("time", 0.0)), 1)
    return counts


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: fla_tier_record.py RUN_DIR RESULTS_DIR", file=sys.stderr)
        return 2
    run, results = Path(argv[0]), Path(argv[1])
    junit, tier = run / "junit.xml", run / "tier.json"
    missing = [str(p) for p in (junit, tier) if not p.is_file()]
    if missing:
        print(f"error: fla_tier_record: {', '.join(missing)} missing\nhint: the tier did not run to its end; "
              "read pytest's output above", file=sys.stderr)
        return 1
    import torch

    data = json.loads(tier.read_text(encoding="utf-8"))
    versions = dict(data["versions"], torch=torch.__version__)
    patch = REPO / "patches" / "latest" / "megatron.patch"
    record = {
        "what": "the real-FLA CPU interpreter tier (tests/image -m fla_interpret) on one FLA set",
        "fla": versions["fla"], "versions": versions,
        "patch_sha256": hashlib.sha256(patch.read_bytes()).hexdigest() if patch.is_file() else None,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        "pytest": junit_counts(junit),
        "tier_wall_s": data["wall_s"], "tier_cpu_s": data["cpu_s"], "world_error": data["world_error"],
        "items": len(data["records"]),
        "failed_items": sorted({r["id"] for r in data["records"] if not r["passed"]}),
    }
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"fla{versions['fla'].replace('.', '')}.json"
    out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    c = record["pytest"]
    print(f"fla_tier_record: FLA {versions['fla']} (triton {versions['triton']}, torch {versions['torch']}): "
          f"{c['passed']} passed, {c['failures'] + c['errors']} failed, {c['skipped']} skipped in {c['seconds']} s "
          f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
