"""The Markdown view of the manifest (for people); the JSON is the machine view.

Opens with the patch's added lines by kind (upstream / ours / carried); shows every origin with
its status, its placement offset (non-zero offsets are also listed above the table), for a
carried hunk whose context matched more than once how it was placed, and, for a carried hunk
the recipe supersedes, the step and the reason."""

from __future__ import annotations


def retarget_markdown(m: dict) -> list[str]:
    """Markdown lines of the manifest's ``retarget`` section (empty without one)."""
    r = m.get("retarget")
    if not r:
        return []
    from .retarget import report_counts

    lines = ["", "## Retargeted pins", "",
             f"Built on Megatron-Bridge `{m['pins']['megatron_bridge']}` (MCore base `{m['pins']['mcore_base']}`, "
             f"{m['pins']['commits_between']} commits before upstream, measured) instead of the recipe's Bridge "
             f"`{r['recipe_pins']['megatron_bridge']}` (base `{r['recipe_pins']['mcore_base']}`, declared "
             f"commits_between {r['recipe_pins']['commits_between']}).", "", "### Recipe steps at this base", ""]
    lines += _table(["step", "kind", "status", "detail"],
                    [[f"`{s['id']}`", s["kind"], s["status"], s["detail"]] for s in r["steps"]])
    lines += ["", "### Upstream hunks at this base", "",
              ", ".join(f"{k}: {v}" for k, v in report_counts(r).items()), ""]
    lines += _table(["upstream hunk", "status", "detail"],
                    [[f"`{h['id']}`", h["status"], h["detail"]] for h in r["upstream_hunks"]])
    return lines


