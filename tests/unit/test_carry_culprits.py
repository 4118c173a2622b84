"""Every refusal names the right culprit (issue 23, part 4): a failure the carried patch causes
blames the carried hunk or section (not the recipe, an upstream hunk or the pins), and one the
recipe causes without a carry keeps the recipe's message.

Small inputs of our own: the fake Megatron-LM/Bridge repositories of ``conftest`` and carries
made with ``git diff`` on copies of their files.
"""

from __future__ import annotations

import pytest

from backport.engine import build
from backport.errors import ApplyError

from conftest import PACKED, _utils, gdn_text, git_diff, recipe_data, write_recipe

pytestmark = pytest.mark.usefixtures("engine_env")

UTILS = "megatron/core/utils.py"
GDN = "megatron/core/ssm/gated_delta_net.py"


def _carry(tmp_path, before: dict, after: dict, name: str = "down.patch"):
    path = tmp_path / name
    path.write_text(git_diff(tmp_path / f"src-{name}", before, after))
    return path


def _refusal(make_options, recipe, carry=None) -> ApplyError:
    with pytest.raises(ApplyError) as exc:
        build(make_options(recipe, carry=carry))
    assert exc.value.exit_code == 6
    return exc.value


# --- a carry that deletes (or renames away) a file a recipe step edits or takes -------------------

def _take_utils_whole(data):
    step = next(s for s in data["steps"] if s["id"] == "take-utils")
    step.clear()
    step.update({"id": "take-utils", "kind": "upstream_file", "path": UTILS,
                 "hunks": [f"{UTILS}#1", f"{UTILS}#2"], "why": "the whole upstream file is taken"})


@pytest.mark.parametrize("path, text, after, edit, step, verb", [
    (UTILS, _utils(), {UTILS: None}, None, "take-utils (upstream_hunks)", "edits"),
    (GDN, gdn_text(), {GDN: None}, None, "adapt-none-group (transform gdn_local_cp_none_group)", "edits"),
    (UTILS, _utils(), {UTILS: None, "megatron/core/utils2.py": _utils()}, None, "take-utils (upstream_hunks)",
     "edits"),
    (UTILS, _utils(), {UTILS: None}, _take_utils_whole, "take-utils (upstream_file)", "takes whole from upstream"),
    ("megatron/core/packed_seq_params.py", PACKED, {"megatron/core/packed_seq_params.py": None}, None,
     "prereq-resolve (transplant)", "edits"),
], ids=["upstream-hunks", "transform", "renamed-away", "upstream-file", "transplant"])
def test_a_carry_deleting_a_file_a_step_needs_is_blamed_on_the_carry(tmp_path, fake_repos, make_options,
                                                                     path, text, after, edit, step, verb):
    data = recipe_data(fake_repos)
    if edit:
        edit(data)
    recipe = write_recipe(tmp_path / "r.yaml", data)
    carry = _carry(tmp_path, {path: text}, after)
    exc = _refusal(make_options, recipe, carry)
    gone = f"renames {path} to megatron/core/utils2.py" if len(after) == 2 else f"deletes {path}"
    assert exc.message == (f"carried patch down.patch {gone} (its file section 1), a file recipe step {step} "
                           f"{verb}; the step cannot run on a file the carry removed.")
    assert exc.hint.startswith(f"Keep {path} in the carried patch (drop its ")
    assert "update the recipe step" not in exc.hint


# --- a carried hunk that changes lines an upstream hunk needs as in the base ----------------------

UPSTREAM = "upstream hunk megatron/core/utils.py#1 (@@ -6,7 +6,7 @@) of recipe step take-utils"


