"""Hunks of an upstream commit, with stable ids.

A hunk id is ``<path>#<n>``: the n-th hunk (1-based) of that file in
``git show --format= -U3 --no-renames <commit>``. The digest is the sha256 of the hunk
text, so a recipe written against one commit cannot silently match another.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import git
from unidiff import PatchSet
from unidiff.patch import Hunk

from .sources import Source


@dataclass(frozen=True)
class UpstreamHunk:
    """One hunk of the upstream commit.

    Attributes:
        id: ``<path>#<n>``.
        path: file path (target path; source path for deletions).
        header: the ``@@ -a,b +c,d @@ section`` line.
        added, removed: line counts, computed from the hunk.
        digest: sha256 of the hunk text (first 16 hex digits).
        hunk: the parsed unidiff hunk.
    """

    id: str
    path: str
    header: str
    added: int
    removed: int
    digest: str
    hunk: Hunk


def diff_text(source: Source, commit: str, paths: tuple[str, ...] = ()) -> str:
    """``git show`` of ``commit`` as a plain unified diff (3 lines of context, no renames).

    Raises:
        SourceError: git cannot read the commit from the cache (a damaged pack), naming the cache.
    """
    try:
        data = source.repo.git.show("--format=", "-U3", "--no-renames", "--no-color", "--no-ext-diff", commit, "--",
                                    *paths, stdout_as_string=False, strip_newline_in_stdout=False)
    except git.GitCommandError as exc:  # the commit was resolved: git failing here is the cache's fault
        raise source.damaged(exc, f"show {commit[:12]}") from exc
    return data.decode("utf-8")  # whatever the locale: GitPython would decode with the locale's codec


def load_hunks(source: Source, commit: str) -> list[UpstreamHunk]:
    """Every hunk of ``commit``, in file then position order."""
    patch = PatchSet(diff_text(source, commit))
    out = []
    for pfile in patch:
        path = pfile.target_file[2:] if pfile.target_file != "/dev/null" else pfile.source_file[2:]
        for n, hunk in enumerate(pfile, start=1):
            text = str(hunk)
            header = text.splitlines()[0]
            out.append(UpstreamHunk(
                id=f"{path}#{n}", path=path, header=header,
                added=hunk.added, removed=hunk.removed,
                digest=hashlib.sha256(text.encode()).hexdigest()[:16], hunk=hunk,
            ))
    return out
