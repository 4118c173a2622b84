"""The output patch: ``megatron.patch`` written from the changed files (git's diff, byte-exact),
and every hunk of it attributed to the recipe step or carried hunk its lines came from."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Optional

from unidiff import PatchSet

from . import interrupts
from .errors import ApplyError
from .upstream_lines import line_class
from .gitenv import isolated
from .gitpath import patch_path
from .workspace import Workspace, split_lines

GIT_ENV = {
    "GIT_AUTHOR_NAME": "gdn-backport", "GIT_AUTHOR_EMAIL": "gdn-backport@localhost",
    "GIT_COMMITTER_NAME": "gdn-backport", "GIT_COMMITTER_EMAIL": "gdn-backport@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}


def _git(cwd: Path, *args: str) -> str:
    env = isolated(GIT_ENV)
    return interrupts.run_child(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, encoding="utf-8").stdout


def file_mode(path: Path) -> Optional[str]:
    """Git mode of the regular file ``path`` (``"100755"`` when executable, else ``"100644"``);
    None when there is no such file."""
    return ("100755" if os.stat(path).st_mode & 0o111 else "100644") if path.is_file() else None


def make_patch(files: list, header: str, base_tree: Path) -> str:
    """Unified git-style diff (``a/``/``b/`` prefixes, full index) of changed files.

    Files are written and the diff read as bytes (UTF-8), so CRLF line ends and a missing
    final newline are reproduced exactly; deleted files and carried mode changes appear as
    git writes them (GNU patch applies both). Each file keeps its real mode: a carried one,
    else the base tree's (so the ``index`` lines of a 100755 file say 100755, and
    ``git apply --check`` on the base is silent). Names are written as UTF-8, unquoted
    (``core.quotepath=false``), as the manifest names them.

    Args:
        files: :class:`~backport.workspace.FileState` objects that changed, sorted by path.
        header: comment text put before the first ``diff --git`` line.
        base_tree: the pinned base tree the files come from (their modes).
    """
    def put(path: Path, text: str, mode) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))
        if mode:
            path.chmod(0o755 if mode == "100755" else 0o644)

    with interrupts.temporary_folder("gdn-diff-") as root:  # removed whole, a signal or not
        _git(root, "init", "-q")
        base_modes = {f.path: f.base_mode or (file_mode(base_tree / f.path) if f.exists_in_base else None)
                      for f in files}
        for f in files:
            if f.exists_in_base:
                put(root / f.path, "".join(f.base_lines), base_modes[f.path])
        _git(root, "add", "-A")
        _git(root, "commit", "-q", "--allow-empty", "-m", "base")
        for f in files:
            if f.exists:
                put(root / f.path, f.text, f.mode or base_modes[f.path])
            elif (root / f.path).exists():
                (root / f.path).unlink()
        _git(root, "add", "-A")
        env = isolated(GIT_ENV)
        diff = interrupts.run_child(["git", "-c", "core.filemode=true", "-c", "core.quotepath=false", "diff", "--cached", "--no-color", "--no-renames",
                               "--no-ext-diff", "--full-index", "-U3", "--src-prefix=a/", "--dst-prefix=b/"],
                              cwd=root, env=env, check=True, capture_output=True).stdout.decode("utf-8")
    return header + diff


#: Output hunk ids are ``out:<path>#<n>``, visibly not upstream hunk ids (``<path>#<n>``, the n-th
#: hunk of the upstream commit) nor carried hunk ids (``carry:<path>#<n>``).
OUTPUT_HUNK_PREFIX = "out:"

#: The three kinds of an added line (``line_kinds``), in the order the manifest shows them.
LINE_KINDS = ("upstream", "ours", "carried")

#: Origin kinds whose lines are upstream's by construction (an upstream hunk, a transplanted symbol).
_UPSTREAM_ORIGINS = ("upstream-verbatim", "prerequisite")


def kind_counts(kinds) -> dict:
    """``{"upstream": n, "ours": n, "carried": n}`` counted over ``kinds`` (all three keys present)."""
    counts = Counter(kinds)
    return {k: counts.get(k, 0) for k in LINE_KINDS}


def line_kinds(labels: list, classes: list, origins: dict) -> list:
    """The kind of every added line of one hunk (None for a removed line), from its origin and content.

    ``carried``: a line of the user's carried patch (``--carry``), whatever its content.
    ``upstream``: a line of an upstream hunk or a transplanted prerequisite symbol, or a line a recipe
    step wrote that equals (whitespace-stripped) a line of the upstream commit's version of the file.
    ``ours``: any other line a recipe step wrote (our templates, transforms, preserved fixes).
    A blank line a recipe step wrote, or one of punctuation only (``)``, ``],``: every file has
    them), takes the kind of the nearest other line of the same origin above it in the hunk (below it
    when it opens the run); ``ours`` when there is none.

    Args:
        labels: ``[sign, origin id]`` per +/- line, in hunk order.
        classes: per line, :func:`backport.upstream_lines.line_class` of an added line (None when blank,
            punctuation only, or removed).
        origins: origin id -> origin record (its ``kind``).
    """
    kinds: list = []
    for (sign, oid), cls in zip(labels, classes):
        okind = origins[oid]["kind"]
        if sign != "+":
            kinds.append(None)
        elif okind == "carried":
            kinds.append("carried")
        elif okind in _UPSTREAM_ORIGINS:
            kinds.append("upstream")
        else:
            kinds.append(cls)  # None while blank: resolved below
    for i, ((sign, oid), kind) in enumerate(zip(labels, kinds)):
        if sign != "+" or kind is not None:
            continue
        around = list(range(i - 1, -1, -1)) + list(range(i + 1, len(labels)))
        kinds[i] = next((kinds[j] for j in around
                         if labels[j][0] == "+" and labels[j][1] == oid and kinds[j] is not None), "ours")
    return kinds


def _runs(items: list) -> list:
    """``[(item, count)]``: runs of equal consecutive items."""
    out: list = []
    for item in items:
        if out and out[-1][0] == item:
            out[-1][1] += 1
        else:
            out.append([item, 1])
    return [(item, n) for item, n in out]


def _neighbour_rank(label: list, other: list, origins: dict) -> tuple:
    # Sort key of a candidate origin for an unattributed line: recipe before carry, same sign first.
    return (origins[other[1]]["kind"] == "carried", other[0] != label[0])


def attribute_hunks(patch_text: str, ws: Workspace, origins: dict,
                    upstream_lines: Optional[dict] = None) -> tuple[list, dict]:
    """Attribute every +/- line of the patch to one origin.

    Args:
        upstream_lines: path -> the upstream commit's stripped lines of that file
            (:func:`backport.upstream_lines.upstream_line_sets`); given, each origin record of a
            hunk also counts its added lines by kind (``added_upstream``, ``added_ours``,
            ``added_carried``: :func:`line_kinds`).

    Returns:
        (files, stats): per-file hunk records, and counts of exact/neighbour attributions. A hunk
        record has its id (``out:<path>#<n>``), header, counts, ``added_by_kind``, its origins, and
        the per-line provenance in runs: ``lines`` (``{kind, origin, n}`` per run of added lines)
        and ``removed_lines`` (``{origin, n}`` per run of removed lines), in patch order.

    Lines that git's diff aligns differently from the step-wise tracking (a moved blank
    line, say) take the origin of the nearest attributed line of the same hunk, preferring a
    line of the same sign and never a carried line while a recipe line is there: a carried
    hunk's lines are always tracked exactly, so a guess must not put a line the user never
    wrote on their carry. They are counted as ``by_neighbour``.
    """
    stats = Counter()
    files = []
    for pfile in PatchSet(split_lines(patch_text)):
        path = patch_path(pfile)
        state = ws.files[path]
        hunks = []
        file_kinds = kind_counts(())
        for n, hunk in enumerate(pfile, start=1):
            labels = []
            classes = []
            up = None if upstream_lines is None else upstream_lines.get(pfile.path, frozenset())
            for line in hunk:
                if line.is_added:
                    tag = state.tags[line.target_line_no - 1]
                    labels.append(["+", tag[1] if tag[0] == "origin" else None])
                    cls = line_class(line.value, up)
                    # a line of brackets or commas only says nothing about whose it is
                    classes.append(cls if any(ch.isalnum() for ch in line.value) else None)
                elif line.is_removed:
                    labels.append(["-", state.removed_by.get(line.source_line_no - 1)])
                    classes.append(None)
            for i, label in enumerate(labels):
                if label[1] is not None:
                    stats["exact"] += 1
                    continue
                near = sorted((_neighbour_rank(label, other, origins), abs(j - i), j)
                              for j, other in enumerate(labels) if other[1] is not None and j != i)
                if not near:
                    raise ApplyError(f"{path}: hunk {n} has a line with no origin; attribution failed.",
                                     hint="Report this: a recipe step changed a line without being recorded.")
                label[1] = labels[near[0][2]][1]
                stats["by_neighbour"] += 1
            kinds = line_kinds(labels, classes, origins)
            per = {}
            for (sign, oid), kind in zip(labels, kinds):
                rec = per.setdefault(oid, {"origin": oid, "kind": origins[oid]["kind"], "added": 0, "removed": 0})
                if upstream_lines is not None and "added_upstream" not in rec:
                    rec.update(added_upstream=0, added_ours=0, added_carried=0)
                rec["added" if sign == "+" else "removed"] += 1
                if kind is not None and upstream_lines is not None:
                    rec["added_" + kind] += 1
            added = [(kind, oid) for (sign, oid), kind in zip(labels, kinds) if sign == "+"]
            hunk_kinds = kind_counts(kind for kind, _oid in added)
            for kind, count in hunk_kinds.items():
                file_kinds[kind] += count
            hunks.append({
                "id": f"{OUTPUT_HUNK_PREFIX}{path}#{n}",
                "header": str(hunk).splitlines()[0],
                "added": hunk.added, "removed": hunk.removed,
                "added_by_kind": hunk_kinds,
                "origins": sorted(per.values(), key=lambda r: r["origin"]),
                "lines": [{"kind": kind, "origin": oid, "n": n} for (kind, oid), n in _runs(added)],
                "removed_lines": [{"origin": oid, "n": n}
                                  for oid, n in _runs([oid for sign, oid in labels if sign == "-"])],
            })
        record = {
            "path": path,
            "status": "added" if pfile.is_added_file else "deleted" if pfile.is_removed_file else "modified",
            "added": pfile.added, "removed": pfile.removed,
            "added_by_kind": dict(file_kinds),
            "hunks": hunks,
        }
        if state.mode_origin and state.exists:
            record["mode"] = {"old": state.base_mode, "new": state.mode, "origin": state.mode_origin}
        files.append(record)
    return files, dict(stats)
