"""Files being edited, with the origin of every line; hunk placement; tree-path safety.

Each file keeps its lines and, per line, a tag: ``("base", i)`` for line ``i`` of the
pristine base file, or the id of the origin (a recipe step or an upstream/carried hunk)
that wrote it. Removing a base line records which origin removed it. The final diff's
added and removed lines are attributed from these tags, so counts are computed.

Lines are split on ``\\n`` only and keep their ending, so CRLF files and a missing final
newline round-trip byte for byte. Hunks are applied with zero fuzz: context and removed
lines must match exactly, and only inside the same enclosing class/function as in the
hunk's source (:func:`enclosing_symbol`); an offset from the header's line number is
allowed and recorded; a carried hunk whose context matches more than once goes where ``git
apply`` puts it (the header's line, else the nearest match). :func:`check_tree_path` keeps
every path inside the tree root.

Symbols and bindings come from one parse per text (:class:`SymbolMap`, :class:`SymbolMaps`,
:class:`BindingMap`), asked per hunk or line, so a carry costs its hunks plus its lines, not
their product.
"""

from __future__ import annotations

import ast
import difflib
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from .errors import ApplyError

Tag = tuple  # ("base", index) or ("origin", origin_id)


def split_lines(text: str) -> list[str]:
    """Split on ``\\n`` only, keeping endings (``\\r\\n`` stays on its line; no final newline kept as is)."""
    if not text:
        return []
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def check_tree_path(rel: str, root: Optional[Path], error=ApplyError, what: str = "path",
                    hint: Optional[str] = None) -> str:
    """Refuse ``rel`` unless it names a place inside the tree ``root``; return it normalised.

    Refused: empty, absolute, ``..`` components, backslashes or NUL, a path not in normal form
    (``./``, ``//``, a trailing ``/``: two spellings of one file would escape the checks that
    compare paths), and (when ``root`` is
    given) any existing component that is a symlink resolving outside ``root``.

    Raises:
        ``error`` (ApplyError for a carry, RecipeError for the recipe), naming ``what`` and the path.
    """
    hint = hint or "Use a path relative to the tree root (e.g. megatron/core/...), without '..' or a leading '/'."
    bad = None
    if not rel or "\0" in rel or "\\" in rel:
        bad = "it is empty or holds a NUL or backslash"
    elif rel.startswith("/") or posixpath.isabs(rel):
        bad = "it is absolute"
    elif any(part == ".." for part in rel.split("/")):
        bad = "it contains '..'"
    elif posixpath.normpath(rel) in (".", ""):
        bad = "it names the tree root itself"
    elif posixpath.normpath(rel) != rel:
        bad = f"it is not in normal form (no './', '//' or trailing '/'): write {posixpath.normpath(rel)!r}"
    if bad is None and root is not None:
        root_real = root.resolve()
        cur = root
        for part in posixpath.normpath(rel).split("/"):
            cur = cur / part
            if cur.is_symlink():
                target = cur.resolve()
                if target != root_real and root_real not in target.parents:
                    bad = f"{cur.relative_to(root)} is a symlink leading out of the tree (to {target})"
                    break
    if bad is not None:
        raise error(f"{what} {rel!r} is refused: {bad}; nothing was read or written.", hint=hint)
    return posixpath.normpath(rel)


# --- enclosing symbols ---------------------------------------------------------------------------

def parse_python(text: str):
    """``ast.parse(text)``, or None when ``text`` is not valid Python. Every symbol and binding
    map of this module parses through here (a test counts the calls: one per file and text)."""
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


