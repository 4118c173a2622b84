"""Transplant named top-level symbols from an upstream file into the tree's file."""

from __future__ import annotations

import libcst as cst

from ..errors import ApplyError
from .cst import parse


def transplant(text: str, upstream_text: str, symbols: list[str], path: str, ref: str) -> str:
    """Append (or replace) top-level functions/classes ``symbols`` of ``upstream_text`` in ``text``.

    A symbol already defined in ``text`` is replaced in place; otherwise it is appended at
    the end of the module, in the order given.

    Raises:
        ApplyError: a symbol is not a top-level def/class of the upstream file.
    """
    up = parse(upstream_text, f"{path}@{ref}")
    module = parse(text, path)
    body = list(module.body)
    for name in symbols:
        node = next((s for s in up.body if isinstance(s, (cst.FunctionDef, cst.ClassDef)) and s.name.value == name), None)
        if node is None:
            raise ApplyError(f"{path}@{ref}: symbol {name!r} to transplant not found at top level.")
        node = node.with_changes(leading_lines=[cst.EmptyLine(indent=False), cst.EmptyLine(indent=False)])
        idx = next((i for i, s in enumerate(body) if isinstance(s, (cst.FunctionDef, cst.ClassDef)) and s.name.value == name), None)
        if idx is None:
            body.append(node)
        else:
            body[idx] = node
    return module.with_changes(body=body).code
