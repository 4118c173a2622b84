"""The carried downstream patch: its model, what is refused, and its application.

Owns everything about ``--carry``: parsing with a real patch model (unidiff, which knows
git's extended headers), refusing unsupported features by name before anything is read or
written, keeping every path inside the tree, applying the patch to the
:class:`~backport.workspace.Workspace` hunk by hunk (zero fuzz, inside the right symbol,
per-line origins), and proving the result equals what ``git apply`` makes of the same patch
on the same base files, byte for byte (git itself is the reference applier).

Supported exactly as ``git apply`` does: modified, new and deleted files; renames and
copies, with and without edits; mode changes (also mode-only, ``100644``/``100755``);
``\\ No newline at end of file`` on either side; CRLF lines; sections without a ``diff --git``
line and ``diff -ruN`` creations/deletions; ``git format-patch`` mail; file names quoted by
git or in UTF-8; a ``diff --git`` line naming other files than ``---``/``+++`` (those win).
Refused, naming feature and file (:data:`REFUSALS`, also in ``docs/carry.md``): see
:func:`load_carry`.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from unidiff import PatchSet

from . import interrupts
from .errors import ApplyError
from .gitenv import isolated
from .gitpath import split_quoted, unquote
from .workspace import (FileState, HunkLines, SymbolMap, SymbolMaps, Workspace, anchor_line, check_tree_path, hunk_lines,
                        split_lines)

GIT_ENV = {"LC_ALL": "C"}
MODES = {"100644", "100755"}

#: Refusal reasons by name (the message starts with ``carried patch <file>: <reason>``).
REFUSALS = {
    "not-a-patch": "the file is empty or holds no unified diff",
    "binary": "binary diff",
    "symlink": "symlink (mode 120000)",
    "submodule": "submodule / gitlink (mode 160000)",
    "unknown-mode": "file mode other than 100644/100755",
    "zero-context": "zero-context (-U0) hunk",
    "no-prefix": "paths without the a/ and b/ prefixes (-p1)",
    "quoted-path": "a quoted file name that is malformed, not UTF-8, or holds a control character",
    "names-differ": "the --- and +++ lines name different files without a rename or copy line",
    "non-utf8": "content that is not UTF-8",
    "twice": "the same file changed twice in one patch",
    "empty-file": "creating or deleting an empty file (no hunk GNU patch could reproduce)",
    "only-in": "a diff -r 'Only in' line: a file on one side only, which diff -r without -N leaves out of the patch",
    "git-apply-differs": "git apply places or refuses a hunk differently",
}
_PATH_HINT = ("Make the carried patch with `git diff` inside the tree root (paths a/megatron/...); no '..', "
              "absolute paths or symlinks leading out.")
HINT = "Regenerate the carried patch with `git diff` (text, -U3) against the pinned base, or drop that file from it."


class CarryRefused(ApplyError):
    """The carried patch uses a feature the tool refuses (exit 6); ``reason`` is a key of REFUSALS."""

    def __init__(self, carry: Path, file: str, reason: str, detail: str = "", hint: Optional[str] = None):
        self.reason = reason
        what = REFUSALS[reason] + (f": {detail}" if detail else "")
        super().__init__(f"carried patch {carry.name}: {file}: {what}; refused before anything was written.",
                         hint=hint or HINT)


@dataclass
class CarryHunk:
    """One hunk of the carried patch.

    Attributes:
        oid: origin id ``carry:<path>#<n>`` (path after the patch; the old path for a deletion).
        path: file the hunk applies to (after rename/copy).
        n: 1-based hunk number within its file.
        header: the ``@@ ... @@`` line.
        lines: placement data (source/target lines).
        added, removed: the hunk's added and removed lines (keepends).
        symbol: enclosing class/function qualname in the base (``""`` module level; None unknown).
        offset: lines from the expected position (GNU patch counting); set when applied.
        added_at: 0-based lines of the file right after the carry that this hunk added.
        line_symbols: ``(sign, line, symbol)`` per added (``+``, symbol in the file right after
            the carry) and removed (``-``, symbol in the base) line: the innermost class or
            function where the line actually lands (``""`` module level; None not Python).
    """

    oid: str
    path: str
    n: int
    header: str
    lines: HunkLines
    added: list
    removed: list
    symbol: Optional[str] = None
    offset: int = 0
    added_at: list = field(default_factory=list)
    line_symbols: list = field(default_factory=list)


@dataclass
class CarryFile:
    """One file of the carried patch.

    Attributes:
        kind: ``modify``, ``add``, ``delete``, ``rename``, ``copy``.
        old_path, new_path: tree-relative paths (None for the absent side).
        old_mode, new_mode: git modes from the extended headers (None when not given).
        hunks: its hunks.
        note: what the tool read differently from the section's ``diff --git`` line (a warning).
    """

    kind: str
    old_path: Optional[str]
    new_path: Optional[str]
    old_mode: Optional[str] = None
    new_mode: Optional[str] = None
    hunks: list = field(default_factory=list)
    note: Optional[str] = None

    @property
    def path(self) -> str:
        """The path the file has after the patch (the old one for a deletion)."""
        return self.new_path or self.old_path


@dataclass
class Carry:
    """A parsed carried patch: its bytes and files, in patch order."""

    source: Path
    raw: bytes
    files: list
    #: what git apply made of it, by base tree (the determinism run asks again: git runs once)
    git_reference: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def hunks(self) -> list:
        """Every hunk, in patch order."""
        return [h for f in self.files for h in f.hunks]


def _strip(name: str, prefix: str, carry: Path) -> Optional[str]:
    if name == "/dev/null":
        return None
    if name.startswith('"'):  # git's C-style quoting ("a/caf\303\251.py"): undone, as git apply does
        try:
            name = unquote(name)
        except ValueError as exc:
            raise CarryRefused(carry, name, "quoted-path", str(exc)) from exc
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise CarryRefused(carry, repr(name), "quoted-path", "a control character in the file name",
                           hint="Rename the file to a name without tabs, newlines or other control characters.")
    if name.startswith("/"):
        check_tree_path(name, None, ApplyError, what=f"carried patch {carry.name}: path", hint=_PATH_HINT)
    if not name.startswith(prefix):
        raise CarryRefused(carry, name, "no-prefix", f"expected {prefix}...", hint=(
            "Regenerate it with plain `git diff` (not --no-prefix; svn/hg diffs name files without prefixes too), "
            f"or write the ---/+++ names as a/<path> and b/<path>, paths relative to the base tree root."))
    return name[len(prefix):]


def _header_name(line: str, marker: str) -> str:
    """The name on a ``---``/``+++`` line as written (quotes kept), without a date after a tab
    or the line end."""
    rest = line[len(marker):].rstrip("\r\n")
    parts = split_quoted(rest)
    return parts[0] if parts else rest.split("\t", 1)[0].rstrip("\r")


def _diff_git_names(rest: str) -> Optional[tuple]:
    """``(a, b)`` as written on a ``diff --git <a> <b>`` line (quotes kept); None when unreadable.

    Unquoted names may hold spaces: the split is where both sides name the same file, as git
    writes it (else at the first `` b/``)."""
    rest = rest.rstrip("\r\n")
    first = split_quoted(rest)
    if first:
        second = first[1][1:] if first[1].startswith(" ") else None
        return (first[0], second) if second else None
    cuts = [i for i in range(len(rest)) if rest.startswith(" b/", i) or rest.startswith(' "b/', i)]
    same = [i for i in cuts if rest[2:i] == rest[i + 3:]]
    cut = (same or cuts or [None])[0]
    return (rest[:cut], rest[cut + 1:]) if cut is not None else None


#: Lines of a ``diff --git`` section's extended header (git's ``apply.c``, parse_git_diff_header).
_GIT_HEADERS = ("--- ", "+++ ", "old mode ", "new mode ", "deleted file mode ", "new file mode ", "copy from ",
                "copy to ", "rename old ", "rename new ", "rename from ", "rename to ", "similarity index ",
                "dissimilarity index ", "index ")


def _for_unidiff(lines: list) -> tuple[list, dict]:
    """The carry's lines as unidiff must see them: the ``---``/``+++`` names of a ``diff --git``
    section win over its ``diff --git`` line, and its header lines lose a CRLF's ``\\r``.

    ``git apply`` takes a section's file names from its ``---``/``+++`` lines when it has them
    (the ``diff --git`` line is only the default, git's ``apply.c``), and so does GNU
    ``patch -p1``; unidiff takes them from the ``diff --git`` line and stops ("Target without
    source") when ``+++`` names another file. So where the two disagree, the ``diff --git`` line
    handed to unidiff is rewritten to the ``---``/``+++`` names (the carry's bytes stay as they
    are: git apply, the reference, reads those). unidiff's header patterns end at ``\\n``, so in
    a carry saved with CRLF throughout it misses ``deleted file mode``/``new file mode``; the
    ``\\r`` goes from those lines (the hunks keep theirs, for the line-endings refusal).

    Returns:
        (lines for unidiff, {1-based line number of each rewritten ``diff --git`` line: note}).
    """
    out, notes = list(lines), {}
    for i, line in enumerate(lines):
        if not line.startswith("diff --git "):
            continue
        old = new = None
        for j in range(i, len(lines)):  # the extended header, as git reads it: known lines up to +++
            header = lines[j]
            if j > i and not header.startswith(_GIT_HEADERS):
                break
            if header.endswith("\r\n"):
                out[j] = header = header[:-2] + "\n"
            if header.startswith("--- "):
                old = _header_name(header, "--- ")
            elif header.startswith("+++ "):
                new = _header_name(header, "+++ ")
                break
        names = _diff_git_names(line[len("diff --git "):])
        if old is None or new is None or names is None:
            continue
        said = tuple(unquote(n) if split_quoted(n) else n for n in names)
        meant = [unquote(n) if split_quoted(n) else n for n in (old, new)]
        if all(m == "/dev/null" or m[2:] == s[2:] for m, s in zip(meant, said)):
            continue
        out[i] = f"diff --git {old} {new}\n"
        notes[i + 1] = (f"its diff --git line names {said[0]} {said[1]}, its ---/+++ lines {meant[0]} {meant[1]}: "
                        f"the ---/+++ names are used, as git apply and GNU patch do")
    return out, notes


def _display_name(name: str) -> str:
    """A ---/+++ name for messages, as the carry means it: git's quoting undone, the a/ or b/
    prefix dropped (a malformed quoted name is shown as written)."""
    try:
        name = unquote(name)
    except ValueError:
        return name
    return name[2:] if name.startswith(("a/", "b/")) else name


def _whole_side_empty(pfile, side: str) -> bool:
    """True when ``pfile`` is one hunk whose ``side`` ("source" or "target") is ``-0,0``/``+0,0``.

    That is how ``diff -ruN`` writes a created (source empty) or deleted (target empty) file: it
    names the missing side with its real path and an epoch date instead of ``/dev/null``. GNU
    ``patch -p1`` and ``git apply`` both read it as a creation or deletion.
    """
    if len(pfile) != 1 or any(line.startswith("diff --git ") for line in pfile.patch_info or ()):
        return False  # git marks creations and deletions itself; -0,0 there is an empty file
    hunk = pfile[0]
    if getattr(hunk, f"{side}_start") != 0 or getattr(hunk, f"{side}_length") != 0:
        return False
    # -0,0 with a real date is an existing empty file (created: no; emptied: kept, as git does).
    return _is_epoch(getattr(pfile, f"{side}_timestamp", None))


def _is_epoch(stamp: Optional[str]) -> bool:
    """True when a ``---``/``+++`` timestamp (``2026-01-02 03:04:05.123456789 +0100``) is the Unix
    epoch in any zone: how ``diff -N`` dates the missing side of a created or deleted file."""
    m = re.fullmatch(r"(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.\d+)? ?([+-]\d{4})?", (stamp or "").strip())
    if not m:
        return False
    y, mo, d, hh, mm, ss = (int(g) for g in m.groups()[:6])
    zone = m.group(7) or "+0000"
    offset = (1 if zone[0] == "+" else -1) * (int(zone[1:3]) * 3600 + int(zone[3:5]) * 60)
    when = datetime.datetime(y, mo, d, hh, mm, ss, tzinfo=datetime.timezone(datetime.timedelta(seconds=offset)))
    return when.timestamp() == 0


def _parse_error(path: Path, lines: list, exc: Exception) -> ApplyError:
    """The error for a carry unidiff cannot parse, naming the line (1-based in the carry) and
    the hunk it belongs to when unidiff's message quotes it.

    unidiff's messages end with the offending line (``Hunk diff line expected: <line>``,
    ``Unexpected hunk found: <line>``); the usual causes are a hunk whose ``@@`` line counts no
    longer match its lines (a hand edit) or a hunk line an editor changed (a tab or a stripped
    leading space), so the message says both."""
    msg = str(exc).rstrip("\n")
    quoted = msg.split(": ", 1)[1].rstrip("\r\n") if ": " in msg else None
    bare = [ln.rstrip("\r\n") for ln in lines]
    where, hunk = "", ""
    if quoted and quoted in bare:
        at = bare.index(quoted)
        where = f" at line {at + 1}"
        heads = [ln for ln in bare[:at + 1] if ln.startswith("@@ ")]
        if heads and heads[-1] != quoted:
            hunk = f", in the hunk {heads[-1]!r}"
        elif len(heads) > 1:
            hunk = f", after the hunk {heads[-2]!r}"
    elif not quoted and "shorter than expected" in msg:  # the patch ended inside a hunk: the last one
        heads = [ln for ln in bare if ln.startswith("@@ ")]
        hunk = f" in its last hunk {heads[-1]!r}" if heads else ""
    return ApplyError(
        f"carried patch {path.name} cannot be parsed{where}{hunk}: {msg}; a hunk's @@ line counts do not match its "
        "lines (a hand edit changes them), or a line of a hunk does not start with ' ', '+', '-' or '\\' (an editor "
        "turned its leading space into a tab or removed it); refused before anything was written.",
        hint="Recount the -start,count +start,count of that hunk's @@ line (GNU `rediff` or `recountdiff` do it), "
             "or regenerate the carried patch with `git diff` against the pinned base.")


_ONLY_IN = re.compile(r"^Only in (.+?): (.+?)\r?\n?$")


def _only_in(lines: list) -> Optional[tuple]:
    # `diff -r` (without -N) reports a file present on one side only as "Only in <dir>: <name>"
    # and writes no hunk for it: git apply and GNU patch skip the line, so the file would be
    # silently missing from the carry. A hunk line always starts with ' ', '+', '-' or '\\', and
    # git never writes such a line: a patch with a `diff --git` line (git diff, format-patch mail,
    # whose message may say anything) is not looked at. Returns (tree path as the message names
    # it, dir, name) of the first such line, else None.
    if any(line.startswith("diff --git ") for line in lines):
        return None
    for line in lines:
        found = _ONLY_IN.match(line)
        if found:
            folder, name = found.group(1), found.group(2)
            tree = folder.split("/", 1)[1] if "/" in folder else ""
            return ((tree + "/" if tree else "") + name, folder, name)
    return None


def load_carry(path: Path) -> Carry:
    """Parse ``path`` and refuse what the tool does not apply exactly as ``git apply``.

    Refused (:class:`CarryRefused`, exit 6, reason named): an empty or non-diff file; binary
    diffs; symlinks and submodules; modes other than 100644/100755; zero-context (``-U0``)
    hunks (a hunk without context is accepted only when it replaces lines from the file start); paths without
    ``a/``/``b/`` prefixes; quoted names that are malformed, not UTF-8 or hold a control
    character; ``---``/``+++`` naming two files without rename/copy lines; non-UTF-8 text; one
    file changed twice; creating or deleting an empty file; a ``diff -r`` "Only in" line (a file
    the patch silently leaves out).

    Raises:
        ApplyError: unreadable or unparsable; CarryRefused as above.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ApplyError(f"cannot read carried patch {path}: {exc.strerror}", hint="Pass --carry an existing file.") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CarryRefused(path, path.name, "non-utf8", f"byte {exc.start}") from exc
    if not raw.strip():
        raise CarryRefused(path, path.name, "not-a-patch", "it is empty",
                           hint="Pass a patch made with `git diff` against the pinned base, or drop --carry.")
    lines, notes = _for_unidiff(split_lines(text))
    only_in = _only_in(lines)
    if only_in:
        raise CarryRefused(path, only_in[0], "only-in", f"'Only in {only_in[1]}: {only_in[2]}'", hint=(
            "Make the carried patch with `diff -ruN` (new and deleted files become hunks) or `git diff`; "
            "or, if the file is not meant to be carried, delete the 'Only in' line."))
    try:
        patch = PatchSet(lines)
    except Exception as exc:  # unidiff raises its own parse errors
        raise _parse_error(path, lines, exc) from exc
    if len(patch) == 0:
        raise CarryRefused(path, path.name, "not-a-patch", "no 'diff --git' or '---'/'+++' file header found",
                           hint="Pass a patch made with `git diff` against the pinned base, or drop --carry.")
    files = []
    for pfile in patch:
        info = {}
        # A section without a `diff --git` line (plain `diff -u`, or hand-edited) has no header
        # lines at all: unidiff gives None, not an empty list.
        for line in pfile.patch_info or ():
            line = line.rstrip("\r\n")
            for key in ("old mode ", "new mode ", "new file mode ", "deleted file mode ", "rename from ",
                        "rename to ", "copy from ", "copy to "):
                if line.startswith(key):
                    value = line[len(key):]
                    info[key.strip()] = _strip(value, "", path) if key.startswith(("rename", "copy")) else value
            if line.startswith("index ") and " " in line[6:]:
                info["index mode"] = line.rsplit(" ", 1)[1]
            if line.startswith("GIT binary patch") or (line.startswith("Binary files ") and line.endswith(" differ")):
                info["binary"] = line
        # A carry saved with CRLF throughout leaves "\r" on the ---/+++ names: not part of the path.
        source_file, target_file = pfile.source_file.rstrip("\r"), pfile.target_file.rstrip("\r")
        label = _display_name(target_file if target_file != "/dev/null" else source_file)
        if getattr(pfile, "is_binary_file", False) or "binary" in info:
            raise CarryRefused(path, label, "binary", hint="Carry binary files outside the patch, or drop them from it.")
        for key in ("old mode", "new mode", "new file mode", "deleted file mode", "index mode"):
            mode = info.get(key)
            if mode is None:
                continue
            if mode == "120000":
                raise CarryRefused(path, label, "symlink")
            if mode == "160000":
                raise CarryRefused(path, label, "submodule")
            if mode not in MODES:
                raise CarryRefused(path, label, "unknown-mode", mode)
        old = _strip(source_file, "a/", path)
        new = _strip(target_file, "b/", path)
        if "rename from" in info or "copy from" in info:
            kind = "rename" if "rename from" in info else "copy"
            old, new = info[f"{kind} from"], info[f"{kind} to"]
        elif "new file mode" in info or (old is None and new is not None) or _whole_side_empty(pfile, "source"):
            kind, old = "add", None
        elif "deleted file mode" in info or (new is None and old is not None) or _whole_side_empty(pfile, "target"):
            kind, new = "delete", None
        else:
            kind = "modify"
        if kind == "modify" and old != new:
            # git apply reads this as a rename in a diff --git section and as an edit of the +++ file
            # otherwise; GNU patch edits the --- file (when both exist): refused rather than guessed.
            raise CarryRefused(path, new, "names-differ", f"--- names {old}, +++ names {new} (git apply and GNU "
                               "patch read such a section differently)",
                               hint="Name the same file on both lines for an edit, or make the rename with "
                                    "`git diff -M` (its rename from/rename to lines say it is one).")
        cf = CarryFile(kind, old, new, old_mode=info.get("old mode") or info.get("deleted file mode"),
                       new_mode=info.get("new mode") or info.get("new file mode"),
                       note=notes.get(pfile.diff_line_no))
        if kind in ("add", "delete") and len(pfile) == 0:
            raise CarryRefused(path, cf.path, "empty-file")
        for n, hunk in enumerate(pfile, start=1):
            h = hunk_lines(hunk)
            has_context = len(h.source) > len([c for c in h.changes if c[1] == "-"])
            # `@@ -0,0 +1,N @@` on a kept file is how git writes lines added to an empty file:
            # allowed here, placed only on an empty file (FileState.apply_hunk refuses it otherwise).
            empty_file_fill = not h.source and hunk.source_start == 0
            if not has_context and kind not in ("add", "delete") and not empty_file_fill and (
                    hunk.source_start > 1 or not h.source):
                raise CarryRefused(path, f"{cf.path} hunk {n}", "zero-context",
                                   hint="Regenerate the carried patch with context (plain `git diff`, -U3).")
            cf.hunks.append(CarryHunk(
                oid=f"carry:{cf.path}#{n}", path=cf.path, n=n, header=str(hunk).splitlines()[0], lines=h,
                added=[ln.value for ln in hunk if ln.is_added], removed=[ln.value for ln in hunk if ln.is_removed]))
        files.append(cf)
    written = set()  # a copy's source is only read (from the preimage), every other path is written
    for cf in files:
        for p in {cf.new_path} | ({cf.old_path} if cf.kind in ("modify", "delete", "rename") else set()):
            if p is None:
                continue
            if p in written:
                raise CarryRefused(path, p, "twice", hint=(
                    "Make one section per file: squash the commits (`git diff FIRST^ LAST` instead of a "
                    "`git format-patch` series or concatenated quilt patches) or merge the two sections' "
                    "hunks into one `diff --git` section."))
            written.add(p)
    return Carry(path, raw, files)


def check_paths(carry: Carry, root: Path) -> None:
    """Every path of the carry (``---``/``+++``, rename/copy headers) must stay inside ``root``.

    Raises:
        ApplyError (exit 6) naming the path; nothing has been read or written yet.
    """
    for cf in carry.files:
        for p in (cf.old_path, cf.new_path):
            if p is not None:
                check_tree_path(p, root, ApplyError, what=f"carried patch {carry.source.name}: path", hint=_PATH_HINT)
                if (root / p).is_symlink():
                    raise CarryRefused(carry.source, p, "symlink", "the base tree has a symlink there")


def git_apply_tree(carry: Carry, base_tree: Path) -> tuple[Optional[dict], str]:
    """What ``git apply`` (no fuzz, no whitespace fixing) makes of the carry on the base files.

    Returns:
        ({path: (bytes, mode) or None when absent}, "") for every path the carry names, or
        (None, git's message) when git refuses.
    """
    with interrupts.temporary_folder("gdn-carry-") as tmp:  # removed whole, a signal or not
        root = tmp / "tree"
        root.mkdir()
        env = isolated(GIT_ENV)
        interrupts.run_child(["git", "init", "-q"], cwd=root, env=env, check=True, capture_output=True)
        paths = sorted({p for cf in carry.files for p in (cf.old_path, cf.new_path) if p})
        for p in paths:
            src = base_tree / p
            if src.is_file() and not src.is_symlink():
                (root / p).parent.mkdir(parents=True, exist_ok=True)
                (root / p).write_bytes(src.read_bytes())
                (root / p).chmod(0o755 if os.stat(src).st_mode & 0o111 else 0o644)
        proc = interrupts.run_child(["git", "-c", "core.autocrlf=false", "-c", "core.filemode=true", "apply",
                               "--whitespace=nowarn", "-"], cwd=root, env=env, input=carry.raw, capture_output=True)
        if proc.returncode != 0:
            return None, proc.stderr.decode(errors="replace").strip()
        out = {}
        for p in paths:
            f = root / p
            out[p] = (f.read_bytes(), "100755" if os.stat(f).st_mode & 0o111 else "100644") if f.is_file() else None
        return out, ""


def _place_lines(hunks: list, state: FileState, base_symbols: Optional[SymbolMap], base_text: Optional[str],
                 maps: SymbolMaps) -> None:
    """Fill ``added_at`` and ``line_symbols`` of ``hunks`` (all of one file, already applied):
    one pass over the file's line tags and one parse of the carried file, whatever the number
    of hunks."""
    carried = maps.get(state.text)
    base_lines = split_lines(base_text or "")
    mine: dict = {}
    for i, tag in enumerate(state.tags):
        if tag[0] == "origin":
            mine.setdefault(tag[1], []).append(i)
    removed_by: dict = {}
    for i, oid in sorted(state.removed_by.items()):
        if i < len(base_lines):
            removed_by.setdefault(oid, []).append(i)
    for h in hunks:
        added = set(h.added)
        h.added_at = [i for i in mine.get(h.oid, ()) if state.lines[i] in added]
        h.line_symbols = [("+", state.lines[i], carried.at(i)) for i in h.added_at]
        removed = [("-", base_lines[i], base_symbols.at(i) if base_symbols is not None else "")
                   for i in removed_by.get(h.oid, ())]
        if len(removed) < len(h.removed):  # a renamed/copied file: removed lines are not base lines
            removed = [("-", line, h.symbol) for line in h.removed]
        h.line_symbols += removed


def apply_carry(carry: Carry, ws: Workspace, base_reader: Callable[[str], Optional[str]], base_tree: Path,
                origins: dict, warn: Callable[[str], None] = lambda _m: None,
                symbol_maps: Optional[SymbolMaps] = None) -> None:
    """Apply ``carry`` to ``ws`` (paths already checked), record origins, prove it equals git apply.

    Every hunk is placed with zero fuzz inside the class/function it sits in at the base
    (``FileState.apply_hunk``); an offset is a warning through ``warn``. Renames and copies
    tag the moved lines with ``carry:<new>#rename``/``#copy``; a mode change with
    ``carry:<path>#mode``.

    Each file is parsed once (its base; the file after the carry once more, for the symbol of
    every carried line), whatever its number of hunks; ``symbol_maps`` keeps those parses for
    a later run on the same files (the determinism run, ``carry_survival``).

    Raises:
        ApplyError: a hunk does not apply, is already applied, lands in another symbol, or
            matches twice in its symbol equally near its header's line; CarryRefused('git-apply-differs')
            when git apply refuses the patch or makes other bytes.
    """
    name = carry.source.name
    maps = symbol_maps if symbol_maps is not None else SymbolMaps()

    def get(path: str) -> FileState:
        return ws.get(path, base_reader)

    for cf in carry.files:
        if cf.note:
            warn(f"warning: carried patch {name}: {cf.path}: {cf.note}")
        bridge_path = next((p for p in (cf.old_path, cf.new_path) if p and p.startswith("src/megatron/")), None)
        if bridge_path is not None and base_reader(bridge_path) is None:
            raise ApplyError(f"carried patch {name}: {bridge_path} has the path of a Megatron-Bridge checkout "
                             f"(src/megatron/...); the base tree holds it as {bridge_path[len('src/'):]}.",
                             hint="Drop `src/` from the carried patch's paths (a/megatron/..., b/megatron/...): make "
                                  "it in the Bridge checkout with `git diff --relative=src`, or edit the a/ and b/ "
                                  "lines, then carry it again.")
        base_text = base_reader(cf.old_path) if cf.old_path else None
        if cf.kind in ("modify", "delete", "rename", "copy") and (base_text is None or not get(cf.old_path).exists):
            raise ApplyError(f"carried patch {name}: {cf.old_path} does not exist in the base tree ({cf.kind}).",
                             hint="Make the carried patch against the pinned base tree.")
        if cf.kind in ("add", "rename", "copy") and get(cf.new_path).exists:
            raise ApplyError(f"carried patch {name}: {cf.new_path} already exists in the base tree ({cf.kind}).",
                             hint="Make the carried patch against the pinned base tree.")
        if cf.kind in ("rename", "copy"):
            moved = f"carry:{cf.new_path}#{cf.kind}"
            src, dst = get(cf.old_path), get(cf.new_path)
            dst.create(split_lines(base_text), moved)  # every diff of a patch is against the same preimage
            if cf.kind == "rename":
                src.delete(moved)
            origins[moved] = {"kind": "carried", "status": "applied", "why": f"{cf.kind} from {cf.old_path} in the carried patch"}
        state = get(cf.path)
        # one parse of the base file for all its hunks: their symbols, and the symbol of every
        # place their context matches (looked up through the line tags, FileState.apply_hunk)
        base_symbols = maps.get(base_text) if base_text is not None and cf.hunks else None
        for h in cf.hunks:
            h.symbol = base_symbols.at(anchor_line(h.lines.source, h.lines.changes, h.lines.header_pos)) \
                if base_symbols is not None else ""
            try:
                h.offset = state.apply_hunk(h.lines, h.oid, source_symbol=h.symbol,
                                            base_symbols=base_symbols if cf.kind in ("modify", "delete") else None,
                                            by_header=True)
            except ApplyError as exc:
                raise ApplyError(f"carried patch {name}: {exc.message}",
                                 hint=exc.hint if exc.hint != ApplyError.default_hint else
                                 "Regenerate the carried patch against the pinned base tree (zero fuzz).") from exc
            origins[h.oid] = {"kind": "carried", "header": h.header, "offset": h.offset, "symbol": h.symbol,
                              "status": "applied", "why": f"hunk {h.n} of {cf.path} in the carried patch"}
            if state.placed is not None:
                origins[h.oid].update(state.placed)
                at = ", ".join(map(str, state.placed["matches"]))
                warn(f"warning: carried hunk {h.oid}: its context matches at lines {at} of the base; placed "
                     + ("at the line its header names" if state.placed["placed"] == "header" else
                        "at the match nearest the line its header names") + ", as git apply does")
            if h.offset:
                warn(f"warning: carried hunk {h.oid} placed at offset {h.offset:+d} lines")
        if cf.kind != "delete" and cf.hunks:
            _place_lines(cf.hunks, state, base_symbols, base_text, maps)
        if cf.kind == "delete":
            if state.lines:
                raise ApplyError(f"carried patch {name}: deleting {cf.old_path} leaves {len(state.lines)} lines.",
                                 hint="Make the carried patch against the pinned base tree.")
            state.delete(cf.hunks[-1].oid if cf.hunks else f"carry:{cf.path}#delete")
        if cf.new_mode and cf.kind != "delete":
            if cf.kind == "add":
                state.mode = cf.new_mode
            elif cf.old_mode and cf.new_mode != cf.old_mode:
                state.base_mode = cf.old_mode if cf.kind == "modify" else state.base_mode
                state.mode = cf.new_mode
                state.mode_origin = f"carry:{cf.path}#mode"
                origins[state.mode_origin] = {"kind": "carried", "status": "applied",
                                              "why": f"mode {cf.old_mode} -> {cf.new_mode} of {cf.path} in the carried patch"}
        elif cf.kind in ("rename", "copy"):
            src = base_tree / cf.old_path
            state.mode = cf.old_mode or ("100755" if src.is_file() and os.stat(src).st_mode & 0o111 else "100644")
    _compare_with_git(carry, ws, base_tree)


def _compare_with_git(carry: Carry, ws: Workspace, base_tree: Path) -> None:
    if base_tree not in carry.git_reference:
        carry.git_reference[base_tree] = git_apply_tree(carry, base_tree)
    ref, message = carry.git_reference[base_tree]
    if ref is None:
        crlf = any(line.startswith(b"diff --git ") and line.endswith(b"\r\n") for line in carry.raw.splitlines(True))
        raise CarryRefused(carry.source, carry.files[0].path if len(carry.files) == 1 else "(patch)",
                           "git-apply-differs", f"git apply refuses it: {message[-400:]}"
                           + ("; the carry's diff --git lines end in CRLF (line endings: saved by a Windows editor?)"
                              if crlf else ""),
                           hint="Convert the carried patch's line endings to LF (dos2unix) and carry it again."
                           if crlf else None)
    for path, want in sorted(ref.items()):
        state = ws.files.get(path)
        have = None if state is None or not state.exists else state.text.encode("utf-8")
        if (want is None) != (have is None) or (want is not None and want[0] != have):
            detail = "file absent in one of them" if (want is None) != (have is None) else _first_difference(want[0], have)
            raise CarryRefused(carry.source, path, "git-apply-differs",
                               f"the tool's result differs from git apply's ({detail})",
                               hint="git apply places this file's hunks elsewhere: regenerate them with `git diff` "
                                    "against build/tree/base's file (docs/carry.md), or correct a hand-edited @@ "
                                    "line; if their context repeats in the file, widen it past the repeat "
                                    "(git diff -U<n>); or drop the file from the carried patch.")
        if want is not None and state.mode and state.mode != want[1]:
            raise CarryRefused(carry.source, path, "git-apply-differs", f"mode {state.mode} vs git's {want[1]}")


def _first_difference(a: bytes, b: bytes) -> str:
    la, lb = split_lines(a.decode("utf-8", "replace")), split_lines(b.decode("utf-8", "replace"))
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            return f"first at line {i + 1}"
    return f"{len(la)} vs {len(lb)} lines"


def carry_workspace(carry_path: Path, base_tree: Path) -> tuple[Carry, Workspace]:
    """Parse, check and apply ``carry_path`` on ``base_tree`` alone (no recipe).

    Raises:
        ApplyError / CarryRefused as :func:`load_carry`, :func:`check_paths`, :func:`apply_carry`.
    """
    carry = load_carry(carry_path)
    check_paths(carry, base_tree)
    ws = Workspace()
    apply_carry(carry, ws, lambda path: read_base(base_tree, path), base_tree, {})
    return carry, ws


def carried_tree(carry_path: Path, base_tree: Path) -> dict:
    """The tool's carried tree for ``carry_path`` on ``base_tree``: ``{path: (bytes, mode) or None}``
    for every path the carry names (the differential test compares it with git apply's).

    Raises:
        ApplyError / CarryRefused as :func:`carry_workspace`.
    """
    carry, ws = carry_workspace(carry_path, base_tree)
    out = {}
    for cf in carry.files:
        for p in (cf.old_path, cf.new_path):
            if p:
                st = ws.files[p]
                base_exec = (base_tree / p).is_file() and os.stat(base_tree / p).st_mode & 0o111
                mode = st.mode or ("100755" if base_exec else "100644")
                out[p] = (st.text.encode("utf-8"), mode) if st.exists else None
    return out


def read_base(base_tree: Path, path: str) -> Optional[str]:
    """Text of ``path`` in the base tree (None when absent); bytes decoded as UTF-8, line ends kept.

    Raises:
        ApplyError: the file is not UTF-8 (the tool would not reproduce its bytes).
    """
    p = base_tree / path
    if not p.is_file():
        return None
    data = p.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApplyError(f"{path} in the base tree is not UTF-8 (byte {exc.start}); the tool cannot edit it.",
                         hint="Leave this file out of the carried patch and the recipe.") from exc