#: the fields of a statement (or handler, or match case) that hold statements: the only places
#: a def or class can be (expressions hold none), visited in each node's own field order
_BLOCKS = frozenset(("body", "handlers", "orelse", "finalbody", "cases"))
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _spans_of(tree) -> list[tuple[int, int, str]]:
    """Def/class spans of a parsed module, in the order ``ast.iter_child_nodes`` meets them
    (statement blocks only: expressions are not walked)."""
    spans = []
    seen: dict[str, int] = {}

    def walk(node, prefix):
        for fname in node._fields:
            if fname not in _BLOCKS:
                continue
            block = getattr(node, fname, None)
            if not isinstance(block, list):  # Lambda.body, IfExp.body: expressions
                continue
            for child in block:
                if isinstance(child, _DEFS):
                    name = prefix + child.name
                    seen[name] = seen.get(name, 0) + 1
                    if seen[name] > 1:  # a second definition of the same name is another symbol
                        name = f"{name}[{seen[name]}]"
                    first = min([child.lineno] + [d.lineno for d in child.decorator_list]) - 1
                    spans.append((first, child.end_lineno - 1, name))
                    walk(child, name + ".")
                else:
                    walk(child, prefix)

    walk(tree, "")
    return spans


def symbol_spans(text: str) -> Optional[list[tuple[int, int, str]]]:
    """``(first, last, qualname)`` 0-based inclusive line spans of every def/class, or None
    when ``text`` is not valid Python (decorators belong to their def)."""
    tree = parse_python(text)
    return None if tree is None else _spans_of(tree)


class SymbolMap:
    """The enclosing symbol of every line of one text, from one parse.

    Built once per file text and asked once per hunk or line (:meth:`at`, :meth:`span`), so
    placing or checking the hunks of a file costs one parse, not one per hunk. ``at`` gives
    what :func:`enclosing_symbol` gives on :func:`symbol_spans` of the same text.
    """

    def __init__(self, text: str, tree=False):
        """``tree``: ``parse_python(text)`` when the caller has it already (not parsed again)."""
        tree = parse_python(text) if tree is False else tree
        self.spans: Optional[list] = None if tree is None else _spans_of(tree)
        self._inner: list = []
        self._by_name: dict = {}
        if self.spans is None:
            return
        width: list = []
        for first, last, name in self.spans:  # innermost wins; of equal widths the first, as enclosing_symbol
            self._by_name.setdefault(name, (first, last))
            if last >= len(self._inner):
                grow = last + 1 - len(self._inner)
                self._inner += [""] * grow
                width += [None] * grow
            w = last - first
            for line in range(first, last + 1):
                if width[line] is None or w < width[line]:
                    self._inner[line], width[line] = name, w

    @property
    def valid(self) -> bool:
        """Whether the text is valid Python."""
        return self.spans is not None

    def at(self, line: int) -> Optional[str]:
        """Innermost qualname holding 0-based ``line``; ``""`` module level; None if not Python."""
        if self.spans is None:
            return None
        return self._inner[line] if 0 <= line < len(self._inner) else ""

    def span(self, name: str) -> Optional[tuple[int, int]]:
        """``(first, last)`` 0-based inclusive lines of the first symbol called ``name``, or None."""
        return self._by_name.get(name)


class SymbolMaps:
    """:class:`SymbolMap` per text, for one build: a text is parsed once however often it is
    asked for (the determinism run and ``carry_survival`` see the same base and carried files)."""

    def __init__(self):
        self._maps: dict = {}

    def get(self, text: str) -> SymbolMap:
        """The map of ``text`` (parsed on the first request)."""
        found = self._maps.get(text)
        if found is None:
            found = self._maps[text] = SymbolMap(text)
        return found


def _bound_names(stmt) -> list[str]:
    """Names a module- or class-level statement binds (defs, classes, assignments, imports)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, ast.AnnAssign):
        return [stmt.target.id] if isinstance(stmt.target, ast.Name) else []
    if isinstance(stmt, ast.Assign):
        return [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in stmt.names if a.name != "*"]
    return []


def _binding_form(stmt, name: str) -> str:
    """What a statement binds ``name`` to, comparable across files: the imported object for
    an import, else the statement's AST (comments and layout ignored)."""
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        alias = next(a for a in stmt.names if (a.asname or a.name).split(".")[0] == name)
        return f"import {'.' * getattr(stmt, 'level', 0)}{getattr(stmt, 'module', '') or ''}:{alias.name}"
    return ast.dump(stmt)