@pytest.mark.parametrize("old, new, header, change", [
    ("    value += 1\n", "    value += 2\n", "@@ -3,7 +3,7 @@",  # the line the upstream hunk edits
     "replaces line 6 '    value += 1' by '    value += 2'"),
    ("    value *= 2\n", "    value *= 3\n", "@@ -4,7 +4,7 @@",  # a context line after it
     "replaces line 7 '    value *= 2' by '    value *= 3'"),
    ("    value = 0\n", "    value = 0\n    # downstream note\n", "@@ -3,6 +3,7 @@",  # inserted inside
     "adds '    # downstream note' inside lines 3-9"),
    ("def alpha():\n", "", "@@ -1,7 +1,6 @@",  # a context line removed
     "removes line 4 'def alpha():'"),
], ids=["edits-its-line", "edits-its-context", "inserts-inside", "removes-context"])
def test_a_carry_overlapping_an_upstream_hunk_is_named_not_the_upstream_hunk(tmp_path, recipe, make_options,
                                                                           old, new, header, change):
    base = _utils()
    assert base.count(old) == 1
    carry = _carry(tmp_path, {UTILS: base}, {UTILS: base.replace(old, new)})
    exc = _refusal(make_options, recipe, carry)
    assert exc.message == (
        f"carried hunk 1 of {UTILS} (carry:{UTILS}#1, {header}) {change}, inside the lines {UPSTREAM} needs as in "
        "the base (lines 3-9): after the carry that hunk no longer applies verbatim (it applies without the carry).")
    assert exc.hint.startswith("The carry is applied before the recipe. If the recipe's upstream hunk makes your "
                               f"change unnecessary, drop carry:{UTILS}#1 from the carried patch; else edit it")
    assert f"leaves lines 3-9 of {UTILS} alone" in exc.hint
    assert f"move {UTILS}#1 from step take-utils to the recipe's `excluded:` list" in exc.hint
    assert "Regenerate" not in exc.hint and "update the recipe step" not in exc.hint


def test_a_carry_making_the_upstream_change_itself_says_so(tmp_path, recipe, make_options):
    base = _utils()
    carry = _carry(tmp_path, {UTILS: base}, {UTILS: base.replace("value += 1\n", "value += 10\n")})
    exc = _refusal(make_options, recipe, carry)
    assert exc.message.startswith(f"carried hunk 1 of {UTILS} (carry:{UTILS}#1, @@ -3,7 +3,7 @@) replaces line 6")
    assert exc.message.endswith("(it applies without the carry); the carry already makes that hunk's change.")


@pytest.mark.parametrize("old, new", [
    ("    return 0\n", "    return 100\n"),  # line 12, three lines after the upstream hunk's last
    ("    return value\n\n\n", "    return value\n\n# note\n\n"),  # inserted right after its last line (9)
], ids=["three-lines-after", "right-after"])
def test_a_carry_editing_next_to_the_upstream_hunk_but_outside_its_lines_carries(tmp_path, recipe, make_options,
                                                                                old, new):
    base = _utils()
    assert base.count(old) == 1
    carry = _carry(tmp_path, {UTILS: base}, {UTILS: base.replace(old, new)})
    b = build(make_options(recipe, carry=carry))
    assert b.manifest["origins"][f"carry:{UTILS}#1"]["status"] == "applied"
    assert b.manifest["origins"][f"{UTILS}#1"]["kind"] == "upstream-verbatim"


# --- without the carry to blame, the recipe's message stays (with a hint for an upstream hunk) ----

def _run_on(tmp_path, fake_repos, make_options, recipe, utils_text, carry=None, path=UTILS):
    """The recipe run in memory on a copy of the fake base tree whose ``path`` is ``utils_text``."""
    import shutil

    from backport import engine
    from backport.recipe import load_recipe
    from backport.sources import open_source
    from backport.upstream import load_hunks

    base_tree = build(make_options(recipe)).base_tree
    tree = tmp_path / "base-copy"
    shutil.copytree(base_tree, tree)
    (tree / path).write_text(utils_text)
    mlm = open_source("megatron-lm", str(fake_repos.mlm), tmp_path / "cache")
    hunks = {h.id: h for h in load_hunks(mlm, fake_repos.upstream)}
    run = engine._Run(load_recipe(recipe)[0], mlm, fake_repos.upstream, hunks, tree, carry)
    with pytest.raises(ApplyError) as exc:
        run.apply()
    assert exc.value.exit_code == 6
    return exc.value


