"""Transforms of ours for GDN chunkwise CP: the downstream adaptations (the preserved fixes are in
:mod:`backport.transforms.fixes`).

Anchors are upstream symbol names at the base (85bced0a): ``TransformerConfig``
(``cp_comm_type``, ``__post_init__``), ``GatedDeltaNet`` (``__init__``, ``forward``,
``_prepare_qkv_for_gated_delta_rule``) and ``get_parameter_local_cp``.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import libcst as cst
import libcst.matchers as m

from ..errors import ApplyError, BindingExists
from . import Result, register
from .cst import code_of, find_class, find_function, parse, replace_node, statements
from .fixes import PREPARE_QKV as _PREPARE

ADAPTATIONS = Path(__file__).resolve().parent.parent / "adaptations"


def _is_ann_assign(stmt, name: str) -> bool:
    return m.matches(stmt, m.SimpleStatementLine(body=[m.AnnAssign(target=m.Name(name))]))


def _is_assign(stmt, name: str) -> bool:
    return m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name(name))])]))


def _is_self_assign(stmt, attr: str) -> bool:
    return m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(
        target=m.Attribute(value=m.Name("self"), attr=m.Name(attr)))])]))


def _is_docstring(stmt) -> bool:
    return m.matches(stmt, m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString())]))


def _blank_line_before(stmt):
    """Exactly one blank line before ``stmt`` (before its leading comments), as black keeps it."""
    lines = list(stmt.leading_lines)
    while lines and lines[0].comment is None:
        lines.pop(0)
    return stmt.with_changes(leading_lines=[cst.EmptyLine(indent=False)] + lines)


def _existing_binding(module, cls, name: str):
    """The statement of ``cls``'s body (a field, attribute, def or class) that binds ``name``."""
    for stmt in cls.body.body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and stmt.name.value == name:
            return stmt
        if _is_ann_assign(stmt, name) or _is_assign(stmt, name):
            return stmt
    return None


def _binding_exists(module, stmt, scope: str, name: str, path: str) -> BindingExists:
    line = module.code_for_node(stmt).strip().splitlines()[0] if stmt is not None else name
    pos = _line_of(module, stmt)
    return BindingExists(
        f"{path}: {scope} already binds {name} ({line!r}, line {pos}); the transform would add it again "
        "and override or shadow it.", scope=scope, name=name, lineno=pos,
        hint="Drop that binding from the carried patch (the recipe adds it), or give it the recipe's exact form.")


def _normalised(code: str) -> str:
    """``code`` without comments and whitespace, for comparing forms of one statement."""
    return ast.dump(ast.parse(textwrap.dedent(code).strip()))


def _line_of(module, stmt) -> int:
    """1-based line of ``stmt`` (its first non-blank line) in ``module``."""
    from libcst.metadata import MetadataWrapper, PositionProvider

    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    positions = wrapper.resolve(PositionProvider)
    for node, pos in positions.items():
        if node is stmt:
            return pos.start.line
    return 0


def _replace_method(module, cls, name, new_fn, path):
    old = find_function(cls.body.body, name, f"{path}: {cls.name.value}")
    return replace_node(module, old, new_fn.with_changes(leading_lines=old.leading_lines), path)


LINEAR_CP_FIELD = '''
linear_cp_mode: str = "headwise"
"""Context-parallel mode of linear-attention (Gated DeltaNet) layers; `cp_comm_type` does
    not apply to them. Fixed for the process (no per-call override, no "auto"):
    "headwise" (default): all-to-all from sequence shards to head shards; heads must divide by
    TP*CP.
    "chunkwise": keep the sequence shards, reorder the zigzag shard to contiguous time chunks
    and run FLA's CP-aware conv and scan (flash-linear-attention >= 0.4.2); heads divide by TP.
    "all_gather": gather the projected sequence on every CP rank, run conv and scan on the
    whole sequence and keep this rank's zigzag part; heads divide by TP. Simple, memory-heavy.
    """
'''

LINEAR_CP_RULE = '''
# GDN head rule per linear_cp_mode: headwise splits heads over TP*CP, chunkwise and
# all_gather over TP only. Unknown modes (including "auto") are rejected here.
from megatron.core.ssm.gdn_context_parallel import check_linear_cp_geometry

check_linear_cp_geometry(
    self.linear_cp_mode,
    self.linear_num_key_heads,
    self.linear_num_value_heads,
    self.tensor_model_parallel_size,
    self.context_parallel_size,
)
'''