class BindingMap:
    """Every name bound at module level (scope ``""``) or directly in a class body (scope: the
    class qualname) in one text, from one parse.

    A binding's form (:func:`_binding_form`, a dump of the whole statement for a def) is
    computed only when :meth:`forms` asks for that name, and the line index only when
    :meth:`keys_at` is first asked: checking every hunk of a file costs one parse and one pass.
    """

    def __init__(self, text: str, tree=False):
        """``tree``: ``parse_python(text)`` when the caller has it already (not parsed again)."""
        tree = parse_python(text) if tree is False else tree
        self.valid = tree is not None
        #: (scope, name) -> [(first, last, statement)], 0-based inclusive lines (decorators
        #: included), in file order
        self.spans: dict = {}
        self._forms: dict = {}
        self._index: Optional[dict] = None
        if tree is None:
            return

        def walk(body, scope):
            for stmt in body:
                first = min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])]) - 1
                for name in _bound_names(stmt):
                    self.spans.setdefault((scope, name), []).append((first, stmt.end_lineno - 1, stmt))
                if isinstance(stmt, ast.ClassDef):
                    walk(stmt.body, (scope + "." if scope else "") + stmt.name)

        walk(tree.body, "")

    def forms(self, key) -> list:
        """The forms of every binding of ``key`` (``(scope, name)``), in file order."""
        if key not in self._forms:
            self._forms[key] = [_binding_form(stmt, key[1]) for _f, _l, stmt in self.spans.get(key, [])]
        return self._forms[key]

    def keys_at(self, lines: Sequence[int]) -> set:
        """``(scope, name)`` of every binding whose statement holds one of the 0-based ``lines``."""
        if self._index is None:
            self._index = {}
            for key, spans in self.spans.items():
                for first, last, _stmt in spans:
                    for line in range(first, last + 1):
                        self._index.setdefault(line, set()).add(key)
        out: set = set()
        for line in lines:
            out |= self._index.get(line, set())
        return out


def _binding_map(text) -> BindingMap:
    return text if isinstance(text, BindingMap) else BindingMap(text)


def bindings(text: str) -> Optional[dict]:
    """``{(scope, name): [(first, last, form), ...]}``: every name bound at module level (scope
    ``""``) or directly in a class body (scope: the class qualname), with the 0-based inclusive
    line span of each binding statement (decorators included) and its form
    (:func:`_binding_form`), in file order; None when ``text`` is not valid Python."""
    found = BindingMap(text)
    if not found.valid:
        return None
    return {key: [(first, last, form) for (first, last, _s), form in zip(spans, found.forms(key))]
            for key, spans in found.spans.items()}


def bindings_at(text, lines: Sequence[int]) -> set:
    """``(scope, name)`` of every module/class-level binding whose statement holds one of the
    0-based ``lines`` of ``text`` (a str, or its :class:`BindingMap`; empty for invalid Python)."""
    return _binding_map(text).keys_at(lines)


def new_bindings(before, after, keys) -> list:
    """Of ``keys`` (``(scope, name)``), those ``after`` binds more often than ``before`` does
    with a form ``before`` does not already give it (an identical second import or statement
    is not a new binding), sorted. ``before``/``after``: texts or their :class:`BindingMap`."""
    was, now = _binding_map(before), _binding_map(after)
    out = []
    for key in sorted(keys):
        old, new = was.spans.get(key, []), now.spans.get(key, [])
        if len(new) > len(old) and not set(now.forms(key)) <= set(was.forms(key)):
            out.append(key)
    return out


def enclosing_symbol(spans: Optional[list], line: int) -> Optional[str]:
    """Innermost qualname whose span holds 0-based ``line``; ``""`` for module level; None if unknown."""
    if spans is None:
        return None
    best = ""
    width = None
    for first, last, name in spans:
        if first <= line <= last and (width is None or last - first < width):
            best, width = name, last - first
    return best


