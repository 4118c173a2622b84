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

from conftest import _utils, gdn_text, git_diff, recipe_data, write_recipe

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
], ids=["upstream-hunks", "transform", "renamed-away", "upstream-file"])
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
