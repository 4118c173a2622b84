"""--bridge / --mcore-base: the pins a run uses, the per-step report at another base, and the
native-feature exit (17), on the fake repositories plus a throwaway Bridge repo of our own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from backport import output
from backport.cli import cli
from backport.engine import build
from backport.errors import ApplyError, FeatureNative, PinError, UsageError
from backport.retarget import already_upstream, native_fixes
from backport.workspace import HunkLines, split_lines

from conftest import STUB_PYTHON, commit, init_repo, recipe_data, write_recipe

pytestmark = pytest.mark.usefixtures("engine_env")


@pytest.fixture(scope="module")
def bridges(fake_repos, tmp_path_factory):
    """A Bridge repo of our own: ``at_base`` (.dev.commit = base, the recipe's pin), then
    ``at_prereq`` (= the commit that added resolve_cp_group) and ``at_upstream`` (= upstream)."""
    root = init_repo(tmp_path_factory.mktemp("bridges") / "Megatron-Bridge")
    files = {"src/megatron/bridge/__init__.py": '"""Bridge stand-in."""\n',
             "src/megatron/core/bridge_only.py": "ONLY_IN_BRIDGE = True\n", "README.md": "fake Bridge\n"}
    at_base = commit(root, {**files, ".dev.commit": fake_repos.base + "\n"}, "bridge at base")
    at_prereq = commit(root, {".dev.commit": fake_repos.prereq + "\n"}, "bridge at prereq")
    at_upstream = commit(root, {".dev.commit": fake_repos.upstream + "\n"}, "bridge at upstream")
    return {"repo": root, "at_base": at_base, "at_prereq": at_prereq, "at_upstream": at_upstream}


@pytest.fixture
def recipe_on(tmp_path, fake_repos, bridges):
    data = recipe_data(fake_repos)
    data["pins"]["megatron_bridge"] = bridges["at_base"]
    return write_recipe(tmp_path / "fake.yaml", data)


def _opts(make_options, recipe, bridges, **kw):
    return make_options(recipe, megatron_bridge=str(bridges["repo"]), **kw)


def test_recipe_pins_stay_the_default_and_leave_the_manifest_as_it_was(make_options, recipe_on, bridges, fake_repos):
    b = build(_opts(make_options, recipe_on, bridges))
    assert b.manifest["pins"]["mcore_base"] == fake_repos.base
    assert b.manifest["pins"]["commits_between"] == 3
    assert "retarget" not in b.manifest  # the recipe's own pins: the lock's bytes do not move
    assert b.report["steps"][1] == {"id": "prereq-resolve", "kind": "transplant", "status": "applied",
                                    "detail": f"resolve_cp_group from {fake_repos.prereq[:12]} into "
                                              "megatron/core/packed_seq_params.py"}


def test_bridge_reads_the_base_from_dev_commit_and_measures_the_distance(make_options, recipe_on, bridges, fake_repos):
    """The declared commits_between (3) is the recipe's; at the prereq base 1 commit is measured."""
    b = build(_opts(make_options, recipe_on, bridges, bridge=bridges["at_prereq"][:10]))
    p = b.manifest["pins"]
    assert (p["megatron_bridge"], p["mcore_base"], p["bridge_dev_commit"], p["commits_between"]) == (
        bridges["at_prereq"], fake_repos.prereq, fake_repos.prereq, 1)
    assert b.manifest["patch"]["name"] == f"20260102-{fake_repos.prereq[:9]}.patch"
    head = b.patch.decode().split("diff --git")[0]
    assert f"base: Megatron-Bridge {bridges['at_prereq']} + Megatron-LM {fake_repos.prereq}\n" in head
    r = b.manifest["retarget"]
    assert r["recipe_pins"] == {"megatron_bridge": bridges["at_base"], "mcore_base": fake_repos.base,
                                "commits_between": 3}


def test_prerequisite_already_at_the_base_is_reported_not_silent(make_options, recipe_on, bridges, fake_repos):
    b = build(_opts(make_options, recipe_on, bridges, bridge=bridges["at_prereq"]))
    step = next(s for s in b.manifest["retarget"]["steps"] if s["id"] == "prereq-resolve")
    assert step["status"] == "already present at the base"
    assert f"descends from {fake_repos.prereq[:12]}" in step["detail"] and "resolve_cp_group" in step["detail"]
    assert b.manifest["origins"]["prereq-resolve"]["status"] == "already-present"
    assert "packed_seq_params.py" not in b.patch.decode()  # the base's own version stays
    hunks = {h["id"]: h["status"] for h in b.manifest["retarget"]["upstream_hunks"]}
    assert hunks["megatron/core/utils.py#1"] == "verbatim" and hunks["megatron/core/extras.py#1"] == "excluded"
    assert hunks["megatron/core/ssm/gated_delta_net.py#1"] == "adapted"
    from backport.manifest_md import render_markdown
    md = render_markdown(b.manifest)
    assert "## Retargeted pins" in md and "| `prereq-resolve` | transplant | already present at the base |" in md


def test_cli_bridge_writes_outputs_named_by_the_pins_used(tmp_path, fake_repos, bridges, recipe_on):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, [
        "--recipe", str(recipe_on), "--bridge", bridges["at_prereq"], "--megatron-lm", str(fake_repos.mlm),
        "--megatron-bridge", str(bridges["repo"]), "--cache-dir", str(tmp_path / "c"), "--python", STUB_PYTHON,
        "--date", "2026-01-02", "--out", str(out), "--no-trees"])
    assert result.exit_code == 0, result.output
    assert "step prereq-resolve" in result.stdout and "already present at the base" in result.stdout
    lock = json.loads((out / output.LOCK).read_text())
    assert lock["pins"]["mcore_base"] == fake_repos.prereq and lock["pins"]["commits_between"] == 1
    assert (out / "patches" / "megatron" / f"20260102-{fake_repos.prereq[:9]}.patch").is_file()
    check = CliRunner().invoke(cli, [  # --check takes the lock's pins, as it takes the lock's date
        "--recipe", str(recipe_on), "--check", "--megatron-lm", str(fake_repos.mlm), "--megatron-bridge",
        str(bridges["repo"]), "--cache-dir", str(tmp_path / "c"), "--python", STUB_PYTHON, "--out", str(out), "--offline"])
    assert check.exit_code == 0, check.output
    assert f"check: pins from {out / output.LOCK}: Megatron-Bridge {bridges['at_prereq'][:12]}" in check.stderr