def anchor_line(source: Sequence[str], changes: Sequence[tuple[int, str]], start: int) -> int:
    """0-based line (in the file the hunk is applied to, hunk at ``start``) whose symbol
    decides where the hunk belongs: its first removed line, else the context line just
    before its first added line, else the first line after it."""
    for idx, kind in changes:
        if kind == "-":
            return start + idx
    for idx, kind in changes:
        if kind == "+":
            return start + idx - 1 if idx > 0 else start
    return start


@dataclass(frozen=True)
class HunkLines:
    """A hunk reduced to what placement needs.

    Attributes:
        source: context + removed lines (keepends, ``\\ No newline`` honoured).
        target: context + added lines.
        changes: ``(index into source, '-')`` per removed line and ``(index into source
            where it is inserted, '+')`` per added line, in hunk order.
        header_pos: 0-based line the header names.
        section: text after the second ``@@`` of the header (git's function name), may be empty.
        leading, trailing: context lines before the first / after the last change.
    """

    source: tuple
    target: tuple
    changes: tuple
    header_pos: int
    section: str = ""
    leading: int = 0
    trailing: int = 0


def hunk_lines(hunk) -> HunkLines:
    """:class:`HunkLines` of a unidiff hunk, honouring ``\\ No newline at end of file``."""
    source, target, changes = [], [], []
    kinds = []
    for line in hunk:
        if line.line_type == "\\":
            # strips the newline of the line just before it, on the side(s) that line is on
            prev = kinds[-1] if kinds else None
            if prev in (" ", "-") and source:
                source[-1] = _strip_newline(source[-1])
            if prev in (" ", "+") and target:
                target[-1] = _strip_newline(target[-1])
            continue
        kinds.append(line.line_type)
        if line.is_context:
            source.append(line.value)
            target.append(line.value)
        elif line.is_removed:
            changes.append((len(source), "-"))
            source.append(line.value)
        elif line.is_added:
            changes.append((len(source), "+"))
            target.append(line.value)
    first_change = next((i for i, k in enumerate(kinds) if k in "+-"), len(kinds))
    last_change = max((i for i, k in enumerate(kinds) if k in "+-"), default=-1)
    leading = sum(1 for k in kinds[:first_change] if k == " ")
    trailing = sum(1 for k in kinds[last_change + 1:] if k == " ")
    header_pos = max(hunk.source_start - 1, 0) if hunk.source_length else hunk.source_start
    return HunkLines(tuple(source), tuple(target), tuple(changes), header_pos,
                     (hunk.section_header or "").strip(), leading, trailing)


def _strip_newline(line: str) -> str:
    if line.endswith("\r\n"):
        return line[:-2]
    return line[:-1] if line.endswith("\n") else line


def _line_ending_note(source: list, lines: list) -> str:
    """``"; line endings differ: ..."`` when the hunk's lines and the file's end differently
    (CRLF against LF, a Windows editor's carry), else ``""``: the zero-fuzz refusal says so."""
    def crlf(seq: list) -> Optional[bool]:
        ends = [ln.endswith("\r\n") for ln in seq if ln.endswith("\n")]
        return None if not ends else sum(ends) * 2 > len(ends)

    hunk, tree = crlf(source), crlf(lines)
    if hunk is None or tree is None or hunk == tree:
        return ""
    name = {True: "CRLF", False: "LF"}
    return (f"; line endings differ: the hunk's lines end in {name[hunk]}, the file's in {name[tree]}"
            f" (convert the carried patch's line endings to the file's, e.g. dos2unix, and carry it again)")


