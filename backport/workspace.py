"""Files being edited, with the origin of every line.

Each file keeps its lines and, per line, a tag: ``("base", i)`` for line ``i`` of the
pristine base file, or the id of the origin (a recipe step or an upstream/carried hunk)
that wrote it. Removing a base line records which origin removed it. The final diff's
added and removed lines are attributed from these tags, so counts are computed.

Hunks are applied with zero fuzz: context and removed lines must match exactly; an
offset from the header's line number is allowed and recorded.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Optional

from unidiff.patch import Hunk

from .errors import ApplyError

Tag = tuple  # ("base", index) or ("origin", origin_id)


@dataclass
class FileState:
    """One file of the workspace.

    Attributes:
        path: tree-relative POSIX path.
        base_lines: lines of the pristine base file (keepends); empty for a new file.
        lines: current lines (keepends).
        tags: one tag per current line.
        removed_by: base line index -> origin id that removed it.
        exists_in_base: False for files the recipe adds.
    """

    path: str
    base_lines: list[str]
    lines: list[str]
    tags: list[Tag]
    removed_by: dict[int, str] = field(default_factory=dict)
    exists_in_base: bool = True
    last_offset: int = 0
    hunk_growth: int = 0

    @classmethod
    def from_base(cls, path: str, text: Optional[str]) -> "FileState":
        """State of ``path`` at the base; ``text`` None means the file is new."""
        lines = (text or "").splitlines(keepends=True)
        return cls(path, list(lines), list(lines), [("base", i) for i in range(len(lines))],
                   exists_in_base=text is not None)

    @property
    def text(self) -> str:
        """Current content."""
        return "".join(self.lines)

    def _splice(self, start: int, stop: int, new_lines: list[str], origin: str) -> None:
        for tag in self.tags[start:stop]:
            if tag[0] == "base":
                self.removed_by[tag[1]] = origin
        self.lines[start:stop] = new_lines
        self.tags[start:stop] = [("origin", origin)] * len(new_lines)

    def replace_text(self, new_text: str, origin: str) -> bool:
        """Set the content to ``new_text``; changed lines are tagged ``origin``.

        Returns:
            True when the content changed.
        """
        new_lines = new_text.splitlines(keepends=True)
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

    def apply_hunk(self, hunk: Hunk, origin: str) -> int:
        """Apply one unified-diff hunk with zero fuzz; return its line offset (0 = in place,
        counted like GNU patch: against the header line plus the growth of earlier hunks).

        Like GNU patch, the search starts where the previous hunk of this file landed
        (its offset carried forward), and the exact match nearest to that guess wins.

        Raises:
            ApplyError: the hunk's context/removed lines are not found exactly.
        """
        source = [_line_text(line) for line in hunk if line.is_context or line.is_removed]
        target = [_line_text(line) for line in hunk if line.is_context or line.is_added]
        header_pos = max(hunk.source_start - 1, 0) if hunk.source_length else hunk.source_start
        expected = header_pos + self.last_offset
        if not source:
            if self.lines:
                raise ApplyError(f"{self.path}: hunk for origin {origin} creates a file that already exists.")
            self._splice(0, 0, target, origin)
            return 0
        n = len(source)
        matches = [i for i in range(len(self.lines) - n + 1) if self.lines[i:i + n] == source]
        if not matches:
            raise ApplyError(
                f"{self.path}: hunk {hunk.source_start},{hunk.source_length} of origin {origin} does "
                "not apply with zero fuzz (its context or removed lines differ from the tree).",
            )
        start = min(matches, key=lambda i: (abs(i - expected), i))
        self._apply_at(start, hunk, origin)
        offset = start - (header_pos + self.hunk_growth)
        self.hunk_growth += len(target) - len(source)
        self.last_offset = start - header_pos + len(target) - len(source)
        return offset

    def _apply_at(self, start: int, hunk: Hunk, origin: str) -> None:
        pos = start
        for line in hunk:
            if line.is_context:
                pos += 1
            elif line.is_removed:
                self._splice(pos, pos + 1, [], origin)
            elif line.is_added:
                self._splice(pos, pos, [_line_text(line)], origin)
                pos += 1



def _line_text(line) -> str:
    return line.value


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
        """Files whose content differs from the base, sorted by path."""
        return [f for _, f in sorted(self.files.items()) if f.lines != f.base_lines or not f.exists_in_base]
