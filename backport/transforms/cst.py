"""Small libcst helpers shared by the transforms: find symbols, replace, insert."""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import libcst as cst
import libcst.matchers as m

from ..errors import ApplyError


@functools.lru_cache(maxsize=64)
def _parse_module(text: str) -> cst.Module:
    return cst.parse_module(text)


def parse(text: str, path: str) -> cst.Module:
    """Parse ``text``; ApplyError when it is not valid Python.

    Parsed modules are kept per text (libcst trees are immutable; a transform builds new ones):
    the determinism run of :func:`backport.engine.build` parses the same texts again."""
    try:
        return _parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise ApplyError(f"{path}: not valid Python before the transform: {exc}") from exc


def code_of(node: cst.CSTNode, module: cst.Module) -> str:
    """Source text of ``node`` in the formatting of ``module``."""
    return module.code_for_node(node)


def find_class(module: cst.Module, name: str, path: str) -> cst.ClassDef:
    """Top-level class ``name``; ApplyError naming the anchor when absent."""
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef) and stmt.name.value == name:
            return stmt
    raise ApplyError(f"{path}: anchor class {name!r} not found.")


def find_function(body: Sequence[cst.CSTNode], name: str, where: str) -> cst.FunctionDef:
    """Function ``name`` among ``body`` statements; ApplyError when absent."""
    for stmt in body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name:
            return stmt
    raise ApplyError(f"{where}: anchor function {name!r} not found.")


class _Replace(cst.CSTTransformer):
    def __init__(self, target: cst.CSTNode, new: cst.CSTNode):
        self.target, self.new, self.done = target, new, False

    def on_leave(self, original, updated):
        if original is self.target:
            self.done = True
            return self.new
        return updated


def _replace_statement(owner, target: cst.CSTNode, new):
    """``owner`` (a Module or compound statement) with the statement ``target`` somewhere in its
    statement bodies replaced by ``new``; None when ``target`` is no statement in them.

    Rebuilds only the nodes on the way down (``with_changes``), where a transformer rebuilds the
    whole module: a transform replacing one method of a large file paid for the file."""
    block = owner if isinstance(owner, cst.Module) else getattr(owner, "body", None)
    stmts = getattr(block, "body", None)
    if not isinstance(stmts, (list, tuple)):
        return None
    for i, stmt in enumerate(stmts):
        if stmt is target:
            if isinstance(new, cst.RemovalSentinel):
                middle = []
            elif isinstance(new, cst.FlattenSentinel):
                middle = list(new.nodes)
            else:
                middle = [new]
        elif isinstance(stmt, cst.BaseCompoundStatement):
            sub = _replace_statement(stmt, target, new)
            if sub is None:
                continue
            middle = [sub]
        else:
            continue
        block = block.with_changes(body=[*stmts[:i], *middle, *stmts[i + 1:]])
        return block if isinstance(owner, cst.Module) else owner.with_changes(body=block)
    return None


def replace_node(module: cst.Module, target: cst.CSTNode, new, path: str) -> cst.Module:
    """Replace ``target`` (an exact node of ``module``) with ``new`` (node, or RemoveFromParent/FlattenSentinel).

    A statement in statement bodies (a class, a method, ...) is replaced along its path
    (:func:`_replace_statement`); any other node by a transformer over the whole module."""
    if isinstance(target, cst.BaseStatement):
        out = _replace_statement(module, target, new)
        if out is not None:
            return out
    tr = _Replace(target, new)
    out = module.visit(tr)
    if not tr.done:
        raise ApplyError(f"{path}: internal: node to replace not found.")
    return out


def statements(code: str) -> list[cst.BaseStatement]:
    """Parse ``code`` into statements for insertion into any block.

    Comments before the first statement are kept (as its leading lines), and blank lines
    carry no indentation so that no trailing whitespace appears at any depth.
    """
    module = cst.parse_module(code)
    body = list(module.body)
    if body:
        body[0] = body[0].with_changes(leading_lines=list(module.header) + list(body[0].leading_lines))
    return [stmt.visit(_BlankLines()) for stmt in body]


class _BlankLines(cst.CSTTransformer):
    def leave_EmptyLine(self, original, updated):
        if updated.comment is None:
            return updated.with_changes(indent=False, whitespace=cst.SimpleWhitespace(""))
        return updated


def find_in(node: cst.CSTNode, matcher) -> list[cst.CSTNode]:
    """All descendants of ``node`` matching ``matcher``."""
    return list(m.findall(node, matcher))


def insert_after(block_owner: cst.CSTNode, predicate: Callable[[cst.CSTNode], bool],
                 new: Sequence[cst.BaseStatement], what: str) -> cst.CSTNode:
    """Return ``block_owner`` (a class/function) with ``new`` inserted after the first body
    statement satisfying ``predicate``; ApplyError naming ``what`` when none does."""
    body = list(block_owner.body.body)
    for i, stmt in enumerate(body):
        if predicate(stmt):
            body[i + 1:i + 1] = list(new)
            return block_owner.with_changes(body=block_owner.body.with_changes(body=body))
    raise ApplyError(f"anchor {what} not found.")


def has_text(node: cst.CSTNode, module: cst.Module, needle: str) -> bool:
    """True when the source of ``node`` contains ``needle``."""
    return needle in module.code_for_node(node)


def first(nodes: list, what: str) -> cst.CSTNode:
    """First element or ApplyError naming ``what``."""
    if not nodes:
        raise ApplyError(f"anchor {what} not found.")
    return nodes[0]


def maybe(nodes: list) -> Optional[cst.CSTNode]:
    """First element or None."""
    return nodes[0] if nodes else None
