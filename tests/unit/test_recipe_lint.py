"""Recipe lint: every reason (step ``why``, exclusion ``why``) is whole.

The shipped recipe passes; a reason cut short by an unquoted `` #`` in YAML, an empty or a
too-short reason is a :class:`RecipeError` (exit 5) that says what to fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backport.errors import RecipeError
from backport.recipe import lint_reason, lint_yaml_reasons, load_recipe

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "manifests" / "gdn-chunkwise-cp.yaml"


def test_shipped_recipe_reasons_are_whole_sentences():
    recipe, _ = load_recipe(SHIPPED)
    reasons = [s.why for s in recipe.steps] + [e.why for e in recipe.excluded]
    assert reasons and all(lint_reason(r) == r for r in reasons)
    # the one that an unquoted ' #' used to cut short
    assert any("PR #5664 (THD route prebuild)" in r for r in reasons)


def test_unquoted_hash_in_a_reason_is_refused(tmp_path):
    text = SHIPPED.read_text(encoding="utf-8")
    quoted = '"TE attention boundaries for THD with pad_between_seqs belong to PR #5664'
    assert quoted in text
    line = next(ln for ln in text.splitlines() if quoted in ln)
    unquoted = line.replace('why: "', "why: ").rstrip('"')
    bad = tmp_path / "recipe.yaml"
    bad.write_text(text.replace(line, unquoted), encoding="utf-8")
    with pytest.raises(RecipeError) as exc:
        load_recipe(bad)
    assert exc.value.exit_code == 5
    assert "cut short" in exc.value.message and "PR #5664" in exc.value.message
    assert "double quotes" in exc.value.hint


@pytest.mark.parametrize("why, needle", [
    ("", "shorter than"),
    ("   ", "shorter than"),
    ("Out of scope.", "shorter than"),
])
def test_lint_names_the_problem(why, needle):
    with pytest.raises(ValueError, match=needle):
        lint_reason(why)


@pytest.mark.parametrize("why", [
    "Out of v1 scope for this backport.",
    "Upstream hunk belongs to PR #5664 (THD route prebuild)",
    "upstream tests stay upstream",
    "Keeps the base name (see decision 3).",
])
def test_lint_accepts_whole_sentences(why):
    assert lint_reason(why) == why


def test_quoted_and_block_reasons_with_hash_are_fine():
    text = 'steps:\n  - why: "belongs to PR #5664 (route)"\n    why: |\n      PR #5664\n'
    assert lint_yaml_reasons(text) == []
    assert lint_yaml_reasons("  - why: belongs to PR #5664 (route)\n") == ["line 1: - why: belongs to PR #5664 (route)"]


def test_every_cited_decision_is_defined_in_docs_decisions():
    import re

    recipe, _ = load_recipe(SHIPPED)
    reasons = " ".join([s.why for s in recipe.steps] + [e.why for e in recipe.excluded])
    cited = set()
    for group in re.findall(r"decisions? ((?:\d+[ab]?(?:, | and )?)+)", reasons):
        cited |= set(re.findall(r"\d+[ab]?", group))
    assert cited, "the recipe cites no decision: drop this test or docs/decisions.md"
    table = (REPO / "docs" / "decisions.md").read_text(encoding="utf-8")
    defined = set(re.findall(r"^\| (\d+[ab]?) \|", table, flags=re.M))
    assert cited <= defined, f"cited but not defined in docs/decisions.md: {sorted(cited - defined)}"



def test_a_plain_reason_continued_on_a_line_with_a_hash_is_refused():
    text = ("steps:\n  - id: a\n    why: Import FLA's build_cp_context beside the other kernels\n"
            "      as upstream PR #3282 does (applies verbatim).\n")
    assert lint_yaml_reasons(text) == ["line 4: as upstream PR #3282 does (applies verbatim)."]
    whole = text.replace("PR #3282", "PR 3282")
    assert lint_yaml_reasons(whole) == []
