"""backport.engine.build end to end on the fake repositories (no import check); output; CLI."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from backport import output
from backport.cli import cli
from backport.engine import build
from backport.options import Options, parse_date
from backport.errors import ApplyError, PinError, RecipeError, SourceError, UsageError, VerificationError

from conftest import STUB_PYTHON, recipe_data, write_recipe

pytestmark = pytest.mark.usefixtures("engine_env")


@pytest.fixture(scope="module")
def built(fake_repos, tmp_path_factory):
    """One build of the full fake recipe, shared by the read-only assertions below."""
    tmp = tmp_path_factory.mktemp("built")
    path = write_recipe(tmp / "fake.yaml", recipe_data(fake_repos))
    opts = Options(recipe=path, megatron_lm=str(fake_repos.mlm), megatron_bridge=str(fake_repos.bridge_repo),
                   cache_dir=tmp / "cache", date="20260102", python=STUB_PYTHON)
    return build(opts), opts


def test_patch_is_deterministic_across_builds(built, recipe, make_options):
    again = build(make_options(recipe, offline=False))
    assert again.patch == built[0].patch
    assert again.manifest == built[0].manifest


def test_second_build_works_offline_from_the_cache(built, fake_repos):
    b, opts = built
    offline = build(Options(recipe=opts.recipe, megatron_lm="/nonexistent", megatron_bridge="/nonexistent",
                            cache_dir=opts.cache_dir, date=opts.date, import_check=False, offline=True))
    assert offline.patch == b.patch and offline.cold is False


def test_every_changed_line_is_attributed(built):
    m = built[0].manifest
    for f in m["files"]:
        for h in f["hunks"]:
            assert sum(o["added"] for o in h["origins"]) == h["added"]
            assert sum(o["removed"] for o in h["origins"]) == h["removed"]
            assert all(o["origin"] in m["origins"] for o in h["origins"])
    assert m["attribution"]["exact"] + m["attribution"]["by_neighbour"] == m["patch"]["added"] + m["patch"]["removed"]
    patch = built[0].patch.decode().splitlines()
    assert m["patch"]["added"] == sum(1 for x in patch if x.startswith("+") and not x.startswith("+++"))
    assert m["patch"]["removed"] == sum(1 for x in patch if x.startswith("-") and not x.startswith("---"))


def test_manifest_records_pins_origins_and_dispositions(built, fake_repos):
    m = built[0].manifest
    assert m["pins"] == {"megatron_bridge": fake_repos.bridge, "mcore_base": fake_repos.base,
                         "bridge_dev_commit": fake_repos.base, "upstream": fake_repos.upstream,
                         "upstream_ref": "fake/Megatron-LM#1", "commits_between": 3,
                         "prerequisites": [fake_repos.prereq]}
    assert m["recipe"]["path"] == "fake.yaml"
    assert m["patch"]["name"] == f"20260102-{fake_repos.base[:9]}.patch"
    assert m["carry"] is None
    kinds = {k: v["kind"] for k, v in m["origins"].items()}
    assert kinds == {
        "adapt-none-group": "adaptation", "add-gdn-cp": "adaptation", "fix-tuple-index": "preserved-fix",
        "megatron/core/context_parallel_layout.py#1": "upstream-verbatim",
        "megatron/core/utils.py#1": "upstream-verbatim", "megatron/core/utils.py#2": "upstream-verbatim",
        "prereq-resolve": "prerequisite"}
    assert [m["origins"][f"megatron/core/utils.py#{n}"]["offset"] for n in (1, 2)][0] == -3
    assert m["upstream_summary"] == {"adapted": 1, "excluded": 2, "verbatim": 3}
    excluded = {u["id"]: u.get("reason") for u in m["upstream_hunks"] if u["disposition"] == "excluded"}
    assert excluded == {"megatron/core/extras.py#1": "brings a forbidden name",
                        "tests/unit_tests/test_utils.py#1": "upstream tests stay upstream"}


def test_verification_records(built):
    checks = {c["check"]: c for c in built[0].manifest["verification"]}
    assert list(checks) == ["deterministic", "applies", "no_conflict_markers", "byte_compiles", "verbatim_files",
                            "forbidden_strings", "imports", "carry_survival"]
    assert all(c["ok"] for c in checks.values())
    assert checks["imports"]["detail"].startswith("0 modules imported; cp_context accepted; ")  # the stub's answer


def test_a_skipped_check_is_recorded_with_the_flag_that_skipped_it(recipe, make_options):
    from backport.output import skipped_checks

    m = build(make_options(recipe, import_check=False)).manifest
    checks = {c["check"]: c for c in m["verification"]}
    assert checks["imports"] == {"check": "imports", "ok": False, "detail": "skipped by --no-import-check",
                                 "skipped_by": "--no-import-check"}
    assert skipped_checks(m) == [("imports", "--no-import-check")]
    assert all(c["ok"] for name, c in checks.items() if name != "imports")


def test_file_taken_whole_equals_upstream_bytes(built, fake_repos):
    """upstream_file must reproduce the upstream blob exactly (final newline included)."""
    from conftest import git
    expected = git(fake_repos.mlm, "show", f"{fake_repos.upstream}:megatron/core/context_parallel_layout.py")
    section = built[0].patch.decode().split("+++ b/megatron/core/context_parallel_layout.py\n")[1].split("diff --git")[0]
    assert section.splitlines()[0] == "@@ -0,0 +1,5 @@"
    assert "".join(line[1:] + "\n" for line in section.splitlines()[1:]) == expected


def test_carried_patch_hunks_are_carried_origins(recipe, carry_patch, make_options):
    b = build(make_options(recipe, carry=carry_patch))
    m = b.manifest
    assert m["carry"]["name"] == "downstream.patch"
    assert m["carry"]["hunks"] == ["carry:megatron/bridge/models/gdn_bridge.py#1", "carry:megatron/core/ssm/gated_delta_net.py#1"]
    assert m["origins"]["fix-tuple-index"]["status"] == "already-present"
    assert b.patch.decode().count("tuple(slices)") == 1
    carried = [o for f in m["files"] for h in f["hunks"] for o in h["origins"] if o["kind"] == "carried"]
    assert sum(o["added"] for o in carried) == 4 and sum(o["removed"] for o in carried) == 1
    assert "carry: sha256 " in b.patch.decode().split("diff --git")[0]
    # a carry run's dated outputs never take the plain run's name
    assert m["patch"]["name"] == f"20260102-{m['pins']['mcore_base'][:9]}-carry-{m['carry']['sha256'][:8]}.patch"


def test_carry_bytes_are_read_once_per_run(recipe, carry_patch, make_options, monkeypatch):
    """The digest, the parse and the determinism re-run see the same carry bytes: a carry file
    rewritten while the run goes on changes neither the sha256 named nor the patch made."""
    import hashlib

    from backport import engine

    original = carry_patch.read_bytes()
    real_load = engine.load_carry
    calls = []

    def load_then_rewrite(path):
        calls.append(path)
        carry = real_load(path)
        path.write_bytes(b"rewritten meanwhile\n")
        return carry

    monkeypatch.setattr(engine, "load_carry", load_then_rewrite)
    b = build(make_options(recipe, carry=carry_patch))
    assert len(calls) == 1
    assert b.manifest["carry"]["sha256"] == hashlib.sha256(original).hexdigest()
    assert b.patch.decode().count("tuple(slices)") == 1


def _edit(fake_repos, **change):
    data = recipe_data(fake_repos)
    for k, v in change.items():
        if k == "pins":
            data["pins"].update(v)
        else:
            data[k] = v(data) if callable(v) else v
    return data


@pytest.mark.parametrize("change, opts, error, code, in_message", [
    (dict(pins={"megatron_bridge": "f01ab52539282866d6d63618697f02a577643563"}), {}, PinError, 4, ".dev.commit"),
    (dict(pins={"commits_between": 2}), {}, PinError, 4, "3 commits lie between"),
    ({}, {"upstream": "BASE"}, RecipeError, 5, "is written for"),
    ({}, {"upstream": "0123456789ab"}, PinError, 4, "not found in"),  # README: unknown SHA is a pin error
    (dict(excluded=lambda d: d["excluded"][:1]), {}, RecipeError, 5, "tests/unit_tests/test_utils.py#1"),
])
def test_build_errors(tmp_path, fake_repos, make_options, change, opts, error, code, in_message):
    opts = {k: (fake_repos.base if v == "BASE" else v) for k, v in opts.items()}
    if "megatron_bridge" in change.get("pins", {}):
        change["pins"]["megatron_bridge"] = fake_repos.bridge_other
    path = write_recipe(tmp_path / "r.yaml", _edit(fake_repos, **change))
    with pytest.raises(error) as exc:
        build(make_options(path, **opts))
    assert exc.value.exit_code == code
    assert in_message in exc.value.message


def test_allow_pin_mismatch_accepts_another_dev_commit(tmp_path, fake_repos, make_options):
    from backport.manifest_md import render_markdown

    path = write_recipe(tmp_path / "r.yaml", _edit(fake_repos, pins={"megatron_bridge": fake_repos.bridge_other}))
    said = []
    b = build(make_options(path, allow_pin_mismatch=True), progress=said.append)
    pins = b.manifest["pins"]
    assert pins["bridge_dev_commit"] == fake_repos.i1 and pins["mcore_base"] == fake_repos.base
    assert pins["pin_mismatch_allowed"] is True
    md = render_markdown(b.manifest)
    assert "(= Bridge .dev.commit)" not in md  # the base used is not the Bridge's .dev.commit: never labelled so
    assert (f"| Megatron-Core base (differs from Bridge .dev.commit; allowed by --allow-pin-mismatch) "
            f"| `{fake_repos.base}` |") in md
    assert f"| Megatron-Bridge .dev.commit (not used as the base) | `{fake_repos.i1}` |" in md
    assert any(m.startswith("warning: MCore base ") and fake_repos.i1 in m and "--allow-pin-mismatch" in m
               for m in said)
    from rich.console import Console

    from backport.cli import _summary_table
    console = Console(record=True, width=200)
    console.print(_summary_table(b.manifest, [], "run"))
    assert f"mcore base is not Bridge's .dev.commit {fake_repos.i1[:12]} (allowed by --allow-pin-mismatch)" in (
        console.export_text())


def test_matching_pins_keep_the_one_row_label_and_no_mismatch_key(built):
    from backport.manifest_md import render_markdown

    m = built[0].manifest
    assert "pin_mismatch_allowed" not in m["pins"]
    assert f"| Megatron-Core base (= Bridge .dev.commit) | `{m['pins']['mcore_base']}` |" in render_markdown(m)
    assert ".dev.commit (not used as the base)" not in render_markdown(m)


def test_non_ancestor_upstream_is_pin_error(tmp_path, fake_repos, make_options):
    """side branches off base, before i1: i1 is not an ancestor of it."""
    path = write_recipe(tmp_path / "r.yaml", _edit(fake_repos, pins={
        "upstream": fake_repos.side, "mcore_base": fake_repos.i1, "megatron_bridge": fake_repos.bridge_other}))
    with pytest.raises(PinError, match="is not an ancestor") as exc:
        build(make_options(path))
    assert exc.value.exit_code == 4


def test_forbidden_string_from_a_step_fails_and_nothing_is_written(tmp_path, fake_repos, make_options, monkeypatch):
    data = recipe_data(fake_repos)
    data["excluded"] = data["excluded"][1:]
    data["steps"].append({"id": "take-extras", "kind": "upstream_hunks", "hunks": ["megatron/core/extras.py#1"],
                          "why": "brings the forbidden name in"})
    path = write_recipe(tmp_path / "r.yaml", data)
    monkeypatch.setattr(output, "write", lambda *a, **k: pytest.fail("output.write reached"))
    runner = CliRunner()
    result = runner.invoke(cli, ["--recipe", str(path), "--megatron-lm", str(fake_repos.mlm),
                                 "--megatron-bridge", str(fake_repos.bridge_repo), "--cache-dir", str(tmp_path / "c"),
                                 "--python", STUB_PYTHON, "--date", "2026-01-02", "--out", str(tmp_path / "out")])
    assert result.exit_code == 7, result.output
    assert "error: verification check 'forbidden_strings' failed: 'pad_between_seqs' in megatron/core/extras.py" in result.stderr
    assert "hint: " in result.stderr
    # Nothing was written: the out folder holds only the run's lock (build/ is ignored by git).
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*")
                  if p.is_file()) in ([], [output.OUTPUT_LOCK], [output.OUTPUT_LOCK, output.OUTPUT_LOCK + ".owner"])
    with pytest.raises(VerificationError):
        build(make_options(path))


@pytest.mark.parametrize("step, error, in_message", [
    ({"id": "add-again", "kind": "add_file", "path": "megatron/core/utils.py", "template": "gdn_context_parallel.py"},
     ApplyError, "already exists in the base tree"),
    ({"id": "bad-transform", "kind": "fix", "path": "megatron/core/utils.py", "transform": "no_such_transform"},
     RecipeError, "unknown transform 'no_such_transform'"),
    ({"id": "no-anchor", "kind": "fix", "path": "megatron/core/utils.py", "transform": "fix_local_cp_tuple_index"},
     ApplyError, "'get_parameter_local_cp' not found"),
    ({"id": "take-same", "kind": "upstream_file", "path": "megatron/core/extras.py", "hunks": ["megatron/core/extras.py#1"]},
     None, None),
])
def test_step_errors(tmp_path, fake_repos, make_options, step, error, in_message):
    data = recipe_data(fake_repos)
    step = {**step, "why": "a step that must fail here"}
    if step["kind"] == "upstream_file":
        data["excluded"] = data["excluded"][1:]
        data["forbidden_strings"] = []
        data["steps"].append(step)
        build(make_options(write_recipe(tmp_path / "r.yaml", data)))  # a whole changed file is fine
        return
    data["steps"].append(step)
    with pytest.raises(error, match=in_message):
        build(make_options(write_recipe(tmp_path / "r.yaml", data)))


@pytest.mark.parametrize("value, env, expected", [
    ("2026-11-29", None, "20261129"), ("20261129", None, "20261129"), (None, "0", "19700101"),
    (None, "1764374400", "20251129"),
])
def test_parse_date(monkeypatch, value, env, expected):
    if env is not None:
        monkeypatch.setenv("SOURCE_DATE_EPOCH", env)
    assert parse_date(value) == expected


@pytest.mark.parametrize("value, env", [
    ("29/11/2026", None), ("2026-02-30", None), (None, "yesterday"),
    # strptime alone accepts these (hostile trial): 2026-01-31, 2026-01-01, and int()'s forms
    ("2026131", None), ("202611", None), ("", None), ("2026-1-05", None),
    (None, "1_700_000_000"), (None, " 1700000000 "), (None, "+1700000000"), (None, "\u0661\u0662"),
])
def test_bad_date_is_usage_error(monkeypatch, value, env):
    if env is not None:
        monkeypatch.setenv("SOURCE_DATE_EPOCH", env)
    with pytest.raises(UsageError) as exc:
        parse_date(value)
    assert exc.value.exit_code == 2


# --- output --------------------------------------------------------------------------------

def test_write_then_check_passes_and_is_byte_stable(built, tmp_path):
    b = built[0]
    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir(), second.mkdir()
    output.write(b, first, trees=True)
    output.write(b, second, trees=False)
    rels = list(output.rendered(b))
    assert output.check(b, first) == {rel: "identical" for rel in rels + list(output.TREES)}
    for rel in rels:
        assert (first / rel).read_bytes() == (second / rel).read_bytes()
    name = b.manifest["patch"]["name"]
    assert (first / "patches/megatron" / name).read_bytes() == (first / "patches/latest/megatron.patch").read_bytes() == b.patch
    assert (first / "build/tree/patched/megatron/core/utils.py").read_text() != (first / "build/tree/base/megatron/core/utils.py").read_text()
    assert not list(first.glob(".gdn-stage-*"))


@pytest.mark.parametrize("rel, action", [
    ("patches/latest/megatron.patch", "edit"), ("manifests/lock.json", "edit"),
    ("patches/latest/manifest.md", "delete"),
])
def test_check_reports_changed_files(built, tmp_path, rel, action):
    output.write(built[0], tmp_path, trees=False)
    if action == "edit":
        (tmp_path / rel).write_bytes((tmp_path / rel).read_bytes() + b"x")
    else:
        (tmp_path / rel).unlink()
    with pytest.raises(output.CheckMismatch) as exc:
        output.check(built[0], tmp_path)
    assert exc.value.exit_code == 8
    assert f"{rel} ({'differs' if action == 'edit' else 'missing'})" in exc.value.message


def test_check_of_a_fresh_clone_compares_the_lock_alone(built, tmp_path):
    # Only manifests/lock.json is committed; the generated files are git-ignored.
    output.write(built[0], tmp_path, trees=False)
    shutil.rmtree(tmp_path / "patches")
    report = output.check(built[0], tmp_path)
    assert report[output.LOCK] == "identical"
    assert {v for rel, v in report.items() if rel != output.LOCK} == {output.PINNED_BY_LOCK}
    # ... and the lock pins the patch: a lock from another patch fails.
    lock = json.loads((tmp_path / output.LOCK).read_text())
    lock["patch"]["sha256"] = "0" * 64
    (tmp_path / output.LOCK).write_bytes(output.canonical_json(lock))
    with pytest.raises(output.CheckMismatch, match=r"manifests/lock.json \(differs: patch "):
        output.check(built[0], tmp_path)
    (tmp_path / output.LOCK).unlink()
    with pytest.raises(output.CheckMismatch, match=r"nothing to check in .*: there is no manifests/lock.json and no "
                                                    r"output there"):
        output.check(built[0], tmp_path)


def test_check_mismatch_hint_names_the_carry_the_outputs_were_made_with(built, tmp_path):
    """Outputs made with --carry, checked without it: the hint says to pass the same --carry."""
    b = built[0]
    output.write(b, tmp_path, trees=False)
    latest = json.loads((tmp_path / "patches/latest/manifest.json").read_text())
    latest["carry"] = {"name": "ours.patch", "sha256": "ab" * 32}
    (tmp_path / "patches/latest/manifest.json").write_bytes(output.canonical_json(latest))
    with pytest.raises(output.CheckMismatch) as exc:
        output.check(b, tmp_path)
    assert "made with --carry ours.patch (sha256 abababababab)" in exc.value.hint
    assert "ran without --carry" in exc.value.hint and "pass the same --carry to --check" in exc.value.hint


def test_check_mismatch_hint_names_the_date(built, tmp_path):
    b = built[0]  # dated as its manifest says
    output.write(b, tmp_path, trees=False)
    # The lock carries another date: the hint says the lock's date was not used.
    lock = json.loads((tmp_path / output.LOCK).read_text())
    lock["date"] = "2020-01-01"
    (tmp_path / output.LOCK).write_bytes(output.canonical_json(lock))
    with pytest.raises(output.CheckMismatch) as exc:
        output.check(b, tmp_path)
    assert f"{output.LOCK} is dated 2020-01-01" in exc.value.hint and "SOURCE_DATE_EPOCH unset" in exc.value.hint
    # patches/latest holds another day's outputs (a `make patch` on a later day): the hint says how to check.
    output.write(b, tmp_path, trees=False)
    latest = json.loads((tmp_path / "patches/latest/manifest.json").read_text())
    latest["date"] = "2030-01-01"
    (tmp_path / "patches/latest/manifest.json").write_bytes(output.canonical_json(latest))
    with pytest.raises(output.CheckMismatch) as exc:
        output.check(b, tmp_path)
    assert "patches/latest holds the 2030-01-01 outputs" in exc.value.hint and "clean clone" in exc.value.hint
    # Same dates, different bytes: the class's hint (regenerate and commit the lock).
    output.write(b, tmp_path, trees=False)
    (tmp_path / "patches/latest/megatron.patch").write_bytes(b.patch + b"x")
    with pytest.raises(output.CheckMismatch) as exc:
        output.check(b, tmp_path)
    assert exc.value.hint == output.CheckMismatch.default_hint


def test_lock_date(built, tmp_path):
    assert output.lock_date(tmp_path) is None
    output.write(built[0], tmp_path, trees=False)
    assert output.lock_date(tmp_path) == built[0].manifest["date"]
    for bad in ("{}", '{"date": "tomorrow"}', '{"date": 20261129}', "not json"):
        (tmp_path / output.LOCK).write_text(bad)
        with pytest.raises(output.CheckMismatch, match="not a lock with a valid date") as exc:
            output.lock_date(tmp_path)
        assert "git checkout manifests/lock.json" in exc.value.hint


def test_canonical_json_and_lock(built, tmp_path):
    assert output.canonical_json({"b": 1, "a": [2, {"d": 1, "c": "é"}]}) == \
        '{\n  "a": [\n    2,\n    {\n      "c": "é",\n      "d": 1\n    }\n  ],\n  "b": 1\n}\n'.encode()
    output.write(built[0], tmp_path, trees=False)
    raw = (tmp_path / "patches/latest/manifest.json").read_bytes()
    assert raw == output.canonical_json(json.loads(raw))
    lock = json.loads((tmp_path / "manifests/lock.json").read_bytes())
    import hashlib
    assert lock["manifest_sha256"] == hashlib.sha256(raw).hexdigest()
    assert lock["patch"]["sha256"] == hashlib.sha256(built[0].patch).hexdigest()


# --- cli -----------------------------------------------------------------------------------

def test_help_lists_the_flags():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for flag in ("--upstream", "--recipe", "--megatron-lm", "--megatron-bridge", "--cache-dir", "--offline",
                 "--carry", "--date", "--out", "--allow-pin-mismatch", "--no-import-check", "--python",
                 "--no-trees", "--dry-run", "--check", "--list-hunks", "--verbose", "--debug", "--release", "--no-wait", "--summary"):
        assert flag in result.output


@pytest.mark.parametrize("flag", ["--check", "--dry-run", "--release"])
def test_list_hunks_with_a_flag_it_would_ignore_exits_2(tmp_path, flag):
    """--list-hunks only lists; with --check it used to exit 0 having checked nothing."""
    result = CliRunner().invoke(cli, ["--list-hunks", flag, "--cache-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: --list-hunks and {flag} exclude each other")
    assert "\nhint: " in result.stderr and "two commands" in result.stderr


def test_dry_run_and_check_together_exit_2(tmp_path):
    result = CliRunner().invoke(cli, ["--dry-run", "--check", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr == ("error: --check and --dry-run exclude each other: --check compares a fresh build with the "
                             "outputs on disk and writes nothing, and --dry-run writes the outputs to a scratch folder "
                             "only; one run does one of them.\nhint: Run them as two commands.\n")
    assert result.stdout == ""


@pytest.mark.parametrize("args, code, in_error", [
    (["--date", "tomorrow"], 2, "error: --date 'tomorrow' is not YYYY-MM-DD."),
    (["--recipe", "MISSING"], 5, "error: cannot read recipe"),
    (["--offline"], 3, "--offline was given"),
])
def test_cli_errors_print_error_and_hint(tmp_path, fake_repos, recipe, args, code, in_error):
    args = [str(tmp_path / "missing.yaml") if a == "MISSING" else a for a in args]
    base = ["--recipe", str(recipe), "--cache-dir", str(tmp_path / "empty-cache"),
            "--megatron-lm", str(fake_repos.mlm), "--megatron-bridge", str(fake_repos.bridge_repo)]
    result = CliRunner().invoke(cli, base + args)
    assert result.exit_code == code, result.output
    assert in_error in result.stderr
    assert "\nhint: " in result.stderr


def test_cli_list_hunks_dry_run_and_check(tmp_path, fake_repos, recipe):
    base = ["--recipe", str(recipe), "--cache-dir", str(tmp_path / "c"), "--megatron-lm", str(fake_repos.mlm),
            "--megatron-bridge", str(fake_repos.bridge_repo), "--python", STUB_PYTHON, "--date", "2026-01-02"]
    runner = CliRunner()
    listed = runner.invoke(cli, base[:6] + ["--list-hunks"])  # --megatron-bridge, --python, --date: no effect there
    assert listed.exit_code == 0, listed.output
    assert listed.stdout.splitlines()[0] == "megatron/core/context_parallel_layout.py#1  +5 -0  @@ -0,0 +1,5 @@"
    dry = runner.invoke(cli, base + ["--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "dry run: outputs in " in dry.stdout
    out = tmp_path / "out"
    out.mkdir()
    checked = runner.invoke(cli, base + ["--check", "--out", str(out)])
    assert checked.exit_code == 8
    assert f"error: nothing to check in {out}: there is no manifests/lock.json" in checked.stderr
    written = runner.invoke(cli, base + ["--out", str(out), "--no-trees", "--offline"])
    assert written.exit_code == 0, written.output
    assert runner.invoke(cli, base + ["--check", "--out", str(out), "--offline"]).exit_code == 0


def test_cli_check_takes_the_lock_date(tmp_path, fake_repos, recipe):
    """Outputs written on one day still --check equal on a later day, and in a fresh clone."""
    base = ["--recipe", str(recipe), "--cache-dir", str(tmp_path / "c"), "--megatron-lm", str(fake_repos.mlm),
            "--megatron-bridge", str(fake_repos.bridge_repo), "--python", STUB_PYTHON]
    out = tmp_path / "out"
    runner = CliRunner()
    assert runner.invoke(cli, base + ["--date", "2026-01-02", "--out", str(out), "--no-trees"]).exit_code == 0
    checked = runner.invoke(cli, base + ["--check", "--out", str(out), "--offline"])  # no --date: today is not 01-02
    assert checked.exit_code == 0, checked.output
    assert "check: date 2026-01-02 from " in checked.stderr
    assert "manifests/lock.json: identical" in checked.stdout
    shutil.rmtree(out / "patches")
    fresh = runner.invoke(cli, base + ["--check", "--out", str(out), "--offline"])
    assert fresh.exit_code == 0, fresh.output
    assert "patches/latest/megatron.patch: absent; covered by the patch and manifest sha256 in" in fresh.stdout
    # An explicit --date, or SOURCE_DATE_EPOCH, still wins (with a warning), and a different
    # date is a different patch.
    other = runner.invoke(cli, base + ["--check", "--out", str(out), "--offline", "--date", "2026-01-03"])
    assert other.exit_code == 8 and "manifests/lock.json (differs: date 2026-01-02 -> 2026-01-03" in other.stderr
    assert "check: date 2026-01-03 from --date" in other.stderr
    assert "manifests/lock.json is dated 2026-01-02" in other.stderr
    epoch = runner.invoke(cli, base + ["--check", "--out", str(out), "--offline"],
                          env={"SOURCE_DATE_EPOCH": "1767398400"})  # 2026-01-03T00:00:00Z
    assert epoch.exit_code == 8
    assert "check: date 2026-01-03 from SOURCE_DATE_EPOCH" in epoch.stderr


def test_progress_is_one_line_per_step_when_stderr_is_not_a_terminal(tmp_path, fake_repos, recipe):
    """Piped stderr (CI, logs): every progress message stays on its own line, however long."""
    long_cache = tmp_path / ("a-rather-long-cache-folder-name-" * 4)
    base = ["--recipe", str(recipe), "--cache-dir", str(long_cache), "--megatron-lm", str(fake_repos.mlm),
            "--megatron-bridge", str(fake_repos.bridge_repo), "--python", STUB_PYTHON, "--date", "2026-01-02",
            "--dry-run"]
    result = CliRunner().invoke(cli, base)
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert lines and all(ln.startswith(("… ", "warning:", "lock:", "release:")) for ln in lines), lines


def test_summary_prints_the_last_runs_table_without_rebuilding(tmp_path, fake_repos, recipe):
    out = tmp_path / "out"
    out.mkdir()
    runner = CliRunner()
    missing = runner.invoke(cli, ["--summary", "--out", str(out)])
    assert missing.exit_code == 2
    assert "--summary:" in missing.stderr and "hint: Run `tools/backport" in missing.stderr
    base = ["--recipe", str(recipe), "--cache-dir", str(tmp_path / "c"), "--megatron-lm", str(fake_repos.mlm),
            "--megatron-bridge", str(fake_repos.bridge_repo), "--python", STUB_PYTHON, "--date", "2026-01-02"]
    assert runner.invoke(cli, base + ["--out", str(out), "--no-trees"]).exit_code == 0
    manifest = json.loads((out / "patches/latest/manifest.json").read_text(encoding="utf-8"))
    # no sources are opened: an unreadable cache and mirror do not matter
    shown = runner.invoke(cli, ["--summary", "--out", str(out)])
    assert shown.exit_code == 0, shown.output
    ignored = runner.invoke(cli, ["--summary", "--out", str(out), "--megatron-lm", "/nonexistent"])
    assert ignored.exit_code == 2 and "--summary and --megatron-lm exclude each other" in ignored.stderr
    assert f"gdn-backport summary: {manifest['patch']['name']}" in shown.stdout
    assert manifest["patch"]["sha256"] in shown.stdout
    assert "check deterministic" in shown.stdout


def test_manifest_markdown_says_where_the_decisions_are_defined(built):
    from backport.manifest_md import render_markdown

    assert "`docs/decisions.md`" in render_markdown(built[0].manifest)


def test_check_compares_the_trees_on_disk_with_the_lock(built, tmp_path):
    """A tree edited (or left stale by --no-trees) after the run is a --check difference."""
    output.write(built[0], tmp_path, trees=True)
    report = output.check(built[0], tmp_path)
    assert report["build/tree/base"] == report["build/tree/patched"] == "identical"
    victim = next(p for p in sorted((tmp_path / "build/tree/patched/megatron").rglob("*.py")))
    victim.write_bytes(victim.read_bytes() + b"# drift\n")
    with pytest.raises(output.CheckMismatch) as exc:
        output.check(built[0], tmp_path)
    rel = victim.relative_to(tmp_path / "build/tree/patched").as_posix()
    assert f"build/tree/patched (the patched tree's sha256" in exc.value.message
    assert f"first differing file: {rel} (changed)" in exc.value.message


def test_manifest_tells_our_lines_from_upstreams(tmp_path, fake_repos, make_options, carry_patch):
    """Per hunk and origin, added lines equal to upstream's vs ours; the beyond-upstream table;
    each preserved fix's source; the carry's sha256 in manifest.md."""
    import hashlib

    from backport.manifest_md import render_markdown

    data = recipe_data(fake_repos)
    for step in data["steps"]:
        if step["id"] == "add-gdn-cp":
            step["beyond_upstream"] = [{"what": "our whole module, none of it upstream",
                                        "why": "the fake recipe needs one item", "effect": "none measured",
                                        "evidence": "results/none"}]
        if step["id"] == "fix-tuple-index":
            step["source"] = "the fake downstream image's megatron.patch"
    path = write_recipe(tmp_path / "fake.yaml", data)
    b = build(make_options(path, carry=carry_patch))
    m = b.manifest
    totals = m["lines_vs_upstream"]
    # taken verbatim: every non-blank added line is upstream's
    assert totals["megatron/core/utils.py#1"]["added_ours"] == 0 and totals["megatron/core/utils.py#1"]["added_upstream"] > 0
    # our module has no upstream file: all ours
    assert totals["add-gdn-cp"]["added_upstream"] == 0 and totals["add-gdn-cp"]["added_ours"] > 0
    for f in m["files"]:
        for h in f["hunks"]:
            assert h["id"].startswith("out:")
            for o in h["origins"]:
                assert o["added_upstream"] + o["added_ours"] + o["added_carried"] == o["added"]
                assert o["added_carried"] == (o["added"] if o["kind"] == "carried" else 0)
            assert sum(r["n"] for r in h["lines"]) == h["added"]
            assert {r["kind"] for r in h["lines"]} <= {"upstream", "ours", "carried"}
    kinds = m["patch"]["added_by_kind"]
    carried = sum(o["added"] for f in m["files"] for h in f["hunks"] for o in h["origins"] if o["kind"] == "carried")
    assert sum(kinds.values()) == m["patch"]["added"] and kinds["carried"] == carried > 0
    # the step's count is in lines_vs_upstream, once; the rows do not repeat it
    assert m["beyond_upstream"] == [{
        "step": "add-gdn-cp", "file": "megatron/core/ssm/gdn_context_parallel.py",
        "what": "our whole module, none of it upstream", "why": "the fake recipe needs one item",
        "effect": "none measured", "evidence": "results/none"}]
    assert m["origins"]["fix-tuple-index"]["source"] == "the fake downstream image's megatron.patch"
    md = render_markdown(m)
    assert "## Beyond upstream (1)" in md and "our whole module, none of it upstream" in md
    assert "Source: the fake downstream image's megatron.patch." in md
    assert f"sha256 `{hashlib.sha256(carry_patch.read_bytes()).hexdigest()}`" in md
    assert f"{totals['add-gdn-cp']['added_upstream']} up, {totals['add-gdn-cp']['added_ours']} ours" in md
    # manifest.md leads with the one total line
    assert md.splitlines()[2] == (f"**Added lines: {kinds['upstream']} from upstream, {kinds['ours']} ours, "
                                  f"{kinds['carried']} carried** (of {m['patch']['added']}; each line's origin: "
                                  "`tools/backport annotate [HUNK ...]`).")


def test_a_forbidden_string_the_base_file_already_holds_is_not_the_patchs(tmp_path, fake_repos, make_options):
    """A step changes a file whose base version already contains a forbidden string (at
    Bridge a1bf00bd's base, packed_seq_params.py holds pad_between_seqs): the patch does not
    bring it, so the check passes; a string the patch adds still fails (test above)."""
    path = write_recipe(tmp_path / "r.yaml", _edit(fake_repos, forbidden_strings=["pad_between_seqs", "helper_2"]))
    b = build(make_options(path))
    assert "helper_2" in (b.base_tree / "megatron/core/utils.py").read_text()
    check = {c["check"]: c for c in b.manifest["verification"]}["forbidden_strings"]
    assert check["ok"]


def _stub_python(tmp_path, body: str):
    stub = tmp_path / "stub-python"
    stub.write_text("#!/bin/sh\n" + body + "\n")
    stub.chmod(0o755)
    return str(stub)


@pytest.mark.parametrize("body, words", [
    ("echo 'ModuleNotFoundError: No module named fla' >&2; exit 1", "do not import with"),
    ("kill -9 $$", "was killed by signal 9"),
    ("exec sleep 60", "did not finish in 1 s (stopped)"),
])
def test_import_check_runs_beside_the_determinism_run_and_its_failure_is_named(tmp_path, fake_repos, body, words,
                                                                              monkeypatch):
    """The import check starts in a second interpreter while this process verifies
    (backport.verify.VerifyTree); its failure, or its death by a signal, still fails the run
    with exit 7 naming the interpreter, and nothing is written."""
    data = recipe_data(fake_repos)
    data["import_check"] = ["megatron.core.ssm.gated_delta_net"]
    path = write_recipe(tmp_path / "fake.yaml", data)
    python = _stub_python(tmp_path, body)
    monkeypatch.setenv("GDN_IMPORT_CHECK_TIMEOUT", "1")
    opts = Options(recipe=path, megatron_lm=str(fake_repos.mlm), megatron_bridge=str(fake_repos.bridge_repo),
                   cache_dir=tmp_path / "cache", date="20260102", import_check=True, python=python)
    with pytest.raises(VerificationError) as info:
        build(opts)
    assert "verification check 'imports' failed" in info.value.message and words in info.value.message
    assert python in info.value.message and info.value.exit_code == 7


def test_a_compile_record_that_blames_a_good_base_file_is_not_believed(built, fake_repos):
    """byte_compiles takes only 'compiles' from the base tree's record: a file the record says
    fails is compiled again, and the verdict is that compile's."""
    b, opts = built
    record = next(b.base_tree.glob(".compile-*.json"))
    data = json.loads(record.read_text())
    changed = {f["path"] for f in b.manifest["files"]}
    unchanged = sorted(p.relative_to(b.base_tree).as_posix() for p in (b.base_tree / "megatron").rglob("*.py")
                       if p.relative_to(b.base_tree).as_posix() not in changed)
    assert unchanged
    data["errors"] = {unchanged[0]: "1: invalid syntax (planted)"}
    record.write_text(json.dumps(data))
    again = build(opts)
    assert {c["check"]: c["ok"] for c in again.manifest["verification"]}["byte_compiles"]
