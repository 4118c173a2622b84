"""The gate: the image's suite run in a container, its JUnit XML parsed into a verdict, both trees
digested inside the image against the lock, and the JSON report."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import time
import xml.etree.ElementTree as ET
from collections import deque
from pathlib import Path
from typing import Iterable, Optional

from backport import tree_digest as td

from .engine import LOG_TAIL, Line, _quiet
from .errors import GateFailed, TreeDrift


def parse_junit(xml_text: str) -> dict:
    """Counts and failing test ids from pytest's JUnit XML (xunit1 or xunit2)."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as exc:
        raise GateFailed(f"the suite's JUnit XML is unreadable: {exc}") from exc
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing = []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
            failing.append(tid)
        elif "error" in kinds:
            counts["errors"] += 1
            failing.append(tid)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    counts["failing"] = sorted(failing)
    return counts


def gate_verdict(counts: dict, exit_code: int) -> tuple[bool, str]:
    """``(ok, reason)``: refuse any failure or error, and a run with no passed test."""
    if counts["failed"] or counts["errors"]:
        return False, f"{counts['failed']} failed, {counts['errors']} errors"
    if counts["passed"] == 0:
        return False, f"the suite ran no test ({counts['tests']} collected, {counts['skipped']} skipped)"
    if exit_code not in (0,):
        return False, f"pytest exited {exit_code} although the JUnit XML shows no failure"
    return True, f"{counts['passed']} passed, {counts['skipped']} skipped"


def host_has_gpus() -> bool:
    """True when an NVIDIA GPU is visible on the host (nvidia-smi lists one)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, encoding="utf-8", timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def _read_from_container(container, path: str) -> Optional[bytes]:
    import docker

    try:
        bits, _ = container.get_archive(path)
    except docker.errors.NotFound:
        return None
    buf = io.BytesIO(b"".join(bits))
    with tarfile.open(fileobj=buf) as tar:
        member = tar.next()
        if member is None:
            return None
        f = tar.extractfile(member)
        return f.read() if f else None


def junit_cases(xml_text: str) -> dict:
    """``{test id: "passed" | "failed" | "error" | "skipped"}`` from pytest's JUnit XML."""
    return {tid: case["outcome"] for tid, case in junit_records(xml_text).items()}


def junit_records(xml_text: str) -> dict:
    """``{test id: {"outcome": str, "seconds": float}}`` from pytest's JUnit XML, sorted by id.

    The id is JUnit's ``classname::name`` (pytest writes the module path relative to its rootdir,
    dotted, then any class names), which is how :func:`suite_case_id` names a collected item.
    """
    out = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = ("failed" if "failure" in kinds else "error" if "error" in kinds
                   else "skipped" if "skipped" in kinds else "passed")
        try:
            seconds = round(float(case.get("time") or 0.0), 3)
        except ValueError:
            seconds = 0.0
        out[f"{case.get('classname', '')}::{case.get('name', '')}"] = {"outcome": outcome, "seconds": seconds}
    return dict(sorted(out.items()))