def test_base_containing_upstream_is_native_exit_17(make_options, recipe_on, bridges, fake_repos):
    with pytest.raises(FeatureNative) as exc:
        build(_opts(make_options, recipe_on, bridges, bridge=bridges["at_upstream"]))
    e = exc.value
    assert e.exit_code == 17 and (e.base, e.upstream) == (fake_repos.upstream, fake_repos.upstream)
    assert e.message.startswith(f"MCore base {fake_repos.upstream[:12]} contains {fake_repos.upstream[:12]}: "
                                "chunkwise CP is native; nothing to backport")
    rows = {r["id"]: r for r in e.fixes}
    assert rows["fix-tuple-index"]["status"] == "needed"  # the fake base still indexes with a list
    assert set(rows) == {"fix-tuple-index", "empty-cu-seqlens-segments", "fail-fast-checks", "all-gather-mode"}
    assert rows["all-gather-mode"]["status"] == "not applicable"  # the fake base has no linear_cp_mode
    assert "tell: fix-tuple-index: needed (transform fix_local_cp_tuple_index changes " in e.message
    assert "\n" not in e.message


def test_cli_native_prints_message_and_exits_17(tmp_path, fake_repos, bridges, recipe_on):
    result = CliRunner().invoke(cli, [
        "--recipe", str(recipe_on), "--bridge", bridges["at_upstream"], "--megatron-lm", str(fake_repos.mlm),
        "--megatron-bridge", str(bridges["repo"]), "--cache-dir", str(tmp_path / "c"), "--python", STUB_PYTHON,
        "--date", "2026-01-02", "--out", str(tmp_path / "out")])
    assert result.exit_code == 17, result.output
    lines = result.stderr.rstrip("\n").splitlines()
    assert lines[-2].startswith("error: MCore base ") and "chunkwise CP is native; nothing to backport" in lines[-2]
    assert lines[-1].startswith("hint: ") and result.stdout == ""
    assert "17 | native" in (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert not (tmp_path / "out" / output.LOCK).exists()


def test_mcore_base_needs_allow_pin_mismatch(make_options, recipe_on, bridges, fake_repos):
    with pytest.raises(UsageError, match="needs --allow-pin-mismatch") as exc:
        build(_opts(make_options, recipe_on, bridges, mcore_base=fake_repos.i1))
    assert exc.value.exit_code == 2
    b = build(_opts(make_options, recipe_on, bridges, mcore_base=fake_repos.i1, allow_pin_mismatch=True))
    assert (b.manifest["pins"]["mcore_base"], b.manifest["pins"]["bridge_dev_commit"]) == (fake_repos.i1, fake_repos.base)
    assert b.manifest["pins"]["commits_between"] == 2 and "retarget" in b.manifest


def test_declared_distance_is_checked_on_the_recipe_pins(tmp_path, make_options, bridges, fake_repos):
    data = recipe_data(fake_repos)
    data["pins"].update(megatron_bridge=bridges["at_base"], commits_between=7)
    path = write_recipe(tmp_path / "r.yaml", data)
    with pytest.raises(PinError, match="3 commits lie between base and upstream; the recipe expects 7"):
        build(_opts(make_options, path, bridges))
    b = build(_opts(make_options, path, bridges, bridge=bridges["at_prereq"]))  # measured at another base
    assert b.manifest["pins"]["commits_between"] == 1
    assert b.manifest["retarget"]["recipe_pins"]["commits_between"] == 7


def test_failing_step_names_itself_its_file_and_where_the_anchor_went(tmp_path, make_options, fake_repos):
    data = recipe_data(fake_repos)
    data["steps"].append({"id": "no-anchor", "kind": "fix", "path": "megatron/core/utils.py",
                          "transform": "fix_local_cp_tuple_index", "why": "a step that must fail here"})
    with pytest.raises(ApplyError) as exc:
        build(make_options(write_recipe(tmp_path / "r.yaml", data)))
    assert exc.value.step == "no-anchor" and exc.value.path == "megatron/core/utils.py"
    assert exc.value.message.startswith("recipe step no-anchor (megatron/core/utils.py): ")
    assert ("get_parameter_local_cp is defined in megatron/core/ssm/gated_delta_net.py at this base (moved?)"
            in exc.value.message)


def test_already_upstream_finds_the_result_not_the_source():
    h = HunkLines(source=["a\n", "b\n", "c\n"], target=["a\n", "B\n", "c\n"], changes=[], header_pos=0)
    assert already_upstream(split_lines("x\na\nB\nc\n"), h) == 2
    assert already_upstream(split_lines("x\na\nb\nc\n"), h) is None
    assert already_upstream(split_lines("x\ny\n"), h) is None


def test_native_fixes_follow_a_renamed_anchor(fake_repos):
    """get_parameter_local_cp renamed (as upstream's ..._headwise): the tuple-index fix is tried
    on the one close name; needed while it indexes with a list, already present once fixed."""
    from backport.recipe import Recipe
    from conftest import gdn_text

    recipe = Recipe.model_validate(recipe_data(fake_repos))

    def rows(text):
        return {r["id"]: r for r in native_fixes(recipe, lambda p: text if p.endswith("gated_delta_net.py") else None)}

    text = gdn_text().replace("def get_parameter_local_cp(", "def get_parameter_local_cp_headwise(")
    row = rows(text)["fix-tuple-index"]
    assert row["status"] == "needed" and "on get_parameter_local_cp_headwise" in row["evidence"]
    fixed = rows(text.replace("param[slices]", "param[tuple(slices)]"))["fix-tuple-index"]
    assert fixed["status"] == "already present"
    gone = rows(gdn_text().replace("def get_parameter_local_cp(", "def split_parameter("))["fix-tuple-index"]
    assert gone["status"] == "not applicable" and "'get_parameter_local_cp' not found" in gone["evidence"]


def test_upstream_hunk_already_at_the_base_is_reported_already_upstream(tmp_path, make_options, fake_repos):
    """A base between which and upstream the change was made and reverted: upstream hunk
    utils.py#1's result is already in the base file, its source is not."""
    from conftest import EXTRAS, LAYOUT, _utils, gdn_text, git

    mlm = tmp_path / "Megatron-LM"
    git(tmp_path, "clone", "-q", str(fake_repos.mlm), str(mlm))
    git(mlm, "checkout", "-q", "-b", "early", fake_repos.prereq)
    imports = "\nimport os\nimport sys\n"
    early = commit(mlm, {"megatron/core/utils.py": _utils(prefix=imports, alpha="value += 10")}, "early alpha")
    commit(mlm, {"megatron/core/utils.py": _utils(prefix=imports)}, "revert early alpha")
    upstream2 = commit(mlm, {
        "megatron/core/utils.py": _utils(prefix=imports, alpha="value += 10", omega="return total + 0"),
        "megatron/core/context_parallel_layout.py": LAYOUT, "megatron/core/extras.py": EXTRAS + "pad_between_seqs = True\n",
        "megatron/core/ssm/gated_delta_net.py": gdn_text(upstream=True),
        "tests/unit_tests/test_utils.py": "def test_alpha():\n    assert True\n"}, "upstream again")
    br = init_repo(tmp_path / "Megatron-Bridge")
    at_base = commit(br, {"src/megatron/bridge/__init__.py": '"""Bridge stand-in."""\n',
                          ".dev.commit": fake_repos.base + "\n"}, "bridge at base")
    at_early = commit(br, {".dev.commit": early + "\n"}, "bridge at early")
    data = recipe_data(fake_repos)
    data["pins"].update(megatron_bridge=at_base, upstream=upstream2, commits_between=5)
    b = build(make_options(write_recipe(tmp_path / "r.yaml", data), megatron_lm=str(mlm), megatron_bridge=str(br),
                           bridge=at_early))
    hunks = {h["id"]: h for h in b.manifest["retarget"]["upstream_hunks"]}
    assert hunks["megatron/core/utils.py#1"]["status"] == "already upstream"
    assert hunks["megatron/core/utils.py#1"]["detail"].startswith("its result is at megatron/core/utils.py:")
    assert hunks["megatron/core/utils.py#2"]["status"] == "verbatim"
    step = next(s for s in b.manifest["retarget"]["steps"] if s["id"] == "take-utils")
    assert step["status"] == "verbatim, some already upstream"
    assert "value += 10" not in b.patch.decode()  # nothing to add: the base has it


def test_pin_sweep_lists_the_later_pins_and_says_written_or_native(tmp_path, fake_repos, bridges, recipe_on):
    """bench/pin_sweep.py on the throwaway Bridge: at_prereq gets a patch, at_upstream is native."""
    import importlib.util
    import sys

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("pin_sweep", repo / "bench" / "pin_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    assert [c for c, _d in sweep.bridge_commits(str(bridges["repo"]), bridges["at_base"])] == [
        bridges["at_prereq"], bridges["at_upstream"]]
    assert sweep.distance(str(fake_repos.mlm), fake_repos.i1, fake_repos.upstream) == ("before", 2)
    assert sweep.distance(str(fake_repos.mlm), fake_repos.upstream, fake_repos.upstream) == ("contains", 0)
    assert sweep.main(["--mlm", str(fake_repos.mlm), "--bridge-repo", str(bridges["repo"]), "--recipe", str(recipe_on),
                       "--out", str(tmp_path / "res"), "--cache-dir", str(tmp_path / "c"),
                       "--python", sys.executable]) == 0
    rows = json.loads((tmp_path / "res" / "sweep.json").read_text())["rows"]
    assert [r["verdict"] for r in rows] == ["patch written", "native"]
    assert rows[0]["steps"]["prereq-resolve"] == "already present at the base" and rows[0]["exit"] == 0
    assert rows[1]["exit"] == 17 and rows[1]["fixes"]["fix-tuple-index"] == "needed"
    assert "| native | 17 |" in (tmp_path / "res" / "sweep.md").read_text()


def test_bridge_without_dev_commit_is_a_source_error_naming_it(tmp_path, make_options, fake_repos, recipe_on, bridges):
    from backport.errors import SourceError
    from conftest import git

    br = tmp_path / "Megatron-Bridge"
    git(tmp_path, "clone", "-q", str(bridges["repo"]), str(br))
    bare = commit(br, {".dev.commit": None}, "drop the pin")
    with pytest.raises(SourceError) as exc:
        build(make_options(recipe_on, megatron_bridge=str(br), bridge=bare))
    assert exc.value.exit_code == 3
    assert exc.value.message == f"Megatron-Bridge {bare[:12]} has no readable .dev.commit (the MCore base pin)."
    assert "--mcore-base SHA --allow-pin-mismatch" in exc.value.hint
    b = build(make_options(recipe_on, megatron_bridge=str(br), bridge=bare, mcore_base=fake_repos.i1,
                           allow_pin_mismatch=True))
    assert (b.manifest["pins"]["bridge_dev_commit"], b.manifest["pins"]["mcore_base"]) == (None, fake_repos.i1)