@register("gdn_config_linear_cp_mode")
def gdn_config_linear_cp_mode(text: str, path: str = "transformer_config.py") -> Result:
    """Add ``TransformerConfig.linear_cp_mode`` (default ``headwise``) after ``cp_comm_type``
    and replace the TP*CP head assertion in ``__post_init__`` by the per-mode rule."""
    module = parse(text, path)
    cls = find_class(module, "TransformerConfig", path)
    body = list(cls.body.body)
    idx = next((i for i, s in enumerate(body) if _is_ann_assign(s, "cp_comm_type")), None)
    if idx is None:
        raise ApplyError(f"{path}: anchor TransformerConfig.cp_comm_type not found.")
    if idx + 1 < len(body) and _is_docstring(body[idx + 1]):
        idx += 1
    field = statements(LINEAR_CP_FIELD)
    existing = _existing_binding(module, cls, "linear_cp_mode")
    if existing is not None and code_of(existing, module).strip() == code_of(field[0], module).strip():
        pass  # exactly our field (our docstring may differ): already there, kept as written
    elif existing is not None:
        raise _binding_exists(module, existing, "TransformerConfig", "linear_cp_mode", path)
    else:
        field[0] = _blank_line_before(field[0])
        body[idx + 1:idx + 1] = field
    new_cls = cls.with_changes(body=cls.body.with_changes(body=body))

    post_init = find_function(new_cls.body.body, "__post_init__", f"{path}: TransformerConfig")
    rule = _RuleRewriter()
    new_post_init = post_init.visit(rule)
    if not rule.done:
        raise ApplyError(f"{path}: anchor `tp_cp_size = ...` head check in TransformerConfig.__post_init__ not found.")
    new_cls = replace_node(cst.Module(body=[new_cls]), post_init, new_post_init, path).body[0]
    return Result(replace_node(module, cls, new_cls, path).code)


class _RuleRewriter(cst.CSTTransformer):
    """Replace ``tp_cp_size = ...`` and the asserts that use it with our rule."""

    def __init__(self):
        self.done = False

    def leave_IndentedBlock(self, original, updated):
        body = list(updated.body)
        idx = next((i for i, s in enumerate(body) if _is_assign(s, "tp_cp_size")), None)
        if idx is None:
            return updated
        end = idx + 1
        while end < len(body) and m.matches(body[end], m.SimpleStatementLine(body=[m.Assert()])) and m.findall(body[end], m.Name("tp_cp_size")):
            end += 1
        new = statements(LINEAR_CP_RULE)
        body[idx:end] = new
        self.done = True
        return updated.with_changes(body=body)


GDN_IMPORTS = '''
from megatron.core.context_parallel_layout import (
    contiguous_to_zigzag_chunks,
    zigzag_to_contiguous_chunks,
)
from megatron.core.ssm import gdn_context_parallel
'''


@register("gdn_imports")
def gdn_imports(text: str, path: str = "gated_delta_net.py") -> Result:
    """Import the CP layout helpers and our ``gdn_context_parallel`` module after the
    ``megatron.core.process_groups_config`` import of ``gated_delta_net.py``."""
    module = parse(text, path)
    body = list(module.body)
    anchor = m.SimpleStatementLine(body=[m.ImportFrom(module=m.Attribute(attr=m.Name("process_groups_config")))])
    idx = next((i for i, s in enumerate(body) if m.matches(s, anchor)), None)
    if idx is None:
        raise ApplyError(f"{path}: anchor `from megatron.core.process_groups_config import ...` not found.")
    bound = _module_bindings(text)
    inserted = 0
    for stmt in statements(GDN_IMPORTS):
        mod = _from_module(stmt)
        names = [cst.Module(body=[]).code_for_node(a.name) for a in stmt.body[0].names]
        missing = []
        for name in names:
            node = bound.get(name)
            if node is None:
                missing.append(name)
            elif not (isinstance(node, ast.ImportFrom) and node.module == mod and node.level == 0
                      and any(a.name == name and (a.asname or a.name) == name for a in node.names)):
                raise BindingExists(
                    f"{path}: the module already binds {name} ({ast.unparse(node).splitlines()[0]!r}, line "
                    f"{node.lineno}); the transform would import it again from {mod} and shadow it.",
                    scope="", name=name, lineno=node.lineno,
                    hint="Drop that binding from the carried patch, or import the name from the module the "
                         "recipe uses.")
        if not missing:
            continue  # already imported exactly so
        if missing != names:
            stmt = statements(f"from {mod} import {', '.join(missing)}\n")[0]
        inserted += 1
        at = _sorted_import_index(body, idx, _from_module(stmt))
        if at <= idx:
            idx += 1
        if at < len(body) and at > 0 and not _from_module(body[at - 1]).startswith("megatron."):
            # first of the section: the section's blank line moves up to the new import
            body.insert(at, stmt.with_changes(leading_lines=body[at].leading_lines))
            body[at + 1] = body[at + 1].with_changes(leading_lines=[])
        else:
            body.insert(at, stmt.with_changes(leading_lines=[]))
    if not inserted:
        return Result(text, "already-present")
    return Result(module.with_changes(body=body).code)


def _module_bindings(text: str) -> dict:
    """Module-level name -> the ``ast`` statement that binds it last (imports, defs, assignments)."""
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                out[(a.asname or a.name).split(".")[0]] = node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name):
                    out[t.id] = node
    return out


def _from_module(stmt) -> str:
    """Dotted module of a ``from X import ...`` statement line ("" for anything else)."""
    node = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and stmt.body else None
    if not isinstance(node, cst.ImportFrom) or node.module is None:
        return ""
    return cst.Module(body=[]).code_for_node(node.module)


def _sorted_import_index(body: list, anchor: int, name: str) -> int:
    """Where isort (profile black) puts ``from <name> import ...`` in the run of ``megatron.``
    from-imports around ``body[anchor]``: before the first one whose module sorts after it."""
    start = anchor
    while start > 0 and _from_module(body[start - 1]).startswith("megatron."):
        start -= 1
    end = anchor
    while end < len(body) and _from_module(body[end]).startswith("megatron."):
        end += 1
    for i in range(start, end):
        if _from_module(body[i]).lower() > name.lower():
            return i
    return end