def suite_digest(suite_dir: Path) -> str:
    """sha256 over the suite's files (``tests/image``: relative path and bytes of every file but
    caches, in sorted order): the suite a cases file (:func:`cases_record`) was run with."""
    h = hashlib.sha256()
    for path in sorted(p for p in Path(suite_dir).rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"):
        rel = path.relative_to(suite_dir).as_posix()
        h.update(rel.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def suite_case_id(suite_dir: Path, item_path: Path, names: Iterable[str]) -> str:
    """The JUnit id (:func:`junit_records`) the gate gives a test of the suite when pytest runs
    in ``suite_dir`` (the image's /opt/gdn/tests/image): ``mod[.sub].Class::name``.

    ``item_path`` is the test's file, ``names`` its node names after the file (classes, then the
    test with its parameters)."""
    names = list(names)
    module = Path(item_path).relative_to(suite_dir).with_suffix("").as_posix().replace("/", ".")
    return ".".join([module, *names[:-1]]) + "::" + names[-1]


def cases_path(report_path: Path) -> Path:
    """Where the gate writes its per-test record beside ``report_path``: ``<stem>-cases.json``."""
    report_path = Path(report_path)
    return report_path.with_name(report_path.stem + "-cases.json")


def cases_record(report: dict, records: dict, suite_sha256: str) -> dict:
    """The gate's per-test record: what ran in the image, for which patch and which suite.

    ``.ci/run`` hands it to the host's pytest (``GDN_GATE_CASES``, tests/conftest.py), which then
    leaves out every suite test that passed here instead of running it a second time."""
    return {"patch_sha256": report.get("patch_sha256"), "suite_sha256": suite_sha256,
            "image": report.get("image", {}).get("id"), "part": report.get("suite", {}).get("part"),
            "cases": records}


#: Suite modules whose tests the gate report lists one by one under ``checks``.
LISTED_SUITE_MODULES = ("test_image_tree_drift", "test_image_bridge")
#: Trees the gate digests inside the image: lock key -> folder holding megatron/.
IMAGE_TREES = {"base": "/opt/gdn/base", "patched": "/opt/gdn/tree"}


def image_tree_check(client, image_id: str, trees: dict) -> dict:
    """Digest both trees inside the image (its own /opt/gdn/bin/tree_digest.py) and compare
    them with the lock's ``trees`` (:func:`image_pipeline.inputs.read_tree_lock`).

    Returns ``{"base": result, "patched": result}``, each as :func:`backport.tree_digest.check`
    returns it (``ok``, ``sha256``, ``want``, ``files``, ``first_difference``); a tree the
    script could not digest has ``ok`` False and an ``error``.
    """
    import docker

    script = " && ".join(f"python3 /opt/gdn/bin/tree_digest.py {path} --ids" for path in IMAGE_TREES.values())
    try:
        out = client.containers.run(image_id, ["sh", "-c", script], remove=True, network_mode="host",
                                    stderr=True).decode(errors="replace")
        seen = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    except (docker.errors.ContainerError, ValueError) as exc:
        err = str(exc).splitlines()[-1][:300] if str(exc) else type(exc).__name__
        return {which: {"ok": False, "error": f"tree_digest.py failed in the image: {err}"} for which in IMAGE_TREES}
    results = {}
    ids_by_tree = {"base": trees["tree_files"]["base"], "patched": td.patched_ids(trees["tree_files"])}
    for which, got in zip(IMAGE_TREES, seen):
        want = trees[f"{which}_tree_sha256"]
        first = None if got["sha256"] == want else td.first_difference(ids_by_tree[which], got["ids"])
        results[which] = {"ok": got["sha256"] == want, "sha256": got["sha256"], "want": want,
                          "files": got["files"], "where": IMAGE_TREES[which],
                          "first_difference": list(first) if first else None}
    for which in IMAGE_TREES:
        results.setdefault(which, {"ok": False, "error": "tree_digest.py printed no result"})
    return results


def tree_check_failure(check: dict) -> Optional[str]:
    """One line naming the first tree of :func:`image_tree_check` that is not the lock's, else None."""
    for which, result in check.items():
        if result.get("ok"):
            continue
        what = "pristine" if which == "base" else "patched"
        if "error" in result:
            return f"the image's {what} tree: {result['error']}"
        return f"in the image, {td.describe(result, what)} ({result['where']}/megatron)"
    return None


def run_gate(client, image_ref: str, gpus: Optional[bool] = None, on_line: Line = _quiet,
             pytest_args: Iterable[str] = (), timeout_s: int = 3600,
             environment: Optional[dict] = None, trees: Optional[dict] = None) -> dict:
    """Run the image's suite inside ``image_ref``; returns the report (never raises on test failures).

    First the trees: their digests, computed inside the image, must be the lock's ``trees``
    (:func:`image_pipeline.inputs.read_tree_lock`; None skips this check and the report says so); a drift refuses the
    gate without running the suite. ``pytest_args`` are appended to the suite's command line and
    ``environment`` to the container's (tests use both to feed deliberately broken runs).
    """
    import docker

    image = client.images.get(image_ref)
    tree_check = image_tree_check(client, image.id, trees) if trees is not None else None
    drift = tree_check_failure(tree_check) if tree_check else None
    if drift:
        on_line(f"error: [tree-digest] {drift}")
        labels = image.labels or {}
        return {"ok": False, "reason": drift, "tree_check": tree_check,
                "image": {"id": image.id, "tags": sorted(image.tags), "flavour": labels.get("io.gdn.flavour")},
                "checks": _tree_checks(tree_check), "suite": {"part": "not run", "passed": 0, "failed": 0,
                                                              "errors": 0, "skipped": 0, "tests": 0,
                                                              "failing": [], "exit_code": None},
                "log_tail": [f"error: [tree-digest] {drift}"]}
    if tree_check:
        for which, result in tree_check.items():
            on_line(f"==> [tree-digest] {which} tree in the image ({result['where']}): sha256 "
                    f"{result['sha256'][:12]}, {result['files']} files, equals the lock's")
    use_gpus = host_has_gpus() if gpus is None else gpus
    device_requests = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])] if use_gpus else None
    out_dir = "/tmp/gdn-gate"
    t0 = time.monotonic()
    container = client.containers.create(
        image.id, command=["sh", "/opt/gdn/bin/run-suite.sh", out_dir, *pytest_args],
        network_mode="host", device_requests=device_requests, detach=True,
        environment={"PYTHONUNBUFFERED": "1", **(environment or {})})
    tail: deque = deque(maxlen=LOG_TAIL * 2)
    try:
        container.start()
        buf = ""
        for chunk in container.logs(stream=True, follow=True):
            buf += chunk.decode(errors="replace")
            while "\n" in buf:
                line, buf = buf.split("\n", 1)
                tail.append(line)
                on_line(line)
            if time.monotonic() - t0 > timeout_s:
                container.kill()
                break
        if buf:
            tail.append(buf)
            on_line(buf)
        exit_code = int(container.wait(timeout=60).get("StatusCode", -1))
        junit = _read_from_container(container, f"{out_dir}/junit.xml")
        capability = _read_from_container(container, "/opt/gdn/capability.json")
    finally:
        container.remove(force=True)
    seconds = round(time.monotonic() - t0, 1)
    labels = image.labels or {}
    cap = json.loads(capability) if capability else {}
    cases, records = {}, {}
    if junit is None:
        counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failing": []}
        ok, reason = False, f"the suite wrote no JUnit XML (pytest exited {exit_code})"
    else:
        counts = parse_junit(junit.decode(errors="replace"))
        ok, reason = gate_verdict(counts, exit_code)
        records = junit_records(junit.decode(errors="replace"))
        cases = {tid: case["outcome"] for tid, case in records.items()}
    listed = [{"name": tid, "outcome": outcome} for tid, outcome in cases.items()
              if any(mod in tid for mod in LISTED_SUITE_MODULES)]
    return {
        "ok": ok,
        "reason": reason,
        "tree_check": tree_check if tree_check is not None else "skipped: no lock given",
        "checks": _tree_checks(tree_check) + listed,
        "image": {"id": image.id, "tags": sorted(image.tags), "flavour": labels.get("io.gdn.flavour")},
        "pins": {k[len("io.gdn.pin."):]: v for k, v in sorted(labels.items()) if k.startswith("io.gdn.pin.")},
        "patch_sha256": labels.get("io.gdn.patch.sha256"),
        "manifest_sha256": labels.get("io.gdn.manifest.sha256"),
        "versions": cap.get("versions", {}),
        "python": cap.get("python"),
        "gpus": use_gpus,
        "suite": {"part": "all" if use_gpus else "cpu", "exit_code": exit_code, "seconds": seconds,
                  "extra_args": list(pytest_args), "extra_env": dict(environment or {}), **counts},
        "log_tail": list(tail)[-LOG_TAIL:],
        "cases": records,
    }


