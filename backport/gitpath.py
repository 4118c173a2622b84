"""File names as patches write them: git's C-style quoting, undone.

``git diff`` quotes a name holding bytes outside printable ASCII (with the default
``core.quotepath=true``, every byte >= 0x80), a ``"``, a ``\\`` or a control character: the
whole name goes in double quotes and such bytes become C escapes (``"a/caf\\303\\251.py"``).
The rules are git's ``quote_c_style`` / ``unquote_c_style`` (git's ``quote.c``): ``\\a \\b \\t
\\n \\v \\f \\r \\" \\\\`` and three octal digits for any other byte. A name outside quotes is
taken as it is (``core.quotepath=false`` writes UTF-8 names so).
"""

from __future__ import annotations

import re

_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}
_QUOTED = re.compile(r'"((?:[^"\\]|\\(?:[0-3][0-7]{2}|[abtnvfr"\\]))*)"')


def split_quoted(text: str) -> "tuple[str, str] | None":
    """``(name, rest)`` when ``text`` starts with a C-quoted name, ``rest`` the text after its
    closing quote; None when it does not start with a well-formed quoted name."""
    m = _QUOTED.match(text)
    return (m.group(0), text[m.end():]) if m else None


def unquote(name: str) -> str:
    """The file name that ``name`` (as git writes it in a patch) stands for.

    ``"a/caf\\303\\251.py"`` -> ``a/café.py``; a name without quotes is returned unchanged.

    Raises:
        ValueError: a quoted name that is malformed (an unknown escape, no closing quote,
            text after it) or whose bytes are not UTF-8.
    """
    if not name.startswith('"'):
        return name
    parts = split_quoted(name)
    if parts is None or parts[1]:
        raise ValueError(f"malformed quoted file name {name}")
    out = bytearray()
    body = parts[0][1:-1]
    i = 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out += ch.encode("utf-8")
            i += 1
        elif body[i + 1] in _ESCAPES:
            out.append(_ESCAPES[body[i + 1]])
            i += 2
        else:
            out.append(int(body[i + 1:i + 4], 8))
            i += 4
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"quoted file name {name} is not UTF-8 (byte {exc.start})") from exc


def patch_path(pfile) -> str:
    """Tree path of a unidiff ``PatchedFile`` (its ``path`` without the ``a/``/``b/`` prefix), unquoted.

    unidiff keeps git's quotes (``"caf\\303\\251.py"``), so a path read from a patch must go
    through here before it is looked up among the files of a run.

    Raises:
        ValueError: as :func:`unquote`.
    """
    path = pfile.path
    if path.startswith('"'):
        path = unquote(path)
    return path
