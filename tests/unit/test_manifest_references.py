"""Every reference in the manifest resolves: each citation in the recipe's reasons (decisions, RFC
sections, images, pull requests, commits, evidence paths) is covered by an entry of
manifests/gdn-chunkwise-cp.references.yaml, and every entry's target is a file of this repository
(a Markdown anchor included) or a public https URL. No network."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from backport.errors import RecipeError
from backport.manifest_md import render_markdown
from backport.recipe import load_references, references_path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "manifests" / "gdn-chunkwise-cp.yaml"

#: What counts as a citation in a reason: anything a reader would have to look up.
CITATIONS = [
    r"\b[Dd]ecisions? \d+[ab]?",
    r"\bRFC\b[ \d.]*",
    r"\b(?:Relax|old)\b[\w' ]*\bimage\b",
    r"\bthe image\b",
    r"#\d{3,}",
    r"\b(?:results|tests|docs)/[\w./-]*\w",
    r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{8,40}\b",
    r"\bFLA\b",
    r"\bv1 scope\b",
]


def _strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            if key not in ("hunks", "adapts", "path", "template", "transform", "symbols", "forbidden_strings",
                           "import_check", "pins", "id", "kind", "commit"):
                yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_citation_in_the_recipe_has_a_reference():
    refs = load_references(RECIPE)
    assert refs, "the recipe has a references file"
    missing = []
    for text in _strings(yaml.safe_load(RECIPE.read_text())):
        for pattern in CITATIONS:
            for cite in re.finditer(pattern, text):
                covered = any(m.start() < cite.end() and cite.start() < m.end()
                              for r in refs for m in re.finditer(r["pattern"], text))
                if not covered:
                    missing.append(cite.group(0))
    assert not missing, f"citations without an entry in {references_path(RECIPE).name}: {sorted(set(missing))}"


@pytest.mark.parametrize("ref", load_references(RECIPE), ids=lambda r: r["cites"])
def test_every_reference_resolves_to_a_repository_file_or_a_public_url(ref):
    target = ref["target"]
    if "://" in target:
        assert target.startswith("https://"), target
        return
    path, _, anchor = target.partition("#")
    assert (REPO / path).exists(), f"{ref['cites']}: {path} is not in the repository"
    if anchor:
        headings = [_slug(line.lstrip("#")) for line in (REPO / path).read_text().splitlines() if line.startswith("#")]
        assert anchor in headings, f"{ref['cites']}: no heading #{anchor} in {path} ({headings})"


def test_every_reference_pattern_is_used():
    """An entry no reason cites any more is stale (rename or remove it)."""
    text = "\n".join(_strings(yaml.safe_load(RECIPE.read_text())))
    unused = [r["cites"] for r in load_references(RECIPE) if not re.search(r["pattern"], text)]
    assert not unused


def test_manifest_md_lists_the_references():
    refs = load_references(RECIPE)
    m = {"date": "2026-01-02", "tool": {"name": "gdn-backport", "version": "0"},
         "recipe": {"path": "r.yaml", "sha256": "0" * 64},
         "pins": {"megatron_bridge": "a" * 40, "mcore_base": "b" * 40, "upstream": "c" * 40, "upstream_ref": "x",
                  "commits_between": 1, "prerequisites": []},
         "patch": {"name": "p.patch", "sha256": "d" * 64, "files": 0, "hunks": 0, "added": 0, "removed": 0,
                   "added_by_kind": {"upstream": 0, "ours": 0, "carried": 0}},
         "carry": None, "attribution": {"exact": 0, "by_neighbour": 0}, "files": [], "origins": {},
         "upstream_hunks": [], "upstream_summary": {}, "verification": [], "references": refs}
    md = render_markdown(m)
    assert f"## References ({len(refs)})" in md
    assert "| RFC 4.2 step 4 | `docs/references.md#rfc-section-42-dynamic-cp-integration` |" in md


def test_a_broken_references_file_is_refused_naming_it(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("x: 1\n")
    assert load_references(recipe) is None  # none beside it: the manifest has no References
    references_path(recipe).write_text("schema_version: 1\nreferences:\n  - cites: x\n    pattern: '('\n"
                                        "    target: /etc/passwd\n    what: y\n")
    with pytest.raises(RecipeError) as exc:
        load_references(recipe)
    assert "r.references.yaml" in exc.value.message and "pattern" in exc.value.message
    assert "target" in exc.value.message and exc.value.exit_code == 5