def _tree_checks(tree_check: Optional[dict]) -> list:
    if not tree_check:
        return []
    return [{"name": f"tree-digest::{which} ({result.get('where', IMAGE_TREES[which])}) == lock "
                     f"{which}_tree_sha256", "outcome": "passed" if result.get("ok") else "failed"}
            for which, result in tree_check.items()]


def require_gate_ok(report: dict) -> None:
    """Raise :class:`GateFailed` (log tail included) unless the report passed.

    Raises :class:`TreeDrift` (exit 13) when the image's trees are not the lock's.
    """
    if report["ok"]:
        return
    if isinstance(report.get("tree_check"), dict) and tree_check_failure(report["tree_check"]):
        raise TreeDrift(f"image gate refused {report['image']['id'][:19]}: {report['reason']}")
    s = report["suite"]
    lines = [f"image gate refused {report['image']['id'][:19]}: {report['reason']}"]
    if s.get("failing"):
        lines.append("failing: " + ", ".join(s["failing"][:20]))
    lines.append(f"--- last {len(report['log_tail'])} lines of step suite:")
    lines += [f"  | {t}" for t in report["log_tail"]]
    raise GateFailed("\n".join(lines))


def write_json(path: Path, data: dict) -> Path:
    """The one JSON writer: sorted keys, indent 2, trailing newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path