GDN_INIT_CHECK = '''
# The GDN CP mode is static: checked here (mode and head rule), read again in forward.
gdn_context_parallel.check_linear_cp_geometry(
    self.config.linear_cp_mode,
    self.num_key_heads,
    self.num_value_heads,
    self.tp_size,
    self.cp_size,
)
'''


def _insert_init_check(text: str, path: str, after, anchor: str, snippet: str, call: str, what: str) -> Result:
    """Insert ``snippet`` (one statement calling ``call``) into ``GatedDeltaNet.__init__`` right
    after the first statement ``after(statement)`` accepts; ``anchor`` names that statement in the
    error when it is missing. An existing call of ``call`` in the recipe's form is already-present;
    in another form it is refused (BindingExists: the layer would ``what`` twice, differently)."""
    module = parse(text, path)
    cls = find_class(module, "GatedDeltaNet", path)
    init = find_function(cls.body.body, "__init__", f"{path}: GatedDeltaNet")
    body = list(init.body.body)
    idx = next((i for i, st in enumerate(body) if after(st)), None)
    if idx is None:
        raise ApplyError(f"{path}: anchor {anchor} in GatedDeltaNet.__init__ not found.")
    new = statements(snippet)
    matcher = m.Call(func=m.Attribute(attr=m.Name(call)) | m.Name(call))
    existing = next((st for st in body if m.findall(st, matcher)), None)
    if existing is not None:
        if _normalised(code_of(existing, module)) == _normalised(code_of(new[0], module)):
            return Result(text, "already-present")
        raise BindingExists(
            f"{path}: GatedDeltaNet.__init__ already calls {call} "
            f"({code_of(existing, module).strip().splitlines()[-1]!r}, line {_line_of(module, existing)}) in "
            f"another form; the transform would {what} twice, differently.",
            scope="GatedDeltaNet.__init__", name=call, lineno=_line_of(module, existing),
            hint="Drop the check from the carried patch (the recipe adds it), or give it the recipe's exact form.")
    new[0] = _blank_line_before(new[0])
    body[idx + 1:idx + 1] = new
    new_init = init.with_changes(body=init.body.with_changes(body=body))
    return Result(replace_node(module, init, new_init, path).code)


@register("gdn_init_check_linear_cp")
def gdn_init_check_linear_cp(text: str, path: str = "gated_delta_net.py") -> Result:
    """In ``GatedDeltaNet.__init__``, check mode and head rule right after
    ``self.v_dim_local_tp`` is set (before any parameter is built)."""
    return _insert_init_check(text, path, lambda st: _is_self_assign(st, "v_dim_local_tp"),
                              "`self.v_dim_local_tp = ...`", GDN_INIT_CHECK, "check_linear_cp_geometry",
                              "check the CP mode")


GDN_REGISTER_MODE = '''
# finalize_packed_seq_params prebuilds, per packed micro-batch, the CP state of this mode.
gdn_context_parallel.register_linear_cp_mode(self.config.linear_cp_mode)
'''


@register("gdn_init_register_linear_cp_mode")
def gdn_init_register_linear_cp_mode(text: str, path: str = "gated_delta_net.py") -> Result:
    """In ``GatedDeltaNet.__init__``, right after the CP mode check, record the layer's mode
    (``gdn_context_parallel.register_linear_cp_mode``) for ``finalize_packed_seq_params``."""
    check = m.SimpleStatementLine(body=[m.Expr(value=m.Call(func=m.Attribute(attr=m.Name("check_linear_cp_geometry"))))])
    return _insert_init_check(text, path, lambda st: m.matches(st, check),
                              "`gdn_context_parallel.check_linear_cp_geometry(...)`", GDN_REGISTER_MODE,
                              "register_linear_cp_mode", "record the CP mode")


GDN_FLA_VERSION_CHECK = '''
# FLA moved chunk_gated_delta_rule's parameters between releases: refuse others by name.
gdn_context_parallel.check_fla_version()
'''


@register("gdn_init_check_fla_version")
def gdn_init_check_fla_version(text: str, path: str = "gated_delta_net.py") -> Result:
    """In ``GatedDeltaNet.__init__``, right after the ``if not HAVE_FLA: raise ...`` check,
    refuse an FLA release outside ``gdn_context_parallel.SUPPORTED_FLA_VERSIONS``."""
    have_fla = m.If(test=m.UnaryOperation(operator=m.Not(), expression=m.Name("HAVE_FLA")))
    return _insert_init_check(text, path, lambda st: m.matches(st, have_fla), "`if not HAVE_FLA:`",
                              GDN_FLA_VERSION_CHECK, "check_fla_version", "check the FLA version")


@register("gdn_linear_cp_forward")
def gdn_linear_cp_forward(text: str, path: str = "gated_delta_net.py") -> Result:
    """Replace ``GatedDeltaNet.forward`` by our three-mode forward
    (``backport/adaptations/gated_delta_net_forward.py``)."""
    module = parse(text, path)
    cls = find_class(module, "GatedDeltaNet", path)
    template = cst.parse_module((ADAPTATIONS / "gated_delta_net_forward.py").read_text(encoding="utf-8"))
    new_fn = find_function(template.body, "forward", "gated_delta_net_forward.py")
    # Re-indent to method level by parsing inside a class body.
    wrapped = cst.parse_module("class _T:\n" + _indent(template.code_for_node(new_fn)))
    method = wrapped.body[0].body.body[0]
    return Result(_replace_method(module, cls, "forward", method, path).code)


