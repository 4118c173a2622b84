"""``tools/backport annotate``: the output patch printed with one provenance tag per line in a margin.

Reads a patch and the manifest written with it (``patches/latest/`` by default) and prints every
line of the selected output hunks, each behind a margin holding its kind (``upstream``, ``ours``,
``carried``; ``removed`` for a removed line), its origin (upstream hunk id, recipe step id or
carried hunk id) and its line number in the patched file. The patch file itself is only read: it
stays a valid patch. ``--kind`` keeps the added lines of some kinds only, so "which added lines of
gated_delta_net.py are not from upstream?" is ``tools/backport annotate gated_delta_net.py --kind
ours,carried``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Iterable, Optional

import click
from unidiff import PatchSet
from unidiff.errors import UnidiffParseError

from .errors import PipelineError, UsageError
from .gitpath import patch_path
from .patchfile import LINE_KINDS, OUTPUT_HUNK_PREFIX
from .readers import manifest_against_patch, manifest_view
from .workspace import split_lines

REPO_ROOT = Path(__file__).resolve().parent.parent
_REMAKE = "Run `make patch` (or `tools/backport`) to write the patch and its manifest again, then annotate."


def load(patch: Path, manifest: Path) -> tuple[str, dict]:
    """The patch text and the manifest dict, checked to belong together and to carry per-line kinds.

    Raises:
        UsageError: a file is missing or unreadable, the manifest is not one, was written for
            other patch bytes, or predates per-line provenance.
    """
    try:
        data = patch.read_bytes()
    except OSError as exc:
        raise UsageError(f"annotate: cannot read the patch {patch}: {exc.strerror}", hint=_REMAKE) from exc
    try:
        m = json.loads(manifest.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"annotate: cannot read the manifest {manifest}: {exc.strerror}", hint=_REMAKE) from exc
    except ValueError as exc:
        raise UsageError(f"annotate: {manifest} is not JSON ({exc})", hint=_REMAKE) from exc
    if not isinstance(m, dict) or "files" not in m or "patch" not in m:
        raise UsageError(f"annotate: {manifest} is not a gdn-backport manifest", hint=_REMAKE)
    try:
        older = any("lines" not in h for f in m["files"] for h in f["hunks"])
    except (TypeError, KeyError):
        older = False  # malformed: manifest_view names the field
    if older:
        raise UsageError(f"annotate: the manifest {manifest} has no per-line provenance (written by an older "
                         "gdn-backport)", hint=_REMAKE)
    manifest_view(m, manifest, "annotate", _REMAKE)
    digest = hashlib.sha256(data).hexdigest()
    if m["patch"]["sha256"] != digest:
        raise UsageError(f"annotate: the patch {patch} (sha256 {digest[:12]}) is not the one the manifest {manifest} "
                         f"describes ({m['patch']['sha256'][:12]}, {m['patch']['name']})",
                         hint="Pass the manifest written with that patch (--manifest), or " + _REMAKE[0].lower() + _REMAKE[1:])
    try:
        text = data.decode("utf-8")
        patch_set = PatchSet(split_lines(text))
    except (UnicodeDecodeError, UnidiffParseError) as exc:
        raise UsageError(f"annotate: the patch {patch} cannot be read as a patch ({exc})", hint=_REMAKE) from exc
    manifest_against_patch(m, patch_set, lambda pfile, n: f"{OUTPUT_HUNK_PREFIX}{patch_path(pfile)}#{n}", manifest,
                           patch, "annotate", _REMAKE)
    return text, m


def select(m: dict, selectors: Iterable[str]) -> list[str]:
    """Output hunk ids chosen by ``selectors`` (all hunks when none), in patch order.

    A selector is an output hunk id (``out:<path>#<n>``), a file (its path, or its name or any
    trailing part of its path: ``gated_delta_net.py``), or an origin id (an upstream hunk
    ``<path>#<n>``, a recipe step, a carried hunk ``carry:<path>#<n>``): the output hunks holding
    lines of that origin.

    Raises:
        UsageError: a selector matches nothing (the message lists what it could have been).
    """
    hunks = [(f["path"], h) for f in m["files"] for h in f["hunks"]]
    chosen: set = set()
    for sel in selectors:
        found = {h["id"] for _p, h in hunks if h["id"] == sel}
        if not found:
            found = {h["id"] for p, h in hunks if p == sel or p.endswith("/" + sel.strip("/"))}
        if not found:
            found = {h["id"] for _p, h in hunks if any(o["origin"] == sel for o in h["origins"])}
        if not found:
            excluded = next((u for u in m.get("upstream_hunks", []) if u["id"] == sel
                             and u["disposition"] == "excluded"), None)
            if excluded is not None:
                raise UsageError(
                    f"annotate: {sel} is an upstream hunk the recipe excluded"
                    + (f" (step {excluded['by']})" if excluded.get("by") else "")
                    + f": {excluded.get('reason') or 'no reason recorded'}; no line of this patch comes from it",
                    hint="Pick a hunk the recipe took (verbatim or adapted: `tools/backport --summary` counts them, "
                         "manifest.md lists each upstream hunk with its disposition), or read the reason in "
                         "manifest.md's upstream hunks table.")
            files = ", ".join(sorted({p for p, _h in hunks}))
            raise UsageError(
                f"annotate: {sel!r} names no output hunk, file or origin of this patch (files: {files})",
                hint=f"Pass an output hunk id ({hunks[0][1]['id'] if hunks else OUTPUT_HUNK_PREFIX + '<path>#<n>'}), "
                     "a file (gated_delta_net.py), an upstream hunk id, a recipe step id or a carried hunk id; "
                     "`tools/backport --summary` and manifest.md list them.")
        chosen |= found
    return [h["id"] for _p, h in hunks if not selectors or h["id"] in chosen]


def annotate(patch_text: str, m: dict, hunk_ids: list[str], kinds: Optional[set] = None) -> list[str]:
    """The lines to print: each patch line of the chosen hunks behind its provenance margin.

    Without ``kinds``: file headers, hunk headers (margin: the output hunk id), context lines
    (blank margin), removed lines (``removed`` and the origin that removed them) and added lines
    (kind and origin). With ``kinds``: only the added lines of those kinds, under their file and
    hunk headers.
    """
    records = {h["id"]: h for f in m["files"] for h in f["hunks"]}
    rows: list[tuple[str, str, str, str]] = []  # kind, origin, line number, patch line
    for pfile in PatchSet(split_lines(patch_text)):
        path = patch_path(pfile)
        file_rows: list = []
        for n, hunk in enumerate(pfile, start=1):
            hid = f"{OUTPUT_HUNK_PREFIX}{path}#{n}"
            if hid not in hunk_ids:
                continue
            rec = records[hid]
            added = [(r["kind"], r["origin"]) for r in rec["lines"] for _ in range(r["n"])]
            removed = [r["origin"] for r in rec.get("removed_lines", []) for _ in range(r["n"])]
            body: list = []
            for line in hunk:
                text = str(line).rstrip("\n")
                if line.is_added:
                    kind, origin = added.pop(0)
                    if kinds is None or kind in kinds:
                        body.append((kind, origin, str(line.target_line_no), text))
                elif kinds is not None:
                    continue
                elif line.is_removed:
                    body.append(("removed", removed.pop(0) if removed else "?", "", text))
                else:
                    body.append(("", "", str(line.target_line_no or ""), text))
            if body or kinds is None:
                file_rows.append(("", hid, "", str(hunk).splitlines()[0]))
                file_rows += body
        if file_rows:
            rows.append(("", "", "", f"--- {pfile.source_file}"))
            rows.append(("", "", "", f"+++ {pfile.target_file}"))
            rows += file_rows
    width = min(max([len(o) for _k, o, _n, _t in rows] + [6]), 60)
    num = max([len(n) for _k, _o, n, _t in rows] + [1])
    return [f"{k:<8} {o:<{width}} {n:>{num}} | {t}" for k, o, n, t in rows]


def totals(m: dict, hunk_ids: list[str]) -> str:
    """One line: the chosen hunks' added lines by kind."""
    counts = {k: 0 for k in LINE_KINDS}
    for f in m["files"]:
        for h in f["hunks"]:
            if h["id"] in hunk_ids:
                for r in h["lines"]:
                    counts[r["kind"]] += r["n"]
    return (f"{len(hunk_ids)} output hunks: " + ", ".join(f"{n} {k}" for k, n in counts.items())
            + " added lines")


def _kinds_option(value: Optional[str]) -> Optional[set]:
    if not value:
        return None
    kinds = {k.strip() for k in value.split(",") if k.strip()}
    bad = sorted(kinds - set(LINE_KINDS))
    if not kinds:
        raise UsageError(f"annotate: --kind {value!r} names no line kind",
                         hint=f"Use one or more of {', '.join(LINE_KINDS)}, comma-separated (--kind ours,carried), "
                              "or leave --kind out for every line.")
    if bad:
        raise UsageError(f"annotate: --kind {', '.join(bad)} is not a line kind",
                         hint=f"Use one or more of {', '.join(LINE_KINDS)}, comma-separated (--kind ours,carried).")
    return kinds


@click.command(name="annotate", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("hunks", nargs=-1, metavar="[HUNK ...]")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=REPO_ROOT, show_default=True,
              help="Output root whose patches/latest/ holds megatron.patch and manifest.json.")
@click.option("--patch", "patch", type=click.Path(dir_okay=False, path_type=Path),
              help="Patch to annotate (default <out>/patches/latest/megatron.patch).")
@click.option("--manifest", type=click.Path(dir_okay=False, path_type=Path),
              help="Its manifest.json (default: beside --patch: <stem>.manifest.json or manifest.json).")
@click.option("--kind", "kind", metavar="KIND[,KIND]",
              help="Print only the added lines of these kinds (upstream, ours, carried).")
def annotate_cli(hunks, out, patch, manifest, kind):
    """Print the patch with each line's provenance in a margin: kind (upstream, ours, carried;
    removed), origin (upstream hunk, recipe step or carried hunk) and line number in the patched file.

    HUNK: an output hunk id (out:<path>#<n>), a file (gated_delta_net.py), or an origin id (upstream
    hunk, recipe step, carried hunk); none: the whole patch. The last line (stderr) totals the kinds.
    Example: tools/backport annotate gated_delta_net.py --kind ours,carried
    """
    kinds = _kinds_option(kind)
    if patch is None:
        patch = out / "patches" / "latest" / "megatron.patch"
    if manifest is None:
        dated = patch.with_name(patch.stem + ".manifest.json")
        manifest = dated if dated.exists() else patch.with_name("manifest.json")
    text, m = load(patch, manifest)
    ids = select(m, list(hunks))
    for line in annotate(text, m, ids, kinds):
        click.echo(line)
    click.echo(totals(m, ids), err=True)


def main(argv: list) -> None:
    """Run ``annotate`` with ``argv`` (the arguments after the word ``annotate``); exit with the
    project's codes (2 for a usage error)."""
    try:
        annotate_cli.main(args=argv, prog_name="tools/backport annotate", standalone_mode=False)
    except PipelineError as exc:
        click.echo(f"error: {exc.message}\nhint: {exc.hint}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.UsageError as exc:
        click.echo(f"error: {exc.format_message()}\nhint: Run `tools/backport annotate --help`.", err=True)
        sys.exit(UsageError.exit_code)
    except BrokenPipeError:  # `| head`
        sys.exit(0)
