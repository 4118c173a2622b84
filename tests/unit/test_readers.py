"""Readers of our own outputs refuse a malformed but parseable file with ``error:``/``hint:`` (exit 2),
never a traceback nor totals the patch does not have: ``annotate`` (per-line runs that do not match
the hunks), ``--summary``, ``--check`` reading a lock with fields of the wrong type, and the gate
record reader of ``bench/ci_timings.py``. An excluded upstream hunk given to ``annotate`` is named
as excluded, with the recipe's reason."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from backport import output
from backport.cli import cli, main

pytestmark = pytest.mark.usefixtures("engine_env")
REPO = Path(__file__).resolve().parents[2]


def _run(capsys, *args):
    with pytest.raises(SystemExit) as exc:
        main(list(args))
        raise SystemExit(0)
    cap = capsys.readouterr()
    return exc.value.code or 0, cap.out, cap.err


def _first_hunk(m, pred=lambda h: True):
    return next(h for f in m["files"] for h in f["hunks"] if pred(h))


def _more(m):  # an 8-line hunk totalled as 50 lines: exited 0 with wrong totals
    h = _first_hunk(m, lambda h: h["lines"] and h["lines"][0]["kind"] == "carried")
    h["lines"][0]["n"] += 42


def _fewer(m):  # IndexError (pop from an empty list)
    h = _first_hunk(m, lambda h: h["lines"])
    h["lines"][0]["n"] -= 1


def _no_record(m):  # KeyError (records[hid])
    f = next(f for f in m["files"] if f["hunks"])
    f["hunks"].pop()


def _removed_off(m):  # a removed line tagged "?"
    h = _first_hunk(m, lambda h: h["removed_lines"])
    h["removed_lines"][0]["n"] += 1


def _n_text(m):  # TypeError (range("3"))
    h = _first_hunk(m, lambda h: h["lines"])
    h["lines"][0]["n"] = str(h["lines"][0]["n"])


def _no_kind(m):  # KeyError ('kind')
    h = _first_hunk(m, lambda h: h["lines"])
    del h["lines"][0]["kind"]


def _origins_text(m):  # TypeError in select
    _first_hunk(m)["origins"] = "upstream"


EDITS = {"more": (_more, "per-line runs (lines) count"), "fewer": (_fewer, "per-line runs (lines) count"),
         "no-record": (_no_record, "has no record of the patch's hunk"),
         "removed": (_removed_off, "per-line runs (removed_lines) count"),
         "n-text": (_n_text, "lines.0.n"), "no-kind": (_no_kind, "lines.0.kind"),
         "origins-text": (_origins_text, "origins")}


def test_annotate_refuses_per_line_runs_that_do_not_match_the_hunks(written, tmp_path, capsys):
    out, b = written
    patch = out / "patches/latest/megatron.patch"
    wrong = {}
    for name, (edit, in_error) in EDITS.items():
        m = copy.deepcopy(b.manifest)
        edit(m)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(m), encoding="utf-8")
        for args in ([], ["--kind", "carried"], ["gated_delta_net.py"]):
            try:
                rc, _out, err = _run(capsys, "annotate", "--patch", str(patch), "--manifest", str(path), *args)
            except Exception as exc:  # noqa: BLE001 - the fault this test is for
                wrong[f"{name} {args}"] = f"raised {type(exc).__name__}: {exc}"
                continue
            lines = err.rstrip().splitlines()
            if rc != 2 or not lines or not lines[-2].startswith("error: annotate: ") or in_error not in lines[-2] \
                    or not lines[-1].startswith("hint: "):
                wrong[f"{name} {args}"] = f"exit {rc}: {err!r}"
    assert not wrong, "\n".join(f"{k}: {v}" for k, v in wrong.items())


def test_annotate_names_an_excluded_hunk_as_excluded_with_its_reason(written, capsys):
    out, b = written
    rc, _out, err = _run(capsys, "annotate", "megatron/core/extras.py#1", "--out", str(out))
    assert rc == 2
    assert "error: annotate: megatron/core/extras.py#1 is an upstream hunk the recipe excluded (step exclude-extras): " \
           "brings a forbidden name" in err
    assert "no origin" not in err and "\nhint: " in err


@pytest.mark.parametrize("edit", ["verification", "pins", "origins"])
def test_summary_refuses_a_manifest_with_fields_of_the_wrong_type(written, edit):
    out, b = written
    path = out / "patches/latest/manifest.json"
    m = json.loads(path.read_text(encoding="utf-8"))
    if edit == "verification":
        m["verification"][0] = {"check": "applies"}
    elif edit == "pins":
        m["pins"]["commits_between"] = "three"
    else:
        _first_hunk(m)["origins"][0]["added"] = None
    path.write_text(json.dumps(m), encoding="utf-8")
    result = CliRunner().invoke(cli, ["--summary", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert f"error: --summary: {path} is not a manifest gdn-backport wrote: " in result.stderr
    assert "\nhint: Write it again" in result.stderr and "Traceback" not in result.stderr


def test_check_names_a_lock_whose_fields_have_the_wrong_type(written, recipe, fake_repos, tmp_path):
    out, b = written
    lock = output.lock_data(b)
    lock["patch"] = "megatron.patch"  # AttributeError: 'str' object has no attribute 'get'
    (out / output.LOCK).parent.mkdir(parents=True, exist_ok=True)
    (out / output.LOCK).write_text(json.dumps(lock), encoding="utf-8")
    from conftest import STUB_PYTHON
    args = ["--recipe", str(recipe), "--megatron-lm", str(fake_repos.mlm), "--megatron-bridge",
            str(fake_repos.bridge_repo), "--cache-dir", str(tmp_path / "cache"), "--python", STUB_PYTHON,
            "--out", str(out)]
    result = CliRunner().invoke(cli, args + ["--check"])
    assert result.exit_code == 8, result.output
    assert "manifests/lock.json (differs: patch None (None) -> " in result.stderr
    assert "Traceback" not in result.stderr and "unexpected" not in result.stderr


def test_ci_timings_leaves_out_gate_cases_it_cannot_read(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import ci_timings
    finally:
        sys.path.remove(str(REPO / "bench"))
    (tmp_path / "gate-report-cases.json").write_text(json.dumps({"cases": {
        "a::t1": {"outcome": "passed", "seconds": 1.5}, "a::t2": {"outcome": "passed", "seconds": "2"},
        "a::t3": {"outcome": ["passed"], "seconds": 1.0}}}), encoding="utf-8")
    records = ci_timings.suite_records(tmp_path)
    assert ci_timings.slowest_tests(records) == [["gate::a::t1", 1.5]]
    assert ci_timings.counts(records)["gate"]["passed"] == 1
    assert "left out 2 cases" in capsys.readouterr().err