def _indent(code: str) -> str:
    return "".join(("    " + line) if line.strip() else line for line in code.splitlines(keepends=True))


@register("gdn_prepare_qkv_headwise_cp_size")
def gdn_prepare_qkv_headwise_cp_size(text: str, path: str = "gated_delta_net.py") -> Result:
    """Give ``_prepare_qkv_for_gated_delta_rule`` a ``cp_size_headwise`` argument and use it
    where the base divides by ``self.cp_size`` (heads are CP-split on the headwise path only)."""
    module = parse(text, path)
    cls = find_class(module, "GatedDeltaNet", path)
    fn = find_function(cls.body.body, "_prepare_qkv_for_gated_delta_rule", f"{path}: GatedDeltaNet")
    params = list(fn.params.params)
    have = next((p for p in params if p.name.value == "cp_size_headwise"), None)
    if have is not None:
        if not (isinstance(have.default, cst.Integer) and have.default.value == "1" and have.annotation is None):
            pos = _line_of(module, have)
            raise BindingExists(
                f"{path}: GatedDeltaNet.{fn.name.value} already has a parameter cp_size_headwise in another form "
                f"({code_of(have, module).strip().rstrip(',')!r}, line {pos}); the transform adds "
                "cp_size_headwise=1.", scope=f"GatedDeltaNet.{fn.name.value}", name="cp_size_headwise", lineno=pos,
                hint="Drop the parameter from the carried patch (the recipe adds it), or give it the recipe's "
                     "exact form (cp_size_headwise=1).")
        new_fn = fn.visit(_SelfAttrToName("cp_size", "cp_size_headwise"))
        if code_of(new_fn, module) == code_of(fn, module):
            return Result(text, "already-present")
        return Result(replace_node(module, fn, new_fn, path).code)
    params.append(cst.Param(name=cst.Name("cp_size_headwise"), default=cst.Integer("1"),
                            equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))))
    new_fn = fn.with_changes(params=fn.params.with_changes(params=params))
    signature = next(ln for ln in module.code_for_node(new_fn).splitlines() if ln.lstrip().startswith("def "))
    if len(signature) + 4 > 100:  # a method: one indent level inside the class
        new_fn = _params_on_their_own_line(new_fn)
    new_fn = new_fn.visit(_SelfAttrToName("cp_size", "cp_size_headwise"))
    return Result(replace_node(module, fn, new_fn, path).code)


def _params_on_their_own_line(fn: cst.FunctionDef) -> cst.FunctionDef:
    """``def f(\n    a, b\n):`` as black writes a signature over the line length (no magic comma)."""
    params = list(fn.params.params)
    params = [p.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))) for p in params[:-1]] + [
        params[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)]
    return fn.with_changes(
        params=fn.params.with_changes(params=params),
        whitespace_before_params=cst.ParenthesizedWhitespace(
            first_line=cst.TrailingWhitespace(), indent=True, last_line=cst.SimpleWhitespace("    ")),
        whitespace_before_colon=cst.SimpleWhitespace(""),
    ).with_deep_changes(params[-1], whitespace_after_param=cst.ParenthesizedWhitespace(
        first_line=cst.TrailingWhitespace(), indent=True, last_line=cst.SimpleWhitespace("")))


class _SelfAttrToName(cst.CSTTransformer):
    def __init__(self, attr: str, name: str):
        self.attr, self.name = attr, name

    def leave_Attribute(self, original, updated):
        if m.matches(updated, m.Attribute(value=m.Name("self"), attr=m.Name(self.attr))):
            return cst.Name(self.name)
        return updated


@register("gdn_local_cp_none_group")
def gdn_local_cp_none_group(text: str, path: str = "gated_delta_net.py") -> Result:
    """``get_parameter_local_cp``: a ``None`` CP group means CP size 1 (no split), as upstream
    5139086e does for its renamed ``get_parameter_local_cp_headwise``; the name is kept."""
    module = parse(text, path)
    fn = find_function(module.body, "get_parameter_local_cp", path)
    src = code_of(fn, module)
    if "cp_group is not None" in src:
        return Result(text, "already-present")
    new_fn = fn.visit(_NoneGroupSize())
    if code_of(new_fn, module) == src:
        raise ApplyError(f"{path}: anchor `cp_size = cp_group.size()` in get_parameter_local_cp not found.")
    return Result(replace_node(module, fn, new_fn, path).code)


class _NoneGroupSize(cst.CSTTransformer):
    def leave_Assign(self, original, updated):
        for attr, default in (("size", "1"), ("rank", "0")):
            if m.matches(updated.value, m.Call(func=m.Attribute(value=m.Name("cp_group"), attr=m.Name(attr)))):
                return updated.with_changes(value=cst.parse_expression(
                    f"cp_group.{attr}() if cp_group is not None else {default}"))
        return updated



PREPARE_QKV_TEMPLATE = "gated_delta_net_prepare_qkv.py"
_COMPOUND = (ast.If, ast.Try, ast.With, ast.For, ast.While) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())