@dataclass
class FileState:
    """One file of the workspace.

    Attributes:
        path: tree-relative POSIX path.
        base_lines: lines of the pristine base file (keepends); empty for a new file.
        lines: current lines (keepends).
        tags: one tag per current line.
        removed_by: base line index -> origin id that removed it.
        exists_in_base: False for files the recipe or carry adds.
        exists: False once a carry deletes (or renames away) the file.
        base_mode, mode: git file modes (``"100644"``/``"100755"``) when a carry set one,
            else None (the output patch then carries no mode).
        mode_origin: origin id of a mode change.
    """

    path: str
    base_lines: list[str]
    lines: list[str]
    tags: list[Tag]
    removed_by: dict[int, str] = field(default_factory=dict)
    exists_in_base: bool = True
    exists: bool = True
    base_mode: Optional[str] = None
    mode: Optional[str] = None
    mode_origin: Optional[str] = None
    last_offset: int = 0
    hunk_growth: int = 0
    #: how the last :meth:`apply_hunk` placed a hunk whose context matched more than once
    placed: Optional[dict] = None

    @classmethod
    def from_base(cls, path: str, text: Optional[str]) -> "FileState":
        """State of ``path`` at the base; ``text`` None means the file is new."""
        lines = split_lines(text or "")
        return cls(path, list(lines), list(lines), [("base", i) for i in range(len(lines))],
                   exists_in_base=text is not None, exists=text is not None)

    @property
    def text(self) -> str:
        """Current content."""
        return "".join(self.lines)

    @property
    def changed(self) -> bool:
        """True when content, existence or mode differ from the base."""
        return (self.lines != self.base_lines or self.exists != self.exists_in_base
                or (self.mode or self.base_mode) != self.base_mode)

    def _splice(self, start: int, stop: int, new_lines: list[str], origin: str) -> None:
        for tag in self.tags[start:stop]:
            if tag[0] == "base":
                self.removed_by[tag[1]] = origin
        self.lines[start:stop] = new_lines
        self.tags[start:stop] = [("origin", origin)] * len(new_lines)

    def delete(self, origin: str) -> None:
        """Remove the file (every base line recorded as removed by ``origin``)."""
        self._splice(0, len(self.lines), [], origin)
        self.exists = False

    def create(self, lines: list[str], origin: str, tags: Optional[list] = None) -> None:
        """Make the (absent) file exist with ``lines`` tagged ``origin`` (or ``tags``)."""
        self.lines = list(lines)
        self.tags = list(tags) if tags is not None else [("origin", origin)] * len(lines)
        self.exists = True

    def replace_text(self, new_text: str, origin: str) -> bool:
        """Set the content to ``new_text``; changed lines are tagged ``origin``.

        Returns:
            True when the content changed.
        """
        new_lines = split_lines(new_text)
        self.exists = True
        if new_lines == self.lines:
            return False
        matcher = difflib.SequenceMatcher(None, self.lines, new_lines, autojunk=False)
        lines, tags = [], []
        for op, i1, i2, j1, j2 in matcher.get_opcodes():
            if op == "equal":
                lines += self.lines[i1:i2]
                tags += self.tags[i1:i2]
                continue
            for tag in self.tags[i1:i2]:
                if tag[0] == "base":
                    self.removed_by[tag[1]] = origin
            lines += new_lines[j1:j2]
            tags += [("origin", origin)] * (j2 - j1)
        self.lines, self.tags = lines, tags
        return True

    def apply_hunk(self, hunk, origin: str, source_symbol: Optional[str] = None,
                   source_text: Optional[str] = None, base_symbols: Optional[SymbolMap] = None,
                   by_header: bool = False) -> int:
        """Apply one unified-diff hunk (unidiff ``Hunk`` or :class:`HunkLines`) with zero fuzz;
        return its line offset (0 = in place, counted like GNU patch: against the header line
        plus the growth of earlier hunks of this file).

        Placement: the context and removed lines must match exactly, inside the same
        enclosing class/function as in the hunk's source. ``source_symbol`` is that symbol
        (``""`` module level; None: unknown, placement by nearest match as GNU patch does),
        or ``"?"`` to compute it from ``source_text`` (the file the hunk was made against)
        at the header position. Among matches in that symbol the one nearest the expected
        line wins only when it is the only one; two in the symbol are refused, unless
        ``by_header`` (a carried hunk, placed as ``git apply`` places it): then the match at the
        line the header names (its ``-`` line, moved by what earlier hunks of this file added
        or removed) wins, else the match nearest that line, and only two equally near ones
        are refused. :attr:`placed` says how the hunk was placed when its context matched
        more than once (``{"placed": "header" or "nearest", "matches": [base lines]}``), else None.

        ``base_symbols`` (the :class:`SymbolMap` of this file's base text): the symbol of a
        match is looked up through the line tags, at the base line it is (the hunk was made
        against the base), so placing every hunk of a file costs no parse; a line an origin
        wrote is looked up in one parse of the current text. Without it, the current text is
        parsed once per call.

        Raises:
            ApplyError: not found, found only in another symbol, found twice in the symbol,
                or already applied (its result is already in the file); its ``reason`` says
                which (:func:`_refused`).
        """
        h = hunk if isinstance(hunk, HunkLines) else hunk_lines(hunk)
        source, target = list(h.source), list(h.target)
        expected = h.header_pos + self.last_offset
        if not source:
            if self.lines and self.exists:
                raise _refused(f"{self.path}: hunk of origin {origin} creates a file that already exists.", "exists")
            self._splice(0, 0, target, origin)
            self.exists = True
            return 0
        if source_symbol == "?":
            source_symbol = SymbolMap(source_text or "").at(anchor_line(source, h.changes, h.header_pos))
        matches = _matches(self.lines, source)
        where = f"{self.path}: hunk {_header(h)} of origin {origin}"
        self.placed = None
        if not matches:
            if target and target != source and _matches(self.lines, target):
                raise _refused(f"{where} is already applied: its result is already in the file.", "already",
                               hint=_ALREADY_HINT)
            raise _refused(
                f"{where} does not apply with zero fuzz (its context or removed lines differ from the tree)"
                f"{_line_ending_note(source, self.lines)}.", "differs")
        chosen = matches
        symbol_of = self._symbol_lookup(base_symbols) if source_symbol is not None else None
        if symbol_of is not None:
            by_symbol = {i: symbol_of(anchor_line(source, h.changes, i)) for i in matches}
            chosen = [i for i in matches if by_symbol[i] in (source_symbol, _UNKNOWN)]
            label = source_symbol or "module level"
            if not chosen:
                elsewhere = sorted({by_symbol[i] or "module level" for i in matches})
                raise _refused(
                    f"{where} belongs in {label}, but its context matches only in {', '.join(elsewhere)} "
                    f"(line {matches[0] + 1}); it was not placed there.", "elsewhere",
                    hint="Regenerate the hunk against the pinned base so that it lands in the right symbol.")
            if len(chosen) > 1 and not by_header:
                raise _refused(
                    f"{where}: its context matches {len(chosen)} times inside {label} (lines "
                    f"{', '.join(str(i + 1) for i in chosen)}); the tool does not guess which.", "twice",
                    hint="Give the hunk more context (git diff -U5) so that it matches once.")
        if len(chosen) > 1 and by_header:
            start = self._by_header(chosen, h, where, source_symbol)
        else:
            start = min(chosen, key=lambda i: (abs(i - expected), i))
        self._apply_at(start, h, origin)
        offset = start - (h.header_pos + self.hunk_growth)
        self.hunk_growth += len(target) - len(source)
        self.last_offset = start - h.header_pos + len(target) - len(source)
        return offset

    def _symbol_lookup(self, base_symbols: Optional[SymbolMap]):
        """``line -> enclosing symbol`` of the current lines (``_UNKNOWN`` where it cannot be
        told), or None when the file is not Python (then placement ignores symbols)."""
        current: list = []

        def now() -> SymbolMap:
            if not current:
                current.append(SymbolMap(self.text))
            return current[0]

        if base_symbols is None:
            return now().at if now().valid else None
        if not base_symbols.valid:
            return None

        def at(line: int):
            tag = self.tags[line] if 0 <= line < len(self.tags) else None
            if tag is not None and tag[0] == "base":
                return base_symbols.at(tag[1])
            sym = now().at(line)  # a line an origin wrote: one parse of the current text
            return _UNKNOWN if sym is None else sym
        return at

    def _base_line(self, i: int) -> int:
        """1-based line of the base that current line ``i`` is (the current line where an origin wrote it)."""
        tag = self.tags[i] if 0 <= i < len(self.tags) else None
        return tag[1] + 1 if tag is not None and tag[0] == "base" else i + 1

    def _by_header(self, chosen: list, h: "HunkLines", where: str, symbol: Optional[str]) -> int:
        """Where a carried hunk whose context matches at every line of ``chosen`` goes, as
        ``git apply`` puts it: at the line its header names, else at the nearest match; two
        equally near ones are refused, quoting every candidate line."""
        at = h.header_pos + self.hunk_growth
        lines = [self._base_line(i) for i in chosen]
        if at in chosen:
            start, how = at, "header"
        else:
            best = min(abs(i - at) for i in chosen)
            near = [i for i in chosen if abs(i - at) == best]
            if len(near) > 1:
                label = "module level" if symbol == "" else symbol or "the file"
                raise _refused(
                    f"{where}: its context matches {len(chosen)} times inside {label} (lines "
                    f"{', '.join(map(str, lines))} of the base); none is at line {h.header_pos + 1}, the line its "
                    f"header names, and lines {' and '.join(str(self._base_line(i)) for i in near)} are equally near "
                    "it; the tool does not guess which.", "twice",
                    hint=f"Make the hunk's @@ line name the line where it belongs (a `git diff` against the pinned "
                         f"base writes it so), or widen its context until it matches once: one of lines "
                         f"{', '.join(map(str, lines))}.")
            start, how = near[0], "nearest"
        self.placed = {"placed": how, "matches": lines}
        return start

    def _apply_at(self, start: int, h: HunkLines, origin: str) -> None:
        # walk source and target together: changes are (source index, kind) in hunk order
        pos = start
        src_i = 0
        tgt = list(h.target)
        tgt_i = 0
        for idx, kind in list(h.changes) + [(len(h.source), "end")]:
            while src_i < idx:  # context
                if self.lines[pos] != tgt[tgt_i]:  # a '\ No newline' on one side only
                    self._splice(pos, pos + 1, [tgt[tgt_i]], origin)
                pos += 1
                src_i += 1
                tgt_i += 1
            if kind == "-":
                self._splice(pos, pos + 1, [], origin)
                src_i += 1
            elif kind == "+":
                self._splice(pos, pos, [tgt[tgt_i]], origin)
                pos += 1
                tgt_i += 1


