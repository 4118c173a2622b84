"""The preserved downstream fixes (decisions 7a and 7b), recognised by their effect on the AST: a
carried patch that already has a fix in another spelling keeps its form (``already-present``),
an undecidable construct is refused, and only the base form is rewritten."""

from __future__ import annotations

import ast
from typing import Callable

import libcst as cst
import libcst.matchers as m

from ..errors import ApplyError
from . import Result, register
from .cst import code_of, find_class, find_function, parse, replace_node


_DYNAMO_DISABLE = {"torch.compiler.disable", "torch._dynamo.disable", "torch._disable_dynamo"}
_DYNAMO_OFF_CM = {"torch.compiler.set_stance", "torch._dynamo.set_stance"}
#: The method fix 7a keeps away from Dynamo.
PREPARE_QKV = _PREPARE = "_prepare_qkv_for_gated_delta_rule"


def _dotted(node) -> str:
    """``a.b.c`` of a Name/Attribute chain (the callee for a Call), else ''."""
    if isinstance(node, ast.Call):
        node = node.func
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _aliases(tree: ast.Module) -> dict:
    """Local names bound by ``from torch.compiler import disable`` and the like -> full name."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
    return out


def _full(node, aliases: dict) -> str:
    name = _dotted(node)
    head, _, rest = name.partition(".")
    if head in aliases:
        return aliases[head] + ("." + rest if rest else "")
    return name


def _is_self_prepare(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == _PREPARE and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def _cm_disables_dynamo(item: ast.withitem, aliases: dict) -> "bool | None":
    """True: the context manager turns Dynamo off; None: unknown construct."""
    expr = item.context_expr
    name = _full(expr, aliases)
    if name in _DYNAMO_OFF_CM and isinstance(expr, ast.Call):
        arg = expr.args[0] if expr.args else next((k.value for k in expr.keywords if k.arg == "stance"), None)
        return True if isinstance(arg, ast.Constant) and arg.value == "force_eager" else None
    if name == "torch._dynamo.config.patch" and isinstance(expr, ast.Call):
        kw = {k.arg: k.value for k in expr.keywords}
        if isinstance(kw.get("disable"), ast.Constant) and kw["disable"].value is True:
            return True
        if (len(expr.args) == 2 and isinstance(expr.args[0], ast.Constant) and expr.args[0].value == "disable"
                and isinstance(expr.args[1], ast.Constant) and expr.args[1].value is True):
            return True
        return None
    return None


def dynamo_state(text: str) -> tuple[str, str]:
    """Whether ``GatedDeltaNet._prepare_qkv_for_gated_delta_rule`` is kept away from Dynamo,
    judged by the AST: ``("present", form)``, ``("absent", "")`` (the base form: no decorator
    but ``jit_fuser``, plain call sites) or ``("undecidable", construct)``.

    Recognised forms: a decorator ``torch.compiler.disable`` / ``torch._dynamo.disable``
    (called or not, also through ``from ... import``); ``self._prepare_qkv_for_gated_delta_rule
    = torch.compiler.disable(self._prepare_qkv_for_gated_delta_rule)``; every call site wrapped
    as ``torch.compiler.disable(self._prepare_qkv_for_gated_delta_rule)(...)`` or inside
    ``with torch.compiler.set_stance("force_eager"):`` / ``torch._dynamo.config.patch(disable=True)``.
    """
    tree = ast.parse(text)
    aliases = _aliases(tree)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GatedDeltaNet"), None)
    if cls is None:
        raise ApplyError("anchor class 'GatedDeltaNet' not found.")
    fn = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == _PREPARE), None)
    if fn is None:
        raise ApplyError(f"anchor function {_PREPARE!r} not found in GatedDeltaNet.")
    unknown = []
    for deco in fn.decorator_list:
        name = _full(deco, aliases)
        if name in _DYNAMO_DISABLE:
            return "present", f"decorator @{ast.unparse(deco)} (line {deco.lineno})"
        if _dotted(deco) != "jit_fuser":
            unknown.append(f"decorator @{ast.unparse(deco)} (line {deco.lineno})")
    # wrappers: parents of every self._prepare... reference
    parents = {}
    for node in ast.walk(cls):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    calls, covered = 0, 0
    for node in ast.walk(cls):
        if not _is_self_prepare(node):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Call) and node in parent.args and _full(parent, aliases) in _DYNAMO_DISABLE:
            grand = parents.get(parent)
            if isinstance(grand, ast.Call) and grand.func is parent:
                calls += 1
                covered += 1
                continue
            if (isinstance(grand, ast.Assign) and len(grand.targets) == 1 and _is_self_prepare(grand.targets[0])):
                return "present", f"{ast.unparse(grand)} (line {grand.lineno})"
            unknown.append(f"{ast.unparse(parent)} (line {parent.lineno})")
            continue
        if isinstance(parent, ast.Call) and parent.func is node:
            calls += 1
            verdicts = []
            up = parents.get(parent)
            while up is not None and up is not cls:
                if isinstance(up, (ast.With, ast.AsyncWith)):
                    verdicts += [(_cm_disables_dynamo(i, aliases), i) for i in up.items]
                up = parents.get(up)
            if any(v is True for v, _ in verdicts):
                covered += 1
            else:
                unknown += [f"with {ast.unparse(i)} (line {i.context_expr.lineno})" for v, i in verdicts if v is None]
    if calls and covered == calls:
        return "present", f"every call site ({calls}) runs with Dynamo off"
    if unknown:
        return "undecidable", "; ".join(unknown)
    return "absent", ""


def _preserved_fix_state(text: str, path: str, state_of, undecidable: "Callable[[str], str]", hint: str) -> str:
    """``"present"`` or ``"absent"``: whether a preserved fix's effect is already in ``text``, judged
    by ``state_of`` (:func:`dynamo_state`, :func:`tuple_index_state`).

    Raises:
        ApplyError: the anchor is missing (prefixed with ``path``), or the form is undecidable
            (message ``undecidable(form)``, ``hint``): the user's code is never replaced.
    """
    try:
        state, form = state_of(text)
    except ApplyError as exc:
        raise ApplyError(f"{path}: {exc.message}") from exc
    if state == "undecidable":
        raise ApplyError(undecidable(form), hint=hint)
    return state


@register("fix_prepare_qkv_no_dynamo")
def fix_prepare_qkv_no_dynamo(text: str, path: str = "gated_delta_net.py") -> Result:
    """Preserved downstream fix: keep Dynamo/torch.compile away from
    ``GatedDeltaNet._prepare_qkv_for_gated_delta_rule`` only (decorator
    ``torch.compiler.disable`` instead of ``jit_fuser``).

    An equivalent form already in the file (see :func:`dynamo_state`) is kept as the user
    wrote it (``already-present``); a construct that may or may not have that effect fails.

    Raises:
        ApplyError: anchors missing, or undecidable (naming the construct).
    """
    module = parse(text, path)
    state = _preserved_fix_state(
        text, path, dynamo_state,
        lambda form: (f"{path}: cannot decide whether Dynamo is already off for GatedDeltaNet.{_PREPARE}: {form} "
                      "is not a form the tool recognises, and it will not replace your code."),
        hint="Use a recognised form (decorator @torch.compiler.disable on the method, or "
             "`with torch.compiler.set_stance(\"force_eager\"):` around every call), or drop the construct "
             "from the carried patch.")
    if state == "present":
        return Result(text, "already-present")
    cls = find_class(module, "GatedDeltaNet", path)
    fn = find_function(cls.body.body, _PREPARE, f"{path}: GatedDeltaNet")
    kept = [d for d in fn.decorators if code_of(d.decorator, module) != "jit_fuser"]
    new_fn = fn.with_changes(decorators=[cst.Decorator(cst.parse_expression("torch.compiler.disable"))] + kept)
    return Result(replace_node(module, fn, new_fn, path).code)


def _index_kind(index: ast.expr, fn: ast.FunctionDef, at_line: int) -> str:
    """``tuple`` (basic indexing), ``list`` (the base form ``slices`` list) or ``unknown``."""
    if isinstance(index, ast.Tuple):
        return "tuple"
    if isinstance(index, ast.Call) and _dotted(index) == "tuple":
        return "tuple"
    if isinstance(index, ast.Name):
        last = None
        for node in ast.walk(fn):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.lineno < at_line:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == index.id for t in targets):
                    if last is None or node.lineno > last.lineno:
                        last = node
        if last is None or last.value is None:
            return "unknown"
        return _index_kind(last.value, fn, last.lineno) if not isinstance(last.value, (ast.List, ast.ListComp, ast.BinOp)) \
            else "list"
    return "unknown"


def tuple_index_state(text: str) -> tuple[str, str]:
    """Whether ``get_parameter_local_cp`` indexes ``param`` with a tuple, judged by the AST:
    ``("present", form)``, ``("absent", "")`` (``param[slices]`` with a list) or
    ``("undecidable", construct)``. Recognised: ``param[tuple(slices)]``, ``param[(*slices,)]``,
    ``param[name]`` where ``name`` was last bound to ``tuple(...)`` or a tuple display."""
    tree = ast.parse(text)
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_parameter_local_cp"), None)
    if fn is None:
        raise ApplyError("anchor function 'get_parameter_local_cp' not found.")
    subs = [n for n in ast.walk(fn) if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)
            and n.value.id == "param"]
    if not subs:
        return "undecidable", "anchor `param[slices]` not found (no param[...] index in get_parameter_local_cp)"
    kinds = [(_index_kind(n.slice, fn, n.lineno), n) for n in subs]
    bad = [f"{ast.unparse(n)} (line {n.lineno})" for k, n in kinds if k == "unknown"]
    if bad:
        return "undecidable", "; ".join(bad)
    if all(k == "tuple" for k, _ in kinds):
        return "present", "; ".join(ast.unparse(n) for _, n in kinds)
    return "absent", ""


@register("fix_local_cp_tuple_index")
def fix_local_cp_tuple_index(text: str, path: str = "gated_delta_net.py") -> Result:
    """Preserved downstream fix: ``get_parameter_local_cp`` indexes with
    ``param[tuple(slices)]`` (a list of slices is not basic indexing).

    An equivalent form already there (see :func:`tuple_index_state`) is kept
    (``already-present``); an index the tool cannot classify fails.

    Raises:
        ApplyError: anchors missing, or undecidable (naming the construct).
    """
    module = parse(text, path)
    state = _preserved_fix_state(
        text, path, tuple_index_state,
        lambda form: (f"{path}: cannot decide whether get_parameter_local_cp indexes param with a tuple: {form}; "
                      "the tool will not replace your code."),
        hint="Index with param[tuple(slices)] (or a tuple bound just before), or drop that change from the "
             "carried patch.")
    if state == "present":
        return Result(text, "already-present")
    fn = find_function(module.body, "get_parameter_local_cp", path)
    tr = _TupleIndex()
    new_fn = fn.visit(tr)
    if not tr.done:
        raise ApplyError(f"{path}: anchor `param[slices]` in get_parameter_local_cp not found.")
    return Result(replace_node(module, fn, new_fn, path).code)


class _TupleIndex(cst.CSTTransformer):
    def __init__(self):
        self.done = False

    def leave_Subscript(self, original, updated):
        if m.matches(updated, m.Subscript(value=m.Name("param"), slice=[m.SubscriptElement(slice=m.Index(value=m.Name("slices")))])):
            self.done = True
            return updated.with_changes(slice=[cst.SubscriptElement(slice=cst.Index(value=cst.parse_expression("tuple(slices)")))])
        return updated


#: Recognisers of the preserved fixes, by transform name: ``text -> (state, form)`` with state
#: ``present`` / ``absent`` / ``undecidable``. The three-way merge consults those of the
#: recipe's ``fix`` steps to carry a fix's equivalent form into a function a step rewrites
#: (:func:`backport.transforms.merge._carry_wrappers`).
FIX_FORMS: dict[str, Callable[[str], tuple[str, str]]] = {
    "fix_prepare_qkv_no_dynamo": dynamo_state,
    "fix_local_cp_tuple_index": tuple_index_state,
}