def _names_bound_anywhere_at_module_level(text: str) -> tuple[dict, bool]:
    """Module-level name -> (1-based line of its first binding, whether that binding sits inside
    an ``if``/``try``/``with``/loop block), over top-level statements and those blocks (not
    inside defs or classes); and whether a ``from ... import *`` makes the answer unknown."""
    out: dict = {}
    star = False

    def walk(body, nested):
        nonlocal star
        for stmt in body:
            names = []
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [stmt.name]
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                star = star or any(a.name == "*" for a in stmt.names)
                names = [(a.asname or a.name).split(".")[0] for a in stmt.names if a.name != "*"]
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
                targets = (stmt.targets if isinstance(stmt, ast.Assign) else
                           [stmt.target] if not isinstance(stmt, ast.With) else
                           [i.optional_vars for i in stmt.items if i.optional_vars is not None])
                names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            for name in names:
                out.setdefault(name, (stmt.lineno, nested))
            if isinstance(stmt, _COMPOUND):
                for field in ("body", "orelse", "finalbody"):
                    walk(getattr(stmt, field, []) or [], True)
                for handler in getattr(stmt, "handlers", []) or []:
                    if handler.name:
                        out.setdefault(handler.name, (handler.lineno, True))
                    walk(handler.body, True)

    walk(ast.parse(text).body, False)
    return out, star


def _holds_in_order(body, module, template_body, template) -> bool:
    """Whether ``body``'s statements hold every statement of ``template_body`` (comments and
    layout ignored), in order: the template's form exactly, or that form with statements a
    carried patch added between them (kept as they are, not merged again)."""
    mine = [_normalised(module.code_for_node(st)) for st in body.body]
    theirs = [_normalised(template.code_for_node(st)) for st in template_body.body]
    at = 0
    for stmt in mine:
        if at < len(theirs) and stmt == theirs[at]:
            at += 1
    return at == len(theirs)


def _free_names(node: ast.AST, bound_inside: set) -> set:
    """Names ``node`` reads that neither it binds (parameters, assignments) nor builtins give."""
    import builtins

    reads = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    stores = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    params = {a.arg for a in ast.walk(node) if isinstance(a, ast.arg)}
    return reads - stores - params - bound_inside - set(dir(builtins))


@register("gdn_prepare_qkv_fused_copies")
def gdn_prepare_qkv_fused_copies(text: str, path: str = "gated_delta_net.py") -> Result:
    """Our adaptation (beyond upstream): the body of
    ``GatedDeltaNet._prepare_qkv_for_gated_delta_rule`` becomes two ``jit_fuser`` functions
    around an eager FLA ``l2norm`` (``backport/adaptations/gated_delta_net_prepare_qkv.py``);
    the method keeps its decorator and signature, so Dynamo still never traces it (fix 7a).

    The two functions go right after ``class GatedDeltaNet``. When the method body and both
    functions already have the template's form, the text is returned unchanged
    (``already-present``); so is a body holding every statement of the template's in order
    with statements of a carried patch between them (a carry rebased onto this step).

    Raises:
        ApplyError: anchors missing, or the method lacks the ``cp_size_headwise`` parameter
            (the ``gdn_prepare_qkv_headwise_cp_size`` step must run first).
        BindingExists: the module already binds one of the two names in another form.
    """
    module = parse(text, path)
    cls = find_class(module, "GatedDeltaNet", path)
    fn = find_function(cls.body.body, _PREPARE, f"{path}: GatedDeltaNet")
    if not any(p.name.value == "cp_size_headwise" for p in fn.params.params):
        raise ApplyError(f"{path}: GatedDeltaNet.{_PREPARE} has no cp_size_headwise parameter; the recipe's "
                         "gdn_prepare_qkv_headwise_cp_size step must run before gdn_prepare_qkv_fused_copies.")
    template = cst.parse_module((ADAPTATIONS / PREPARE_QKV_TEMPLATE).read_text(encoding="utf-8"))
    new_body = find_function(find_class(template, "GatedDeltaNet", PREPARE_QKV_TEMPLATE).body.body, _PREPARE,
                             PREPARE_QKV_TEMPLATE).body
    helpers = [st for st in template.body if isinstance(st, cst.FunctionDef)]
    bound = _module_bindings(text)
    anywhere, star = _names_bound_anywhere_at_module_level(text)
    missing = []
    for helper in helpers:
        node = bound.get(helper.name.value)
        if node is None and helper.name.value in anywhere:
            # bound inside an if/try/with block: a def added after the class would shadow it
            pos = anywhere[helper.name.value][0]
            raise BindingExists(
                f"{path}: the module already binds {helper.name.value} inside a block (line {pos}); the "
                "transform would define it again after GatedDeltaNet and shadow that binding.",
                scope="", name=helper.name.value, lineno=pos,
                hint="Drop that binding from the carried patch (the recipe adds the function), or define it "
                     "at module level in the recipe's exact form.")
        if node is None:
            missing.append(helper)
        elif _normalised(ast.unparse(node)) != _normalised(template.code_for_node(helper)):
            pos = node.lineno
            raise BindingExists(
                f"{path}: the module already binds {helper.name.value} ({ast.unparse(node).splitlines()[0]!r}, "
                f"line {pos}) in another form; the transform would define it again.",
                scope="", name=helper.name.value, lineno=pos,
                hint="Drop that definition from the carried patch (the recipe adds it), or give it the "
                     "recipe's exact form.")
    same_body = _holds_in_order(fn.body, module, new_body, template)
    if same_body and not missing:
        return Result(text, "already-present")
    helper_names = {h.name.value for h in helpers}
    needed = set()
    for helper in missing:
        needed |= _free_names(ast.parse(template.code_for_node(helper)), helper_names)
    if not same_body:
        method = find_function(find_class(template, "GatedDeltaNet", PREPARE_QKV_TEMPLATE).body.body, _PREPARE,
                               PREPARE_QKV_TEMPLATE)
        needed |= _free_names(ast.parse(textwrap.dedent(template.code_for_node(method))), helper_names | {"self"})
    unbound = sorted(needed - set(anywhere))
    if unbound and not star:
        raise ApplyError(
            f"{path}: the code transform gdn_prepare_qkv_fused_copies writes uses {', '.join(unbound)}, which the "
            "module does not bind (did the carried patch remove or rename an import?); the module would fail "
            "to import.",
            hint=f"Keep the import of {', '.join(unbound)} in the carried patch (megatron/core/ssm/"
                 "gated_delta_net.py at the base imports each of them).")
    if not same_body:
        module = replace_node(module, fn, fn.with_changes(body=new_body), path)
    if missing:
        body = list(module.body)
        at = next(i for i, st in enumerate(body) if isinstance(st, cst.ClassDef) and st.name.value == "GatedDeltaNet")
        body[at + 1:at + 1] = [h.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()]) for h in missing]
        module = module.with_changes(body=body)
    return Result(module.code)