def test_an_upstream_hunk_the_base_breaks_keeps_the_recipe_message_with_an_upstream_hint(tmp_path, fake_repos,
                                                                                       make_options, recipe):
    moved = _utils(alpha="value += 7")
    exc = _run_on(tmp_path, fake_repos, make_options, recipe, moved)
    assert exc.message.startswith(f"step take-utils: {UTILS}: hunk at line 6 (import sys) of origin {UTILS}#1 does "
                                  "not apply with zero fuzz")
    assert exc.hint.startswith(f"The base differs from upstream's parent where this hunk goes: take {UTILS}#1 out "
                               "of step take-utils and make its change with a transform step")
    # a carry on that file that does not touch those lines is not blamed: the hunk fails without it too
    carry = _carry(tmp_path, {UTILS: moved}, {UTILS: moved.replace("    return 0\n", "    return 100\n")})
    again = _run_on(tmp_path / "with-carry", fake_repos, make_options, recipe, moved, carry)
    assert again.message == exc.message and again.hint == exc.hint


def test_an_upstream_hunk_already_in_the_base_is_told_to_be_excluded_not_dropped_from_a_carry(
        tmp_path, fake_repos, make_options, recipe):
    exc = _run_on(tmp_path, fake_repos, make_options, recipe, _utils(alpha="value += 10"))
    assert "is already applied: its result is already in the file" in exc.message
    assert exc.hint == (f"The pinned base already holds upstream hunk {UTILS}#1's change: move it from step "
                        "take-utils to the recipe's `excluded:` list with a why (e.g. 'already in the base').")


# --- a carry that removes what a transform step anchors on ----------------------------------------

def test_a_carry_removing_a_transforms_anchor_is_named_not_the_recipe(tmp_path, recipe, make_options):
    base = gdn_text()
    carry = _carry(tmp_path, {GDN: base},
                   {GDN: base.replace("def get_parameter_local_cp(", "def get_parameter_local_cp_v2(")})
    exc = _refusal(make_options, recipe, carry)
    assert exc.message == (
        f"carried hunk 1 of {GDN} (carry:{GDN}#1, @@ -25,7 +25,7 @@) removes or changes what recipe step "
        f"adapt-none-group (transform gdn_local_cp_none_group) anchors on: {GDN}: anchor function "
        f"'get_parameter_local_cp' not found; the step runs on {GDN} without the carried patch.")
    assert exc.hint.startswith(f"Edit carry:{GDN}#1 (still a diff against the pinned base) so that it keeps the "
                               "step's anchor as in the base, or drop it")
    assert "update the recipe step" not in exc.hint


def test_a_transform_whose_anchor_the_base_lacks_keeps_the_recipe_message_with_or_without_a_carry(
        tmp_path, fake_repos, make_options, recipe):
    moved = gdn_text().replace("def get_parameter_local_cp(", "def local_cp_slice(")
    exc = _run_on(tmp_path, fake_repos, make_options, recipe, moved, path=GDN)
    assert exc.message == f"recipe step adapt-none-group ({GDN}): anchor function 'get_parameter_local_cp' not found."
    assert exc.hint == ApplyError.default_hint  # the base changed under the recipe: update the step
    carry = _carry(tmp_path, {GDN: moved}, {GDN: moved.replace("cp_rank = cp_group.rank()", "cp_rank = 0")})
    again = _run_on(tmp_path / "with-carry", fake_repos, make_options, recipe, moved, carry, path=GDN)
    assert (again.message, again.hint) == (exc.message, exc.hint)


# --- upstream_file over a file the carry already made upstream's ---------------------------------

