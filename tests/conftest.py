"""Shared by every test folder: what runs twice runs once, and one cache for the integration tests.

The host's pytest leaves out the image suite's tests that passed in the image gate (.ci/run's
``test-gated`` step); ``real_cache`` (below) is the integration tests' session-wide cache.

``GDN_GATE_CASES=PATH`` names the gate's per-test record (``build/ci/gate-report-cases.json``,
written by ``tools/image gate``; :func:`image_pipeline.gate.cases_record`). Every collected test
under ``tests/image`` that the record lists as passed is deselected, and one line says how many.
The record must belong to this checkout's patch (``patches/latest/megatron.patch``) and suite
(``tests/image``), else pytest stops with a usage error naming the mismatch: leaving tests out
on another patch's verdict would hide failures. Unset (a plain ``make test``), nothing changes.
"""

import hashlib
import json
import os
from pathlib import Path

import pytest

ENV = "GDN_GATE_CASES"
TESTS = Path(__file__).resolve().parent
SUITE = TESTS / "image"
PATCH = TESTS.parent / "patches" / "latest" / "megatron.patch"


def _gate_cases(path: Path) -> dict:
    from image_pipeline.gate import suite_digest

    hint = "run the image gate again (`make gate`) or unset GDN_GATE_CASES to run every test here"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        cases = record["cases"]
        if not isinstance(cases, dict) or not all(isinstance(v, dict) for v in cases.values()):
            raise TypeError("'cases' is not a mapping of test id to outcome records")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise pytest.UsageError(f"{ENV}={path}: not a gate cases record ({exc}); {hint}") from None
    if not PATCH.is_file():
        raise pytest.UsageError(f"{ENV}={path}: this checkout has no {PATCH.relative_to(TESTS.parent)} to compare "
                                f"with the gate's; run `make patch`, or unset {ENV} to run every test here")
    patch = hashlib.sha256(PATCH.read_bytes()).hexdigest()
    if record.get("patch_sha256") != patch:
        raise pytest.UsageError(f"{ENV}={path}: the gate ran patch sha256 {str(record.get('patch_sha256'))[:12]}, "
                                f"this checkout's {PATCH.relative_to(TESTS.parent)} is {str(patch)[:12]}; {hint}")
    if record.get("suite_sha256") != suite_digest(SUITE):
        raise pytest.UsageError(f"{ENV}={path}: the gate ran another version of tests/image than this "
                                f"checkout's; {hint}")
    return cases


def pytest_collection_modifyitems(config, items):
    value = os.environ.get(ENV)
    if not value:
        return
    from image_pipeline.gate import suite_case_id

    path = Path(value)
    if not path.is_absolute():
        path = Path(config.invocation_params.dir) / path
    cases = _gate_cases(path)
    keep, done = [], []
    for item in items:
        item_path = Path(str(item.path))
        if SUITE in item_path.parents:
            names = item.nodeid.split("::")[1:]
            if cases.get(suite_case_id(SUITE, item_path, names), {}).get("outcome") == "passed":
                done.append(item)
                continue
        keep.append(item)
    if done:
        config.hook.pytest_deselected(items=done)
        items[:] = keep
    config.get_terminal_writer().line(
        f"{ENV}: left out {len(done)} tests of tests/image that passed in the image gate ({path})")


@pytest.fixture(scope="session")
def real_cache(tmp_path_factory):
    """One backport cache for the integration tests of a session (tests/integration).

    Each module used to clone both real mirrors into a fresh cache of its own (a cold clone of
    Megatron-LM is the slowest part of a build); no integration test asserts anything about a cold
    cache (tests/unit covers cold, warm, offline and damaged caches on small repositories), so the
    session shares one, filled by the first build that needs it. (Here and not in a
    tests/integration/conftest.py: a second module named ``conftest`` on sys.path would shadow
    tests/unit/conftest.py, which unit tests import from.)
    """
    return tmp_path_factory.mktemp("real-mirrors-cache")