PACKED_METADATA_FIELDS = '''# This rank's THD zigzag <-> contiguous CP route, set once per micro-batch by
# megatron.core.context_parallel_layout.finalize_packed_seq_params (None: SBHD or CP=1).
cp_partition_route: object = None
# The GDN layers' metadata of the micro-batch (gdn_context_parallel.PackedSeqMetadata), set by
# finalize_packed_seq_params; neither field is passed to TE attention.
gdn_packed_metadata: object = None
'''
PACKED_METADATA_FIELD_NAMES = ("cp_partition_route", "gdn_packed_metadata")


@register("packed_seq_params_metadata_fields")
def packed_seq_params_metadata_fields(text: str, path: str = "packed_seq_params.py") -> Result:
    """Add ``PackedSeqParams.cp_partition_route`` (upstream dev's field name) and our
    ``gdn_packed_metadata`` (both default None) after ``seq_idx``: the per-micro-batch state
    that ``gdn_context_parallel.finalize_packed_seq_params`` builds and the GDN layers read.

    Raises:
        ApplyError: ``class PackedSeqParams`` or its ``seq_idx`` field is missing.
        BindingExists: the class already binds one of the fields in another form.
    """
    module = parse(text, path)
    cls = find_class(module, "PackedSeqParams", path)
    body = list(cls.body.body)
    idx = next((i for i, s in enumerate(body) if _is_ann_assign(s, "seq_idx")), None)
    if idx is None:
        raise ApplyError(f"{path}: anchor PackedSeqParams.seq_idx not found.")
    fields = statements(PACKED_METADATA_FIELDS)
    present = 0
    for name, field in zip(PACKED_METADATA_FIELD_NAMES, fields):
        existing = _existing_binding(module, cls, name)
        if existing is None:
            continue
        if _normalised(code_of(existing, module)) != _normalised(code_of(field, module)):
            raise _binding_exists(module, existing, "PackedSeqParams", name, path)
        present += 1
    if present == len(fields):
        return Result(text, "already-present")
    if present:
        raise ApplyError(
            f"{path}: PackedSeqParams binds only some of {', '.join(PACKED_METADATA_FIELD_NAMES)}.",
            hint="Drop those fields from the carried patch (the recipe adds both).")
    body[idx + 1:idx + 1] = fields
    return Result(replace_node(module, cls, cls.with_changes(body=cls.body.with_changes(body=body)), path).code)


TE_SKIP_PACKED_METADATA = '''
# cp_partition_route and gdn_packed_metadata serve the GDN layers only, not TE attention.
self.kept_packed_seq_params.discard("cp_partition_route")
self.kept_packed_seq_params.discard("gdn_packed_metadata")
'''


def _is_discard_of(stmt, name: str) -> bool:
    return m.matches(stmt, m.SimpleStatementLine(body=[m.Expr(value=m.Call(
        func=m.Attribute(value=m.Attribute(value=m.Name("self"), attr=m.Name("kept_packed_seq_params")),
                         attr=m.Name("discard")),
        args=[m.Arg(value=m.SimpleString(f'"{name}"') | m.SimpleString(f"'{name}'"))]))]))