def test_a_carry_making_a_file_upstreams_names_the_carry_not_the_base(tmp_path, fake_repos, make_options):
    data = recipe_data(fake_repos)
    _take_utils_whole(data)
    recipe = write_recipe(tmp_path / "r.yaml", data)
    upstream = _utils(prefix="\nimport os\nimport sys\n", alpha="value += 10", omega="return total + 0")
    carry = _carry(tmp_path, {UTILS: _utils()}, {UTILS: upstream})
    exc = _refusal(make_options, recipe, carry)
    assert exc.message.startswith(f"carried patch down.patch makes {UTILS} identical to upstream's file (carry:{UTILS}#1")
    assert exc.message.endswith("which recipe step take-utils (upstream_file) takes whole; the step would change "
                                "nothing.")
    assert exc.hint == f"Drop {UTILS} from the carried patch: step take-utils takes the same file from upstream."
    assert "at the base" not in exc.message


def test_a_superseded_entry_for_the_overlapping_hunk_is_said_not_to_apply(tmp_path, fake_repos, make_options):
    data = recipe_data(fake_repos)
    data["superseded"] = [{"hunk": f"carry:{UTILS}#1", "step": "take-utils", "why": "upstream makes the same change"}]
    recipe = write_recipe(tmp_path / "r.yaml", data)
    base = _utils()
    carry = _carry(tmp_path, {UTILS: base}, {UTILS: base.replace("value += 1\n", "value += 2\n")})
    exc = _refusal(make_options, recipe, carry)
    assert exc.message.startswith(f"carried hunk 1 of {UTILS} (carry:{UTILS}#1, @@ -3,7 +3,7 @@) replaces line 6")
    assert f"the recipe's `superseded` entry for carry:{UTILS}#1 does not help here" in exc.message


def test_a_carry_adding_a_file_an_upstream_hunk_creates_names_the_carry(tmp_path, fake_repos, make_options):
    layout = "megatron/core/context_parallel_layout.py"
    data = recipe_data(fake_repos)
    data["steps"][0] = {"id": "take-layout", "kind": "upstream_hunks", "hunks": [f"{layout}#1"],
                        "why": "the new upstream module applied as a hunk"}
    recipe = write_recipe(tmp_path / "r.yaml", data)
    carry = _carry(tmp_path, {"megatron/core/x.py": "X = 1\n"}, {"megatron/core/x.py": "X = 1\n", layout: "MINE = 1\n"})
    exc = _refusal(make_options, recipe, carry)
    assert exc.message == (f"carried patch down.patch adds {layout} (carry:{layout}#1), a file upstream hunk {layout}#1 "
                           "of recipe step take-layout creates; the upstream hunk cannot create it again.")
    assert exc.hint.startswith(f"Drop {layout} from the carried patch: step take-layout creates it from upstream")


@pytest.mark.parametrize("text, reason, starts", [
    ("x = 1\n", "exists", "The pinned base already has the file upstream hunk p.py#1 creates"),
    ('def f():\n    a = 1\n    b = 2\n    c = 3\n', "elsewhere", "At the base this code sits in another class"),
    ('def g():\n    a = 1\n    b = 2\n    c = 3\n    a = 1\n    b = 2\n    c = 3\n', "twice",
     "At the base the hunk's context matches several times"),
], ids=["exists", "elsewhere", "twice"])
def test_upstream_hunk_placement_refusals_get_a_recipe_hint_not_a_carry_hint(text, reason, starts):
    from unidiff import PatchSet

    from backport.engine import _upstream_hint
    from backport.workspace import FileState

    if reason == "exists":
        diff = "--- /dev/null\n+++ b/p.py\n@@ -0,0 +1 @@\n+y = 2\n"
        symbol = None
    else:
        diff = "--- a/p.py\n+++ b/p.py\n@@ -2,3 +2,3 @@ def g():\n     a = 1\n-    b = 2\n+    b = 20\n     c = 3\n"
        symbol = "g"
    (hunk,) = [h for f in PatchSet(diff) for h in f]
    with pytest.raises(ApplyError) as exc:
        FileState.from_base("p.py", text).apply_hunk(hunk, "p.py#1", source_symbol=symbol)
    assert exc.value.reason == reason
    hint = _upstream_hint(exc.value, "take-p", "p.py#1")
    assert hint.startswith(starts) and "excluded:" in hint
    assert "carried patch" not in hint and "-U5" not in hint and "Regenerate" not in hint
