"""backport.recipe: strict schema and the exactly-once coverage of upstream hunks."""

from __future__ import annotations

import copy
import hashlib

import pytest

from backport.errors import RecipeError
from backport.recipe import check_coverage, hunk_dispositions, load_recipe

from conftest import recipe_data, write_recipe

pytestmark = pytest.mark.usefixtures("engine_env")

UPSTREAM_IDS = [
    "megatron/core/context_parallel_layout.py#1",
    "megatron/core/extras.py#1",
    "megatron/core/ssm/gated_delta_net.py#1",
    "megatron/core/utils.py#1",
    "megatron/core/utils.py#2",
    "tests/unit_tests/test_utils.py#1",
]


def test_valid_recipe_loads_with_its_digest(recipe):
    loaded, digest = load_recipe(recipe)
    assert digest == hashlib.sha256(recipe.read_bytes()).hexdigest()
    assert loaded.name == "fake-gdn"
    assert [s.kind for s in loaded.steps] == ["upstream_file", "transplant", "upstream_hunks", "add_file",
                                              "adaptation", "fix"]


def _set(data, dotted, value):
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    if value is _DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


_DELETE = object()


@pytest.mark.parametrize("field, value, in_message", [
    ("surprise", 1, "surprise"),                                     # unknown top-level key
    ("pins.extra_pin", "x", "pins.extra_pin"),                       # unknown nested key
    ("steps.0.colour", "red", "colour"),                             # unknown step key
    ("name", _DELETE, "name"),                                       # missing field
    ("pins.commits_between", _DELETE, "pins.commits_between"),
    ("forbidden_strings", _DELETE, "forbidden_strings"),
    ("pins.upstream", "5139086e", "pins.upstream"),                  # short SHA in a pin
    ("pins.mcore_base", "Z" * 40, "pins.mcore_base"),                # not hex
    ("pins.megatron_bridge", "A" * 40, "pins.megatron_bridge"),      # upper case
    ("pins.commits_between", -1, "pins.commits_between"),
    ("schema_version", 2, "schema_version"),
    ("steps.0.kind", "teleport", "steps.0"),                         # unknown step kind
    ("steps.1.id", "Bad_Id", "steps.1"),
    ("steps.2.why", "short", "why"),
    ("steps.2.hunks", [], "hunks"),
    ("steps", [], "steps"),
    ("excluded.0.why", "tiny", "excluded.0.why"),
])
def test_schema_errors_name_the_field(tmp_path, fake_repos, field, value, in_message):
    data = copy.deepcopy(recipe_data(fake_repos))
    _set(data, field, value)
    path = write_recipe(tmp_path / "bad.yaml", data)
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    assert exc.value.exit_code == 5
    assert in_message in exc.value.message
    assert str(path) in exc.value.message


def test_duplicate_step_id_is_recipe_error(tmp_path, fake_repos):
    data = recipe_data(fake_repos)
    data["steps"][3]["id"] = data["steps"][0]["id"]
    with pytest.raises(RecipeError, match="duplicate step id 'take-layout'") as exc:
        load_recipe(write_recipe(tmp_path / "dup.yaml", data))
    assert exc.value.exit_code == 5


@pytest.mark.parametrize("content, in_message", [
    (None, "cannot read recipe"),
    (b"steps: [unclosed\n", "is not valid YAML"),
    (b"- just\n- a list\n", "is invalid"),
])
def test_unreadable_recipe_is_recipe_error(tmp_path, content, in_message):
    path = tmp_path / "r.yaml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(RecipeError, match=in_message) as exc:
        load_recipe(path)
    assert exc.value.exit_code == 5


def test_dispositions_of_the_fake_recipe(recipe):
    loaded, _ = load_recipe(recipe)
    assert check_coverage(loaded, UPSTREAM_IDS) == {
        "megatron/core/context_parallel_layout.py#1": ("verbatim", "take-layout"),
        "megatron/core/extras.py#1": ("excluded", "exclude-extras"),
        "megatron/core/ssm/gated_delta_net.py#1": ("adapted", "adapt-none-group"),
        "megatron/core/utils.py#1": ("verbatim", "take-utils"),
        "megatron/core/utils.py#2": ("verbatim", "take-utils"),
        "tests/unit_tests/test_utils.py#1": ("excluded", "exclude-tests"),
    }


def _drop_hunk(data, hid):
    data["steps"][2]["hunks"].remove(hid)


def _dup_hunk(data, hid):
    data["excluded"][0]["hunks"].append(hid)


def _unknown_hunk(data, hid):
    data["steps"][4]["adapts"].append(hid)


@pytest.mark.parametrize("edit, hid, in_message", [
    (_drop_hunk, "megatron/core/utils.py#2", "not accounted for: megatron/core/utils.py#2"),
    (_dup_hunk, "megatron/core/utils.py#1", "listed more than once: megatron/core/utils.py#1"),
    (_unknown_hunk, "megatron/core/utils.py#9", "not in the upstream commit: megatron/core/utils.py#9"),
])
def test_coverage_errors_list_the_hunks(tmp_path, fake_repos, edit, hid, in_message):
    data = recipe_data(fake_repos)
    edit(data, hid)
    loaded, _ = load_recipe(write_recipe(tmp_path / "r.yaml", data))
    with pytest.raises(RecipeError) as exc:
        check_coverage(loaded, UPSTREAM_IDS)
    assert exc.value.exit_code == 5
    assert in_message in exc.value.message
    assert "tools/backport --list-hunks" in exc.value.hint


def test_coverage_error_lists_every_problem_at_once(tmp_path, fake_repos):
    data = recipe_data(fake_repos)
    _drop_hunk(data, "megatron/core/utils.py#2")
    del data["excluded"][1]
    _dup_hunk(data, "megatron/core/ssm/gated_delta_net.py#1")
    _unknown_hunk(data, "nope.py#1")
    loaded, _ = load_recipe(write_recipe(tmp_path / "r.yaml", data))
    with pytest.raises(RecipeError) as exc:
        check_coverage(loaded, UPSTREAM_IDS)
    msg = exc.value.message
    assert "not accounted for: megatron/core/utils.py#2, tests/unit_tests/test_utils.py#1" in msg
    assert "listed more than once: megatron/core/ssm/gated_delta_net.py#1" in msg
    assert "not in the upstream commit: nope.py#1" in msg


def test_hunk_dispositions_keep_every_claim(tmp_path, fake_repos):
    data = recipe_data(fake_repos)
    _dup_hunk(data, "megatron/core/utils.py#1")
    loaded, _ = load_recipe(write_recipe(tmp_path / "r.yaml", data))
    assert hunk_dispositions(loaded)["megatron/core/utils.py#1"] == [
        ("verbatim", "take-utils"), ("excluded", "exclude-extras")]