@register("te_attention_skip_packed_metadata")
def te_attention_skip_packed_metadata(text: str, path: str = "transformer_engine.py") -> Result:
    """Our adaptation (beyond upstream): ``TEDotProductAttention.__init__`` keeps the new
    ``PackedSeqParams`` fields ``cp_partition_route`` and ``gdn_packed_metadata`` out of the
    keyword arguments it hands TE's attention (it passes every other field by name), right
    after it discards ``seq_idx``.

    Raises:
        ApplyError: ``class TEDotProductAttention``, its ``__init__`` or the
            ``self.kept_packed_seq_params.discard("seq_idx")`` statement is missing.
    """
    module = parse(text, path)
    cls = find_class(module, "TEDotProductAttention", path)
    init = find_function(cls.body.body, "__init__", f"{path}: TEDotProductAttention")
    body = list(init.body.body)
    if all(any(_is_discard_of(s, name) for s in body) for name in PACKED_METADATA_FIELD_NAMES):
        return Result(text, "already-present")
    idx = next((i for i, s in enumerate(body) if _is_discard_of(s, "seq_idx")), None)
    if idx is None:
        raise ApplyError(f"{path}: anchor `self.kept_packed_seq_params.discard(\"seq_idx\")` in "
                         "TEDotProductAttention.__init__ not found.")
    body[idx + 1:idx + 1] = statements(TE_SKIP_PACKED_METADATA)
    new_init = init.with_changes(body=init.body.with_changes(body=body))
    return Result(replace_node(module, init, new_init, path).code)


LAYOUT_FINALIZE_EXPORT = '''

# Upstream dev (PR #6387) builds a packed micro-batch's CP metadata once, when the batch is
# made; this tree's implementation serves the GDN layers and lives beside them.
from megatron.core.ssm.gdn_context_parallel import (  # pylint: disable=unused-import
    finalize_packed_seq_params,
    prebuild_thd_cp_partition_routes,
)
'''
LAYOUT_FINALIZE_NAMES = ("finalize_packed_seq_params", "prebuild_thd_cp_partition_routes")


@register("context_parallel_layout_finalize_export")
def context_parallel_layout_finalize_export(text: str, path: str = "context_parallel_layout.py") -> Result:
    """Our adaptation (upstream dev's entry point on this tree): at the end of
    ``megatron/core/context_parallel_layout.py``, re-export ``finalize_packed_seq_params`` and
    ``prebuild_thd_cp_partition_routes`` from ``megatron.core.ssm.gdn_context_parallel``, so that
    ``from megatron.core.context_parallel_layout import finalize_packed_seq_params`` (upstream
    dev d48bd6be's import) works unchanged.

    Raises:
        ApplyError: the module has no ``zigzag_to_contiguous_chunks`` (not the 5139086e module).
        BindingExists: the module already binds one of the names in another form.
    """
    module = parse(text, path)
    defined = {st.name.value for st in module.body if isinstance(st, cst.FunctionDef)}
    if "zigzag_to_contiguous_chunks" not in defined:
        raise ApplyError(f"{path}: anchor def zigzag_to_contiguous_chunks not found.")
    new = statements(LAYOUT_FINALIZE_EXPORT)
    for st in module.body:
        if m.matches(st, m.SimpleStatementLine(body=[m.ImportFrom()])) and any(
                m.matches(a, m.ImportAlias(name=m.Name(n))) for n in LAYOUT_FINALIZE_NAMES
                for a in (st.body[0].names if not isinstance(st.body[0].names, cst.ImportStar) else [])):
            if _normalised(code_of(st, module)) == _normalised(code_of(new[0], module)):
                return Result(text, "already-present")
            raise BindingExists(
                f"{path}: the module already imports {', '.join(LAYOUT_FINALIZE_NAMES)} in another form "
                f"(line {_line_of(module, st)}).", scope="", name=LAYOUT_FINALIZE_NAMES[0],
                lineno=_line_of(module, st),
                hint="Drop that import from the carried patch (the recipe adds it), or give it the recipe's form.")
    clash = sorted(defined & set(LAYOUT_FINALIZE_NAMES))
    if clash:
        raise BindingExists(f"{path}: the module already defines {', '.join(clash)}.", scope="", name=clash[0],
                            lineno=0, hint="Drop that definition from the carried patch (the recipe re-exports ours).")
    return Result(module.with_changes(body=list(module.body) + new).code)


FINALIZE_IMPORT = "from megatron.core.context_parallel_layout import finalize_packed_seq_params\n"


def _imports_name(stmt, name: str) -> bool:
    return m.matches(stmt, m.SimpleStatementLine(body=[m.ImportFrom(names=[m.ZeroOrMore(), m.ImportAlias(
        name=m.Name(name)), m.ZeroOrMore()])]))


def _import_module_name(stmt) -> str | None:
    if m.matches(stmt, m.SimpleStatementLine(body=[m.ImportFrom()])) and stmt.body[0].module is not None:
        return cst.Module([]).code_for_node(stmt.body[0].module)
    return None


def _with_finalize_import(module: cst.Module, path: str) -> cst.Module:
    # The import goes into the block of imports that holds the module's import of
    # PackedSeqParams, at its isort place (profile black: from-imports sorted by module name).
    body = list(module.body)
    if any(_imports_name(st, "finalize_packed_seq_params") for st in body):
        return module
    at = next((i for i, st in enumerate(body) if _imports_name(st, "PackedSeqParams")), None)
    if at is None:
        raise ApplyError(f"{path}: anchor `from megatron.core.packed_seq_params import PackedSeqParams` not found.")
    first = at
    while first > 0 and _import_module_name(body[first - 1]) and not body[first].leading_lines:
        first -= 1
    target = "megatron.core.context_parallel_layout"
    where = first
    while where <= at and (_import_module_name(body[where]) or "") < target:
        where += 1
    anchor = body[where]
    new = statements(FINALIZE_IMPORT)[0].with_changes(leading_lines=anchor.leading_lines)
    body[where:where + 1] = [new, anchor.with_changes(leading_lines=[])]
    return module.with_changes(body=body)


