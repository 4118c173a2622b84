"""CI's split of the test suites around the image gate: nothing runs twice, nothing is lost.

The gate records each in-image test's outcome (:func:`image_pipeline.gate.cases_record`);
tests/conftest.py then deselects, on the host, exactly the suite tests that passed in the gate,
and refuses a record made for another patch or another version of the suite. These tests run
the real conftest in a throwaway project: a suite run as the gate runs it (pytest inside the
suite folder, JUnit XML), then the host run with ``GDN_GATE_CASES``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from image_pipeline.gate import cases_path, cases_record, junit_records, suite_case_id, suite_digest

REPO = Path(__file__).resolve().parents[2]

SUITE_MODULE = '''
import pytest

def test_plain():
    pass

def test_fails_in_the_gate():
    import os
    assert os.environ.get("IN_GATE") != "1"

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    pass

class TestGroup:
    def test_method(self):
        pass
'''
SUB_MODULE = '''
import os, pytest

def test_skipped_in_the_gate():
    if os.environ.get("IN_GATE") == "1":
        pytest.skip("not in the image")
'''


def _project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    suite = root / "tests" / "image"
    (suite / "sub").mkdir(parents=True)
    shutil.copy2(REPO / "tests" / "conftest.py", root / "tests" / "conftest.py")
    (suite / "test_mod.py").write_text(SUITE_MODULE)
    (suite / "sub" / "test_sub.py").write_text(SUB_MODULE)
    (root / "tests" / "unit").mkdir()
    (root / "tests" / "unit" / "test_host.py").write_text("def test_host():\n    pass\n")
    (root / "patches" / "latest").mkdir(parents=True)
    (root / "patches" / "latest" / "megatron.patch").write_text("the patch\n")
    return root


def _pytest(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", **env}
    full.pop("GDN_GATE_CASES", None) if "GDN_GATE_CASES" not in env else None
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd,
                          env=full, capture_output=True, encoding="utf-8")


def _gate(root: Path, tmp_path: Path, patch_sha: str) -> Path:
    """Run the suite as the image does (inside the suite folder) and write its cases record."""
    suite = root / "tests" / "image"
    xml = tmp_path / "junit.xml"
    _pytest(suite, str(suite), f"--junitxml={xml}", "-o", "junit_family=xunit2", IN_GATE="1")
    records = junit_records(xml.read_text())
    report = {"patch_sha256": patch_sha, "image": {"id": "sha256:x"}, "suite": {"part": "cpu"}}
    path = cases_path(tmp_path / "gate-report.json")
    path.write_text(json.dumps(cases_record(report, records, suite_digest(suite))))
    return path


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_case_ids_match_the_gates_junit_ids(tmp_path):
    root = _project(tmp_path)
    suite = root / "tests" / "image"
    xml = tmp_path / "junit.xml"
    _pytest(suite, str(suite), f"--junitxml={xml}", "-o", "junit_family=xunit2")
    from_junit = set(junit_records(xml.read_text()))
    collected = _pytest(root, "--collect-only", "-q", "tests/image").stdout.split()
    from_host = {suite_case_id(suite, root / nodeid.split("::")[0], nodeid.split("::")[1:])
                 for nodeid in collected if "::" in nodeid}
    assert len(from_junit) == 6 and from_host == from_junit


def test_host_run_leaves_out_exactly_what_passed_in_the_gate(tmp_path):
    root = _project(tmp_path)
    cases = _gate(root, tmp_path, _sha(root / "patches" / "latest" / "megatron.patch"))
    run = _pytest(root, "tests", "-v", GDN_GATE_CASES=str(cases))
    assert run.returncode == 0, run.stdout + run.stderr
    ran = {line.split(" ")[0] for line in run.stdout.splitlines() if " PASSED" in line or " FAILED" in line}
    # Failed and skipped in the gate: run again on the host; passed: left out; tests outside
    # tests/image: untouched.
    assert ran == {"tests/image/test_mod.py::test_fails_in_the_gate", "tests/image/sub/test_sub.py::test_skipped_in_the_gate",
                   "tests/unit/test_host.py::test_host"}
    assert "left out 4 tests of tests/image that passed in the image gate" in run.stdout
    assert "4 deselected" in run.stdout


def test_a_record_of_another_patch_is_refused(tmp_path):
    root = _project(tmp_path)
    cases = _gate(root, tmp_path, "0" * 64)
    run = _pytest(root, "tests", GDN_GATE_CASES=str(cases))
    assert run.returncode == 4
    assert "the gate ran patch sha256 000000000000" in run.stderr and "patches/latest/megatron.patch" in run.stderr


def test_a_record_of_another_suite_is_refused(tmp_path):
    root = _project(tmp_path)
    cases = _gate(root, tmp_path, _sha(root / "patches" / "latest" / "megatron.patch"))
    (root / "tests" / "image" / "test_mod.py").write_text(SUITE_MODULE + "\n# edited after the gate\n")
    run = _pytest(root, "tests", GDN_GATE_CASES=str(cases))
    assert run.returncode == 4 and "another version of tests/image" in run.stderr


def test_an_unreadable_record_is_refused_and_unset_changes_nothing(tmp_path):
    root = _project(tmp_path)
    bad = tmp_path / "bad.json"
    for text in ("{not json", '{"cases": []}', '{"cases": {"test_mod::test_plain": "passed"}}'):
        bad.write_text(text)
        run = _pytest(root, "tests", GDN_GATE_CASES=str(bad))
        assert run.returncode == 4 and "not a gate cases record" in run.stderr, (text, run.stderr)
    plain = _pytest(root, "tests")
    assert plain.returncode == 0 and "7 passed" in plain.stdout
