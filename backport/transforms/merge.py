"""Three-way merge of carried changes into functions that a recipe step rewrote.

A transform such as ``gdn_linear_cp_forward`` replaces a whole function body; a carried
downstream edit inside that function would vanish. For every function (or class) a carried
hunk touched, :func:`merge_carried_functions` merges base body -> carried body into the new
body with ``git merge-file`` (ancestor: the symbol after the earlier steps without the
carry, so earlier steps' changes are on every side; ours: the body after the step; theirs:
the body before the step, carry included). Symbols are those where the carried lines land
(``CarryHunk.line_symbols``), not the hunk header's anchor. Identical changes on both sides
merge cleanly, so steps that edit in place are unaffected. A step that replaces or removes a
symbol the carry added fails unless its version is identical; one that brings back a
symbol the carry removed fails. A step whose version still holds every carried change is
left as it is (no merge), and a merge that would repeat a carried line fails. A real conflict fails
(exit 6) naming the carried hunk (file, hunk number, first conflicting line) and the step,
unless every conflicting hunk is declared ``superseded`` in the recipe: then the new body
wins there, or unless the conflict is a preserved fix in the user's form (a ``with`` block
around a call, e.g. Dynamo off at ``forward``'s call site of the helper fix 7a protects):
then :func:`_carry_wrappers` puts that block around the same call of the new body.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from ..errors import ApplyError
from ..gitenv import isolated
from ..workspace import SymbolMap, split_lines

CONFLICT_HINT = (
    "The carried patch and the recipe step change the same lines of this function. Either edit the carried "
    "hunk (still a diff against the base tree) so that it leaves the lines the step rewrites alone, or so "
    "that its new body is the step's body with your lines between the step's statements (that form is kept "
    "as already present); or, if the backport makes your change unnecessary, declare it superseded with a "
    "top-level key of the recipe file (--recipe, by default manifests/gdn-chunkwise-cp.yaml): "
    "`superseded: [{{hunk: {oid}, step: {step}, why: ...}}]` (docs/carry.md)."
)


def _span(symbols: SymbolMap, qualname: str) -> Optional[tuple[int, int]]:
    """``(first, end)`` 0-based lines of the first symbol called ``qualname`` (end exclusive), or None."""
    span = symbols.span(qualname) if symbols.valid else None
    return None if span is None else (span[0], span[1] + 1)


def merge3(ours: str, base: str, theirs: str, favour_ours: bool = False) -> tuple[str, int]:
    """``git merge-file -p --diff3`` of three texts: (merged text, number of conflicts)."""
    from .. import interrupts

    with interrupts.temporary_folder("gdn-merge-") as tmp:  # removed on an interrupt too
        paths = []
        for name, text in (("new", ours), ("base", base), ("carried", theirs)):
            p = Path(tmp) / name
            p.write_bytes(text.encode("utf-8"))
            paths.append(str(p))
        env = isolated()
        args = ["git", "merge-file", "-p", "--diff3", "-L", "new", "-L", "base", "-L", "carried"]
        if favour_ours:
            args.append("--ours")
        proc = subprocess.run(args + paths, capture_output=True, env=env)
        if proc.returncode < 0 or proc.returncode > 127:
            raise ApplyError(f"git merge-file failed: {proc.stderr.decode(errors='replace').strip()}",
                             hint="Check that git is installed and works.")
        return proc.stdout.decode("utf-8"), proc.returncode


def _conflicts(merged: str) -> list[dict]:
    """Conflict regions of a --diff3 merge: their new/base/carried lines."""
    out, cur, part = [], None, None
    for line in split_lines(merged):
        if line.startswith("<<<<<<< "):
            cur, part = {"new": [], "base": [], "carried": []}, "new"
        elif cur is not None and line.startswith("||||||| "):
            part = "base"
        elif cur is not None and line.rstrip("\r\n") == "=======":
            part = "carried"
        elif cur is not None and line.startswith(">>>>>>> "):
            out.append(cur)
            cur = None
        elif cur is not None:
            cur[part].append(line)
    return out


def _culprits(conflict: dict, hunks: list) -> list:
    """Carried hunks whose added or removed lines lie in the conflict (else all of them)."""
    lines = set(conflict["carried"]) | set(conflict["base"])
    found = [h for h in hunks if (set(h.added) | set(h.removed)) & lines]
    return found or list(hunks)


def _carried_lines(hunks: list, qual: str) -> tuple[list, list]:
    """Added and removed lines of ``hunks`` that land in ``qual`` (or a symbol inside it)."""
    added, removed = [], []
    for h in hunks:
        if not h.line_symbols:
            added += h.added
            removed += h.removed
            continue
        for sign, line, sym in h.line_symbols:
            if sym is not None and (sym == qual or sym.startswith(qual + ".")):
                (added if sign == "+" else removed).append(line)
    return added, removed


def _count(lines: list, line: str) -> int:
    return sum(1 for x in lines if x.rstrip("\r\n") == line)


def _distinct(lines: list) -> list:
    return sorted({ln.rstrip("\r\n") for ln in lines if ln.strip()})


def _keeps(after: list, before: list, added: list, removed: list) -> bool:
    """Whether the step's version of a symbol still holds every carried change that the
    version before the step held (the ``carry_survival`` rule, by line counts)."""
    for line in _distinct(added):
        if _count(after, line) < min(_count(added, line), _count(before, line)):
            return False
    return all(_count(after, line) <= _count(before, line) for line in _distinct(removed))


def _kept_by_new(conflict: dict) -> bool:
    """A conflict that is only an alignment artefact: the step inserted its own lines next to
    the carried ones and kept them, so the new side holds the carried side whole (contiguous)
    and none of the base lines the carry dropped."""
    new, base, carried = conflict["new"], conflict["base"], conflict["carried"]
    if not any(ln.strip() for ln in carried):
        return False
    inside = any(new[i:i + len(carried)] == carried for i in range(len(new) - len(carried) + 1))
    dropped = [ln for ln in base if ln not in carried and ln.strip()]
    return inside and not any(ln in new for ln in dropped)


def _first_conflicting_line(conflict: dict) -> str:
    base = set(conflict["base"])
    for line in conflict["carried"]:
        if line not in base and line.strip():
            return line.rstrip("\r\n")
    for line in conflict["base"]:
        if line.strip():
            return line.rstrip("\r\n")
    return (conflict["carried"] or conflict["base"] or [""])[0].rstrip("\r\n")


def merge_carried_functions(base: str, before: str, after: str, hunks: list, step, path: str,
                            superseded: set, fix_forms: Sequence = (), kept_forms: Optional[list] = None) -> str:
    """Merge the carried delta of every function/class the carry touched into ``after``.

    Args:
        base: the ancestor: the file after the earlier steps without the carry (the pristine
            base when that could not be computed).
        before: the file before the step (carry and earlier steps applied).
        after: the file the step produced.
        hunks: carried hunks of this file (:class:`~backport.carry.CarryHunk`, with ``symbol``).
        step: the recipe step (``id``, and ``transform`` when it has one).
        superseded: ids of carried hunks the recipe declares superseded.
        fix_forms: ``(fix step id, recogniser)`` of the recipe's preserved fixes for this file
            (:data:`backport.transforms.fixes.FIX_FORMS`): a conflicting carried ``with`` block
            that is a fix's equivalent form is carried onto the same call of the new body
            (:func:`_carry_wrappers`) instead of failing.
        kept_forms: when given, receives one record per carried ``with`` block kept so.

    Returns:
        ``after`` with the carried changes merged back (unchanged when nothing was lost).

    Raises:
        ApplyError (exit 6): a real conflict with a carried hunk that is not superseded, or a
            carry-added symbol the step replaced or removed, naming file, hunk number, first
            conflicting line and the step.
    """
    def syms(h) -> set:
        return {sym for _, _, sym in h.line_symbols if sym} | ({h.symbol} if h.symbol else set())

    symbols = sorted(set().union(*(syms(h) for h in hunks)) if hunks else set())
    what = f"transform {step.transform}" if getattr(step, "transform", None) else step.kind
    # one parse of each version of the file for all its symbols (``after`` again only when a merge changed it)
    maps = {"base": SymbolMap(base), "before": SymbolMap(before)}
    after_map = [after, SymbolMap(after)]

    def after_symbols() -> SymbolMap:
        if after_map[0] is not after:
            after_map[:] = [after, SymbolMap(after)]
        return after_map[1]

    # innermost first would merge twice; keep only outermost touched symbols that are functions
    # or classes present in all three versions
    for qual in symbols:
        if any(qual.startswith(other + ".") for other in symbols if other != qual):
            continue
        spans = [_span(m, qual) for m in (maps["base"], maps["before"], after_symbols())]
        own = [h for h in hunks if any(s == qual or s.startswith(qual + ".") for s in syms(h))]
        if spans[0] is None and spans[1] is not None:  # the carry added this symbol
            c_lines = split_lines(before)[spans[1][0]:spans[1][1]]
            a_lines = split_lines(after)[spans[2][0]:spans[2][1]] if spans[2] else []
            live = [h for h in own if h.oid not in superseded]
            if a_lines != c_lines and live:
                h = live[0]
                lost = next((ln for ln in c_lines if ln not in a_lines and ln.strip()), c_lines[0] if c_lines else "")
                verb = "removes" if spans[2] is None else "replaces"
                raise ApplyError(
                    f"carried hunk {h.n} of {h.path} ({h.oid}, in {qual}) conflicts with recipe step {step.id} "
                    f"({what}), which {verb} {qual}, a symbol the carried patch adds: first conflicting line "
                    f"{lost.rstrip(chr(13) + chr(10))!r}.",
                    hint=CONFLICT_HINT.format(oid=h.oid, step=step.id))
            continue
        if spans[0] is not None and spans[1] is None and spans[2] is not None:  # the carry removed it
            live = [h for h in own if h.oid not in superseded]
            if live:
                h = live[0]
                back = split_lines(after)[spans[2][0]].rstrip("\r\n")
                raise ApplyError(
                    f"carried hunk {h.n} of {h.path} ({h.oid}, in {qual}) conflicts with recipe step {step.id} "
                    f"({what}), which brings back {qual}, a symbol the carried patch removes: first conflicting "
                    f"line {back!r}.", hint=CONFLICT_HINT.format(oid=h.oid, step=step.id))
            continue
        if None in spans:
            continue
        b_lines, c_lines, a_lines = (split_lines(t)[s:e] for t, (s, e) in zip((base, before, after), spans))
        if c_lines == b_lines or a_lines == c_lines:
            continue
        added, removed = _carried_lines(own, qual)
        if _keeps(a_lines, c_lines, added, removed):
            continue  # the step kept every carried change here: nothing to merge back
        merged, n = merge3("".join(a_lines), "".join(b_lines), "".join(c_lines))
        if n:
            blocking = []
            for c in _conflicts(merged):
                if _kept_by_new(c):
                    continue
                live = [h for h in _culprits(c, own) if h.oid not in superseded]
                if live:
                    blocking.append((live[0], c))
                    break
            if blocking and fix_forms:
                kept = (_carry_wrappers(base, before, after, qual, own, step, superseded, fix_forms)
                        or _carry_call_wrappers(base, before, after, qual, own, step, superseded, fix_forms))
                if kept is not None:
                    after = kept[0]
                    if kept_forms is not None:
                        kept_forms.extend(kept[1])
                    continue
            if blocking:
                h, c = blocking[0]
                raise ApplyError(
                    f"carried hunk {h.n} of {h.path} ({h.oid}, in {qual}) conflicts with recipe step {step.id} "
                    f"({what}), which rewrites {qual}: first conflicting line {_first_conflicting_line(c)!r}.",
                    hint=CONFLICT_HINT.format(oid=h.oid, step=step.id))
            merged, _ = merge3("".join(a_lines), "".join(b_lines), "".join(c_lines), favour_ours=True)
        doubled = next((ln for ln in _distinct(added) if _count(split_lines(merged), ln)
                        > max(_count(c_lines, ln), _count(a_lines, ln))), None)
        if doubled is not None:
            h = next((h for h in own if h.oid not in superseded), own[0])
            raise ApplyError(
                f"carried hunk {h.n} of {h.path} ({h.oid}, in {qual}) conflicts with recipe step {step.id} "
                f"({what}), which rewrites {qual}: merging them would repeat the carried line {doubled!r}.",
                hint=CONFLICT_HINT.format(oid=h.oid, step=step.id))
        lines = split_lines(after)
        s, e = spans[2]
        candidate = "".join(lines[:s] + split_lines(merged) + lines[e:])
        try:
            ast.parse(candidate)
        except SyntaxError as exc:
            h = own[0]
            raise ApplyError(
                f"carried hunk {h.n} of {h.path} ({h.oid}, in {qual}) merged into recipe step {step.id}'s new "
                f"{qual} gives invalid Python (line {exc.lineno}: {exc.msg}).",
                hint=CONFLICT_HINT.format(oid=h.oid, step=step.id)) from exc
        after = candidate
    return after


# --- a preserved fix's equivalent form inside a rewritten function -------------------------------

def _function_node(tree: ast.Module, qual: str):
    """The def/class ``qual`` (``A.b``) of ``tree``, or None (also for ``name[2]`` duplicates)."""
    node = tree
    for name in qual.split("."):
        node = next((n for n in getattr(node, "body", []) if isinstance(
            n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name), None)
        if node is None:
            return None
    return node


def _blocks(fn) -> list:
    """Every statement list inside ``fn`` (bodies, else/finally branches, handlers, cases)."""
    out = []
    for node in ast.walk(fn):
        for name in ("body", "orelse", "finalbody"):
            seq = getattr(node, name, None)
            if isinstance(seq, list) and seq and isinstance(seq[0], ast.stmt):
                out.append(seq)
    return out


def _runs(fn, want: list, key) -> list:
    """Consecutive statement runs of ``fn`` whose ``key`` per statement equals ``want``."""
    found = []
    for seq in _blocks(fn):
        keys = [key(s) for s in seq]
        found += [seq[i:i + len(want)] for i in range(len(seq) - len(want) + 1) if keys[i:i + len(want)] == want]
    return found


def _callees(stmt) -> tuple:
    """What a statement is, for finding "the same call" in a rewritten body: its kind and
    the dotted names it calls (``self._prepare_qkv_for_gated_delta_rule``), arguments aside."""
    names = set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Call):
            parts, f = [], node.func
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                names.add(".".join([f.id] + parts[::-1]))
    return type(stmt).__name__, tuple(sorted(names))


def _indent_of(line: str) -> str:
    return line[:len(line) - len(line.lstrip(" \t"))]


def _starts_line(lines: list, stmt) -> bool:
    return not lines[stmt.lineno - 1][:stmt.col_offset].strip()


def _state(recognise, text: str) -> str:
    try:
        return recognise(text)[0]
    except (ApplyError, SyntaxError, ValueError):
        return "unknown"


def _fix_kept(candidate: str, before: str, text: str, fix_forms) -> Optional[str]:
    """The id of the preserved fix whose form the carried file ``before`` has, the merged ``text``
    lacks and ``candidate`` (``text`` with the user's wrapper put back) has again; None when no
    fix form explains the wrapper or ``candidate`` does not parse."""
    try:
        ast.parse(candidate)
    except SyntaxError:
        return None
    return next((fid for fid, recognise in fix_forms if _state(recognise, before) == "present"
                 and _state(recognise, text) != "present" and _state(recognise, candidate) == "present"), None)


def _merge_symbol(base: str, carried: str, after: str, qual: str, own: list, superseded: set) -> Optional[str]:
    """``after`` with the symbol ``qual`` three-way merged (ancestor ``base``, ours the step's
    ``after``, theirs ``carried``); None when the symbol is missing in one of them or a conflict
    is not kept by the new code nor caused only by superseded carried hunks."""
    spans = [_span(SymbolMap(t), qual) for t in (base, carried, after)]
    if None in spans:
        return None
    b_sym, c_sym, a_sym = ("".join(split_lines(t)[s:e]) for t, (s, e) in zip((base, carried, after), spans))
    merged, n = merge3(a_sym, b_sym, c_sym)
    if n:
        for c in _conflicts(merged):
            if not _kept_by_new(c) and any(h.oid not in superseded for h in _culprits(c, own)):
                return None
        merged, _ = merge3(a_sym, b_sym, c_sym, favour_ours=True)
    lines = split_lines(after)
    s, e = spans[2]
    return "".join(lines[:s] + split_lines(merged) + lines[e:])


def _carry_wrappers(base: str, before: str, after: str, qual: str, own: list, step, superseded: set,
                    fix_forms: Sequence):
    """Carry the user's form of a preserved fix into a function the step rewrote.

    The carried patch wrapped statements of ``qual`` in a ``with`` block (e.g. ``with
    torch._dynamo.config.patch(disable=True):`` around the call of the helper fix 7a keeps
    away from Dynamo), and the step rewrote those statements, so the line merge conflicts.
    Judged on the AST, not the text: the block's body equals (``ast.dump``) one statement run
    of the ancestor's ``qual``. Without that block the rest of the carry must merge cleanly;
    then the block goes, as the user wrote its header, around the one run of the new body
    that makes the same calls (kind of statement and dotted callees; arguments may differ).
    Kept only when a preserved fix's recogniser (``fix_forms``) says the effect is present in
    the carried file and the result, and absent in the result without the block; never
    guessed: any other case returns None (the caller reports the conflict).

    Returns:
        ``(after with the merged qual, records)`` or None. A record: ``hunks`` (carried hunk
        ids holding the block's header), ``step``, ``fix``, ``wrapper`` (header lines),
        ``around`` (the callees), ``restated`` (carried lines of the block's body, now the
        step's statements) and ``replaced`` (the ancestor's lines of that run).
    """
    try:
        trees = [ast.parse(t) for t in (base, before)]
    except SyntaxError:
        return None
    b_fn, c_fn = (_function_node(t, qual) for t in trees)
    if b_fn is None or c_fn is None:
        return None
    b_lines, c_lines = split_lines(base), split_lines(before)
    b_withs = [ast.dump(w) for w in ast.walk(b_fn) if isinstance(w, (ast.With, ast.AsyncWith))]
    wraps = []
    for w in ast.walk(c_fn):
        if not isinstance(w, (ast.With, ast.AsyncWith)) or ast.dump(w) in b_withs:
            continue
        if any(o.lineno <= w.lineno and w.end_lineno <= o.end_lineno for o, _ in wraps):
            continue  # inside a block already taken
        runs = _runs(b_fn, [ast.dump(s) for s in w.body], ast.dump)
        if len(runs) != 1 or not all(_starts_line(c_lines, s) for s in (w, *w.body)) \
                or not _starts_line(b_lines, runs[0][0]):
            continue  # not a block around base statements: an ordinary edit, left to the line merge
        wraps.append((w, runs[0]))
    if not wraps:
        return None
    # the carried file without the blocks: the ancestor's lines of each run in their place
    c0 = list(c_lines)
    for w, run in sorted(wraps, key=lambda wr: -wr[0].lineno):
        c0[w.lineno - 1:w.end_lineno] = b_lines[run[0].lineno - 1:run[-1].end_lineno]
    c0_text = "".join(c0)
    text = _merge_symbol(base, c0_text, after, qual, own, superseded)
    if text is None:
        return None
    records = []
    for w, run in sorted(wraps, key=lambda wr: wr[0].lineno):
        try:
            fn = _function_node(ast.parse(text), qual)
        except SyntaxError:
            return None
        want = [_callees(st) for st in w.body]
        if fn is None or not any(names for _, names in want):
            return None
        targets = _runs(fn, want, _callees)
        if len(targets) != 1:
            return None
        target = targets[0]
        t_lines = split_lines(text)
        if not _starts_line(t_lines, target[0]) or any(
                isinstance(n, ast.Constant) and isinstance(n.value, str) and n.end_lineno > n.lineno
                for st in target for n in ast.walk(st)):
            return None  # re-indenting would change a multi-line string
        w_indent, body_indent = _indent_of(c_lines[w.lineno - 1]), _indent_of(c_lines[w.body[0].lineno - 1])
        header = c_lines[w.lineno - 1:w.body[0].lineno - 1]
        if not body_indent.startswith(w_indent) or any(ln.strip() and not ln.startswith(w_indent) for ln in header):
            return None
        at = _indent_of(t_lines[target[0].lineno - 1])
        first, last = target[0].lineno - 1, target[-1].end_lineno
        wrapped = ([at + ln[len(w_indent):] if ln.strip() else ln for ln in header]
                   + [body_indent[len(w_indent):] + ln if ln.strip() else ln for ln in t_lines[first:last]])
        candidate = "".join(t_lines[:first] + wrapped + t_lines[last:])
        fix = _fix_kept(candidate, before, text, fix_forms)
        if fix is None:
            return None
        head = {ln.rstrip("\r\n") for ln in header if ln.strip()}
        records.append({
            "hunks": sorted(h.oid for h in own if head & {ln.rstrip("\r\n") for ln in h.added}),
            "step": step.id, "fix": fix, "symbol": qual,
            "wrapper": [ln.rstrip("\r\n") for ln in header if ln.strip()],
            "around": sorted({name for _, names in want for name in names}),
            "restated": [ln.rstrip("\r\n") for ln in c_lines[w.body[0].lineno - 1:w.end_lineno] if ln.strip()],
            "replaced": [ln.rstrip("\r\n") for ln in b_lines[run[0].lineno - 1:run[-1].end_lineno] if ln.strip()],
            "kind": "with",
        })
        text = candidate
    return text, records


def _segment_replace(text: str, node, new: str) -> str:
    """``text`` with the source of ``node`` (its exact line/column span) replaced by ``new``."""
    lines = split_lines(text)
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln))

    def at(lineno: int, col: int) -> int:  # ast columns count UTF-8 bytes
        return offsets[lineno - 1] + len(lines[lineno - 1].encode("utf-8")[:col].decode("utf-8"))

    return text[:at(node.lineno, node.col_offset)] + new + text[at(node.end_lineno, node.end_col_offset):]


def _carry_call_wrappers(base: str, before: str, after: str, qual: str, own: list, step, superseded: set,
                         fix_forms: Sequence):
    """The other call-site form: the carried patch wrapped a callee, ``f(args)`` ->
    ``wrap(f)(args)`` (e.g. ``torch.compiler.disable(self._prepare_qkv_for_gated_delta_rule)(...)``),
    in a function the step rewrote. Judged on the AST like :func:`_carry_wrappers`: the ancestor
    calls ``f`` with the same arguments exactly once; without the wrapper the rest of the carry
    must merge cleanly; the wrapper (as written) then goes around ``f`` of the one call of
    ``f`` in the new body (its arguments may differ), kept only when a preserved fix's
    recogniser confirms it. Returns ``(after, records)`` or None, as :func:`_carry_wrappers`.
    """
    try:
        b_fn, c_fn = (_function_node(ast.parse(t), qual) for t in (base, before))
    except SyntaxError:
        return None
    if b_fn is None or c_fn is None:
        return None
    wraps = []
    for call in ast.walk(c_fn):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Call) and len(call.func.args) == 1
                and not call.func.keywords and isinstance(call.func.args[0], (ast.Name, ast.Attribute))):
            continue
        inner = call.func.args[0]
        same = [c for c in ast.walk(b_fn) if isinstance(c, ast.Call) and ast.dump(c.func) == ast.dump(inner)
                and [ast.dump(a) for a in c.args] == [ast.dump(a) for a in call.args]
                and [ast.dump(k) for k in c.keywords] == [ast.dump(k) for k in call.keywords]]
        if len(same) == 1:
            wraps.append((call, inner, same[0]))
    if len(wraps) != 1:
        return None
    call, inner, base_call = wraps[0]
    wrapper = ast.get_source_segment(before, call.func)
    c0_text = _segment_replace(before, call.func, ast.get_source_segment(before, inner))
    text = _merge_symbol(base, c0_text, after, qual, own, superseded)
    if text is None:
        return None
    try:
        fn = _function_node(ast.parse(text), qual)
    except SyntaxError:
        return None
    targets = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and ast.dump(c.func) == ast.dump(inner)] if fn else []
    if len(targets) != 1:
        return None
    candidate = _segment_replace(text, targets[0].func, wrapper)
    fix = _fix_kept(candidate, before, text, fix_forms)
    if fix is None:
        return None
    c_lines = split_lines(before)
    carried = [ln.rstrip("\r\n") for ln in c_lines[call.lineno - 1:call.end_lineno] if ln.strip()]
    return candidate, [{
        "hunks": sorted(h.oid for h in own if set(carried) & {ln.rstrip("\r\n") for ln in h.added}),
        "step": step.id, "fix": fix, "symbol": qual, "wrapper": [wrapper], "around": [ast.unparse(inner)],
        "restated": carried, "kind": "call",
        "replaced": [ln.rstrip("\r\n") for ln in split_lines(base)[base_call.lineno - 1:base_call.end_lineno]
                     if ln.strip()],
    }]