def _is_psp_call(node) -> bool:
    return m.matches(node, m.Call(func=m.Name("PackedSeqParams")))


def _finalize_call(kwargs: dict) -> str:
    # finalize_packed_seq_params(packed_seq_params, k=v...) as black writes it (line length 100).
    one = ", ".join(["packed_seq_params", *(f"{k}={v}" for k, v in kwargs.items())])
    if len(one) + len("    finalize_packed_seq_params()") <= 100:
        return f"finalize_packed_seq_params({one})\n"
    args = "".join(f"    {k}={v},\n" for k, v in kwargs.items())
    return f"finalize_packed_seq_params(\n    packed_seq_params,\n{args})\n"


FINALIZE_COMMENT = "# The micro-batch is final here: build its CP metadata once (no sync in the model).\n"


def _finalize_packed_batch(text: str, path: str, function: str, kwargs: dict | None = None) -> Result:
    """In module-level ``function``, finalize the packed micro-batch it builds: after the last
    top-level ``packed_seq_params = PackedSeqParams(...)`` insert
    ``finalize_packed_seq_params(packed_seq_params, **kwargs)``. A function that ends in an
    ``if``/``else`` whose branches each ``return PackedSeqParams(...)`` assigns instead and
    returns the finalized object once after it. Adds the import once.

    Raises:
        ApplyError: ``function``, the PackedSeqParams import, or either anchor is missing.
    """
    module = parse(text, path)
    fn = find_function(module.body, function, path)
    if m.findall(fn, m.Call(func=m.Name("finalize_packed_seq_params"))):
        return Result(text, "already-present")
    body = list(fn.body.body)
    finalize = statements(FINALIZE_COMMENT + _finalize_call(kwargs or {}))
    assign = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name("packed_seq_params"))],
                                                  value=m.Call(func=m.Name("PackedSeqParams")))])
    returns = m.SimpleStatementLine(body=[m.Return(value=m.Call(func=m.Name("PackedSeqParams")))])
    at = [i for i, st in enumerate(body) if m.matches(st, assign)]
    last = body[-1] if body else None
    if at:
        body[at[-1] + 1:at[-1] + 1] = finalize
    elif (isinstance(last, cst.If) and isinstance(last.orelse, cst.Else)
          and all(branch.body.body and m.matches(branch.body.body[-1], returns) for branch in (last, last.orelse))):
        def assigned(branch):
            *rest, ret = branch.body.body
            new = ret.with_changes(body=[cst.Assign(targets=[cst.AssignTarget(cst.Name("packed_seq_params"))],
                                                    value=ret.body[0].value)])
            return branch.with_changes(body=branch.body.with_changes(body=[*rest, new]))
        body[-1] = assigned(last).with_changes(orelse=assigned(last.orelse))
        body += [_blank_line_before(finalize[0]), *finalize[1:], *statements("return packed_seq_params\n")]
    else:
        raise ApplyError(f"{path}: {function} neither assigns packed_seq_params = PackedSeqParams(...) nor ends "
                         "in an if/else returning PackedSeqParams(...) from each branch: anchor not found.")
    module = replace_node(module, fn, fn.with_changes(body=fn.body.with_changes(body=body)), path)
    return Result(_with_finalize_import(module, path).code)


@register("bridge_packed_seq_utils_finalize")
def bridge_packed_seq_utils_finalize(text: str, path: str = "packed_seq_utils.py") -> Result:
    """Megatron-Bridge's ``get_packed_seq_params`` (every Bridge step's packed micro-batch:
    GPT, VLM, audio, LLaVA) returns a finalized ``PackedSeqParams``."""
    return _finalize_packed_batch(text, path, "get_packed_seq_params")


@register("mcore_data_schedule_finalize")
def mcore_data_schedule_finalize(text: str, path: str = "data_schedule.py") -> Result:
    """MCore's sequence-packing batch (``get_batch_on_this_rank_for_sequence_packing``, the
    dynamic-CP scheduler's, after its broadcast into the boundary buffers) is finalized."""
    return _finalize_packed_batch(text, path, "get_batch_on_this_rank_for_sequence_packing")


@register("qwen3_vl_finalize_packed")
def qwen3_vl_finalize_packed(text: str, path: str = "utils.py") -> Result:
    """Qwen3-VL's repack to THD (``preprocess_packed_seqs``) finalizes the repacked micro-batch
    from the host boundaries it already holds (``cu_seqlens_padded_cpu``): no sync."""
    return _finalize_packed_batch(
        text, path, "preprocess_packed_seqs",
        {"cu_seqlens_cpu": "torch.tensor(cu_seqlens_padded_cpu, dtype=cu_seqlens_padded.dtype)"})


@register("qwen3_vl_step_finalize_packed")
def qwen3_vl_step_finalize_packed(text: str, path: str = "qwen3_vl_step.py") -> Result:
    """Qwen3-VL's step packs rows of ``target_len`` tokens: it finalizes that micro-batch from
    those host lengths (no sync)."""
    return _finalize_packed_batch(
        text, path, "pack_or_pad_batch_sequences",
        {"cu_seqlens_cpu": "torch.arange(batch_size + 1, dtype=cu_seqlens_padded.dtype) * target_len"})