#: the symbol of a line that cannot be told (an origin's line in a file that no longer parses):
#: it matches any symbol, as a file that is not Python does
_UNKNOWN = object()


def _matches(lines: list, source: list) -> list:
    """Every 0-based ``i`` where ``lines[i:i + len(source)] == source`` (``source`` not empty),
    in order; the candidates are found by ``list.index`` on the first line."""
    n, out, i = len(source), [], 0
    last = len(lines) - n
    if last < 0:
        return out
    first = source[0]
    while True:
        try:
            i = lines.index(first, i, last + 1)
        except ValueError:
            return out
        if lines[i:i + n] == source:
            out.append(i)
        i += 1


def _refused(message: str, reason: str, hint: Optional[str] = None) -> ApplyError:
    """A placement refusal; ``reason`` (``exists``, ``already``, ``differs``, ``elsewhere``, ``twice``) lets the
    caller give a hint that fits the hunk's origin (the hints here are written for a carried hunk)."""
    exc = ApplyError(message, hint=hint)
    exc.reason = reason
    return exc


_ALREADY_HINT = ("The base already contains this change (it may have landed upstream); drop the hunk "
                 "from the carried patch.")


def _header(h: HunkLines) -> str:
    return f"at line {h.header_pos + 1}" + (f" ({h.section})" if h.section else "")


@dataclass
class Workspace:
    """The files a run touches, keyed by path (sorted on output)."""

    files: dict[str, FileState] = field(default_factory=dict)

    def get(self, path: str, base_reader) -> FileState:
        """The state of ``path``, loading it from the base with ``base_reader(path)`` first."""
        if path not in self.files:
            self.files[path] = FileState.from_base(path, base_reader(path))
        return self.files[path]

    def changed(self) -> list[FileState]:
        """Files whose content, existence or mode differ from the base, sorted by path."""
        return [f for _, f in sorted(self.files.items()) if f.changed]
