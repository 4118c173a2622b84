"""Our lines against upstream's: which added lines of the output patch equal a line of the
upstream commit's version of the same file (the content half of a line's kind,
:func:`backport.patchfile.line_kinds`), and the manifest's "beyond upstream" table.

A reviewer checks that nothing beyond the feature slipped in. A hunk's origin (say, our
adaptation of the forward) says who put the lines there, not whose lines they are: a transform
re-emits many upstream lines verbatim. So every added line is also classed by content: ``upstream``
when, stripped of surrounding whitespace, it equals a line of the file at the upstream commit
(indentation may differ: our transforms re-indent), ``ours`` otherwise; a blank line has no class
(:func:`backport.patchfile.line_kinds` gives it its neighbour's kind).
"""

from __future__ import annotations

from typing import Iterable, Optional


def upstream_line_sets(source, commit: str, paths: Iterable[str]) -> dict[str, frozenset]:
    """For each path, the set of its non-blank lines (stripped) at ``commit`` in ``source``
    (a :class:`backport.sources.Source`); an empty set for a path upstream does not have."""
    tree = source.repo.commit(commit).tree
    out = {}
    for path in sorted(set(paths)):
        try:
            data = (tree / path).data_stream.read()
        except KeyError:
            out[path] = frozenset()
            continue
        text = data.decode("utf-8", errors="replace")
        out[path] = frozenset(s for s in (line.strip() for line in text.splitlines()) if s)
    return out


def line_class(text: str, upstream: Optional[frozenset]) -> Optional[str]:
    """``"upstream"``, ``"ours"``, or None for a blank line (``text`` without its newline)."""
    stripped = text.strip()
    if not stripped:
        return None
    return "upstream" if upstream and stripped in upstream else "ours"


def origin_line_totals(files: list) -> dict:
    """origin id -> {"added", "added_upstream", "added_ours", "added_carried"} summed over every
    output hunk (the kinds of :func:`backport.patchfile.line_kinds`)."""
    totals: dict = {}
    for f in files:
        for h in f["hunks"]:
            for o in h["origins"]:
                t = totals.setdefault(o["origin"], {"added": 0, "added_upstream": 0, "added_ours": 0,
                                                    "added_carried": 0})
                for key in t:
                    t[key] += o.get(key, 0)
    return dict(sorted(totals.items()))


def beyond_upstream_rows(recipe) -> list:
    """One row per ``beyond_upstream`` item of the recipe's steps, in step order: step, file, what,
    why, effect, evidence. The step's own line counts are in the manifest's ``lines_vs_upstream``
    (once per step: lines are attributed to steps, not to items)."""
    rows = []
    for step in recipe.steps:
        for item in step.beyond_upstream:
            rows.append({
                "step": step.id, "file": getattr(step, "path", ""), "what": item.what, "why": item.why,
                "effect": item.effect, "evidence": item.evidence,
            })
    return rows