def _table(headers: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return out


def _carry_line(carry) -> str:
    if not carry:
        return "none"
    return f"`{carry['name']}` (sha256 `{carry['sha256']}`, {len(carry['hunks'])} hunks)"


def _vs_upstream(o: dict) -> str:
    if "added_upstream" not in o or o["kind"] in ("upstream-verbatim", "carried"):
        return ""
    return f"; {o['added_upstream']} up, {o['added_ours']} ours"


def _beyond_upstream(m: dict) -> list[str]:
    rows = m.get("beyond_upstream")
    if rows is None:
        return []
    totals = m.get("lines_vs_upstream", {})
    out = ["", f"## Beyond upstream ({len(rows)})", "",
           "What the recipe adds that the upstream commit does not, one row per item. `ours (step)` is the "
           "step's added lines of kind `ours`, given once on the step's first row: lines are attributed to "
           "steps, not to items, so the step's later rows add nothing to it.", ""]
    table, seen = [], set()
    for r in rows:
        first = r["step"] not in seen
        seen.add(r["step"])
        ours = totals.get(r["step"], {}).get("added_ours", 0) if first else "(same step)"
        table.append([f"`{r['step']}`", ours, f"`{r['file']}`", r["what"], r["why"], r["effect"], r["evidence"]])
    out += _table(["step", "ours (step)", "file", "what", "why", "effect", "evidence"], table)
    return out


def _kinds(counts: dict) -> str:
    """``"3 upstream, 2 ours"`` (kinds with a count only; ``"none"`` when there is none)."""
    return ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "none"


def total_line(m: dict) -> str:
    """The line ``manifest.md`` opens with: the patch's added lines by kind (upstream / ours / carried)."""
    k = m["patch"].get("added_by_kind")
    if k is None:
        return f"Added lines: {m['patch']['added']} (this manifest has no per-line kinds)."
    return (f"**Added lines: {k['upstream']} from upstream, {k['ours']} ours, {k['carried']} carried** "
            f"(of {m['patch']['added']}; each line's origin: `tools/backport annotate [HUNK ...]`).")


def _references(m: dict) -> list[str]:
    refs = m.get("references")
    if not refs:
        return []
    out = ["", f"## References ({len(refs)})", "",
           "Where each citation in the reasons above resolves: a path in the gdn-backport repository, or a "
           "public URL.", ""]
    out += _table(["cited as", "resolves to", "what is there"],
                  [[r["cites"], f"`{r['target']}`" if "://" not in r["target"] else r["target"], r["what"]]
                   for r in refs])
    return out


def _base_rows(m: dict) -> list[list]:
    """The MCore base row(s) of the pins table: one row when the base is the Bridge pin's
    ``.dev.commit``; when ``--allow-pin-mismatch`` let another base through, the base used and
    the ``.dev.commit`` on two rows, both commits in full, the mismatch said."""
    p = m["pins"]
    dev = p.get("bridge_dev_commit", p["mcore_base"])
    if dev == p["mcore_base"]:
        return [["Megatron-Core base (= Bridge .dev.commit)", f"`{p['mcore_base']}`"]]
    return [["Megatron-Core base (differs from Bridge .dev.commit; allowed by --allow-pin-mismatch)",
             f"`{p['mcore_base']}`"],
            ["Megatron-Bridge .dev.commit (not used as the base)", f"`{dev}`"]]


def render_markdown(m: dict) -> str:
    """Render manifest dict ``m`` as Markdown (deterministic)."""
    p = m["pins"]
    lines = [
        f"# megatron.patch manifest ({m['date']})",
        "",
        total_line(m),
        "",
        f"Generated by {m['tool']['name']} {m['tool']['version']} from recipe `{m['recipe']['path']}` "
        f"(sha256 `{m['recipe']['sha256'][:16]}…`).",
        "Line kinds: `upstream` (an upstream hunk or prerequisite, or a line of ours equal to a line of the "
        "upstream commit's file), `ours` (written by a recipe step), `carried` (the `--carry` patch). "
        "Output hunks are `out:<path>#<n>`; upstream hunks `<path>#<n>`; carried hunks `carry:<path>#<n>`. "
        "Citations (\"decision N\", \"RFC 4.2\", images) resolve under References below"
        + (" (`docs/decisions.md` of the gdn-backport repository for decisions)." if not m.get("references") else "."),
        "",
        "## Pins",
        *_table(["input", "commit"], [
            ["Megatron-Bridge", f"`{p['megatron_bridge']}`"],
            *_base_rows(m),
            ["upstream feature", f"`{p['upstream']}` ({p['upstream_ref']}, {p['commits_between']} commits after base)"],
            *[["prerequisite", f"`{c}`"] for c in p["prerequisites"]],
        ]),
        "",
        "## Patch",
        f"`{m['patch']['name']}`: sha256 `{m['patch']['sha256']}`, {m['patch']['files']} files, "
        f"{m['patch']['hunks']} hunks, +{m['patch']['added']} -{m['patch']['removed']}.",
        f"Carried downstream patch: {_carry_line(m['carry'])}.",
        f"Line attribution: {m['attribution']['exact']} lines exact, {m['attribution']['by_neighbour']} by neighbour in the same hunk.",
        "",
        "## Output hunks and their origins",
    ]
    if "lines_vs_upstream" in m:
        lines += ["", "`added by kind` counts the hunk's added lines by kind; each origin's own split is in "
                  "brackets (`up` / `ours`). A blank line counts with the nearest line of its origin. An "
                  "origin's `+A -R` are the lines it put in, added and removed: summed by origin kind they are "
                  "the run summary's `lines by origin` (added + removed), which is why that row does not equal "
                  "`added lines by kind`.", ""]
    rows = []
    for f in m["files"]:
        for h in f["hunks"]:
            origins = "; ".join(f"{o['origin']} ({o['kind']}, +{o['added']} -{o['removed']}{_vs_upstream(o)})"
                                for o in h["origins"])
            rows.append([f"`{h['id']}`", f"`{h['header'].split(' @@')[0]} @@`", f"+{h['added']} -{h['removed']}",
                         _kinds(h["added_by_kind"]) if "added_by_kind" in h else "", origins])
    lines += _table(["output hunk", "header", "lines", "added by kind", "origin"], rows)
    lines += _beyond_upstream(m)
    lines += ["", "## Origins", ""]
    offsets = [(oid, o["offset"]) for oid, o in m["origins"].items() if o.get("offset")]
    if offsets:
        lines += [f"Placed at an offset from their header line ({len(offsets)}): "
                  + ", ".join(f"`{oid}` {off:+d}" for oid, off in offsets) + ".", ""]
    rows = []
    for oid, o in m["origins"].items():
        why = o.get("why", "")
        if why and not why.rstrip().endswith((".", ")", ":")):
            why = why.rstrip() + "."
        if o.get("status") == "superseded":
            why += f" Superseded by `{o.get('superseded_by', '?')}`: {o.get('superseded_why', '')}"
        for kept in o.get("kept_forms") or []:
            why += "" if not why or why.endswith(".") else "."
            why += (f" Kept in the carried form: `{' '.join(kept['wrapper'][0].split())}` around "
                    f"`{', '.join(kept['around'])}` in step `{kept['step']}`'s new `{kept['symbol']}` "
                    f"(preserved fix `{kept['fix']}`).")
        if o.get("placed"):  # a carried hunk whose context matched more than once
            why += "" if not why or why.endswith(".") else "."
            why += (f" Its context matches at lines {', '.join(map(str, o.get('matches', [])))} of the base: placed "
                    + ("at the line its header names" if o["placed"] == "header" else
                       "at the match nearest the line its header names") + ", as `git apply` does.")
        offset = f"{o['offset']:+d}" if o.get("offset") else ("0" if "offset" in o else "")
        made_by = next((f"{key} `{o[key]}`" for key in ("transform", "template") if o.get(key)), "")
        if not made_by and o.get("step"):
            made_by = f"step `{o['step']}`"
        if o.get("symbols"):
            made_by = (made_by + "; " if made_by else "") + f"`{o.get('commit', '')[:9]}`: " + ", ".join(
                f"`{sym}`" for sym in o["symbols"])
        adapts = ", ".join(f"`{h}`" for h in o.get("adapts") or [])
        if o["kind"] == "preserved-fix":
            why += f" Source: {o.get('source') or 'not given (the recipe step has no `source`)'}."
        totals = m.get("lines_vs_upstream", {}).get(oid)
        if totals and o["kind"] not in ("upstream-verbatim", "carried"):
            why += f" Added lines: {totals['added_upstream']} as upstream, {totals['added_ours']} ours."
        rows.append([f"`{oid}`", o["kind"], o.get("status", "applied"), offset, made_by, adapts, why])
    lines += _table(["origin", "kind", "status", "offset", "made by", "adapts (upstream hunks)", "why"], rows)
    lines += ["", f"## Upstream hunks of {p['upstream'][:9]} ({len(m['upstream_hunks'])})", "",
              ", ".join(f"{k}: {v}" for k, v in m["upstream_summary"].items()), ""]
    rows = [[f"`{u['id']}`", f"+{u['added']} -{u['removed']}", u["disposition"], f"`{u['by']}`", u.get("reason", "")]
            for u in m["upstream_hunks"]]
    lines += _table(["upstream hunk", "lines", "disposition", "by", "reason (excluded)"], rows)
    lines += _references(m)
    lines += ["", "## Verification", ""]
    lines += _table(["check", "ok", "detail"], [[c["check"], "yes" if c["ok"] else "SKIPPED", c["detail"]] for c in m["verification"]])
    lines += retarget_markdown(m)
    return "\n".join(lines) + "\n"
