"""Verification of a generated patch. Every check must pass or nothing is written.

Checks (each recorded in the manifest with a deterministic detail string):
``deterministic`` (a second in-memory run gives the same bytes), ``applies`` (GNU patch,
zero fuzz, no offsets, on the pristine assembled base), ``no_conflict_markers``,
``byte_compiles`` (every ``.py`` under ``megatron/`` of the patched tree),
``verbatim_files`` (files taken whole equal upstream bytes), ``forbidden_strings``,
``imports`` (changed modules import with torch, triton 3.6 and FLA 0.4.2; capability probe),
``carry_survival`` (every carried hunk's effect is still in the output, inside its symbol).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

from unidiff import PatchSet

from . import interrupts
from .errors import VerificationError
from .gitpath import patch_path
from .recipe import UpstreamFile
from .tree import base_compile_errors
from .workspace import BindingMap, SymbolMaps, new_bindings, split_lines

CONFLICT = re.compile(r"^(<{7}|={7}|>{7})( |$)")

PROBE = r'''
import importlib, inspect, json, sys
mods = sys.argv[1:]
for name in mods:
    importlib.import_module(name)
from fla.ops.cp import build_cp_context
from fla.modules.convolution import causal_conv1d
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
assert "cp_context" in inspect.signature(causal_conv1d).parameters, "causal_conv1d lacks cp_context"
assert "cp_context" in inspect.signature(chunk_gated_delta_rule).parameters, "chunk_gated_delta_rule lacks cp_context"
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.ssm import gdn_context_parallel as g
field = TransformerConfig.__dataclass_fields__["linear_cp_mode"]
assert field.default == "headwise", f"linear_cp_mode default is {field.default!r}"
assert g.LINEAR_CP_MODES == ("headwise", "chunkwise", "all_gather"), g.LINEAR_CP_MODES
try:
    g.check_linear_cp_mode("auto")
except ValueError:
    pass
else:
    raise AssertionError("linear_cp_mode='auto' was accepted")
import fla, triton, torch
print(json.dumps({"fla": fla.__version__, "triton": triton.__version__, "torch": torch.__version__.split("+")[0]}))
'''


def _is_versions(line: str) -> bool:
    """True when ``line`` is the probe's last line: a JSON object naming fla, triton and torch."""
    import json

    try:
        data = json.loads(line)
    except ValueError:
        return False
    return isinstance(data, dict) and {"fla", "triton", "torch"} <= set(data)


def _fail(check: str, detail: str, hint: str | None = None) -> None:
    raise VerificationError(f"verification check '{check}' failed: {detail}", hint=hint)


def apply_patch(tree: Path, patch: bytes, dry_run: bool) -> str:
    """Apply ``patch`` to ``tree`` with GNU patch, zero fuzz; return patch's output.

    Raises:
        VerificationError: a hunk is rejected, or applies only with fuzz or an offset.
    """
    args = ["patch", "-p1", "--fuzz=0", "--batch", "--forward", "--no-backup-if-mismatch", "-r", "-"]
    if dry_run:
        args.append("--dry-run")
    proc = interrupts.run_child(args, cwd=tree, input=patch, capture_output=True)
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    if proc.returncode != 0:
        _fail("applies", f"GNU patch exited {proc.returncode}: {out.strip()[-600:]}")
    if re.search(r"\b(offset|fuzz)\b", out, re.I):
        _fail("applies", f"applies only with offsets or fuzz: {out.strip()[-600:]}")
    return out


class VerifyTree:
    """The patched scratch tree the checks read, with the import check already running on it.

    Made as soon as the first in-memory run has its patch (:func:`backport.engine.build`): the base
    tree's ``megatron/`` is copied to a temporary folder, the patch applied there (GNU patch, zero
    fuzz) and, when ``opts.import_check``, a second interpreter (``opts.python``) starts importing
    the recipe's ``import_check`` modules in the background while the determinism run and the other
    checks go on in this process. :func:`verify` reads the import check's verdict last, in the
    manifest's order. Use it as a context manager: leaving it stops an unfinished import check and
    removes the folder.
    """

    def __init__(self, patch_text: str, run, recipe, opts):
        self.proc: "subprocess.Popen | None" = None
        self._out = self._err = None
        self.apply_error: "VerificationError | None" = None
        self._dir = interrupts.make_folder("gdn-verify-")  # registered: removed at exit at the latest
        self.tree = self._dir / "t"
        try:  # an interrupt before the caller's ``with`` holds this object must not leak its child or folder
            self._start(patch_text, run, recipe, opts)
        except BaseException:
            self.close()
            raise

    def _start(self, patch_text: str, run, recipe, opts) -> None:
        shutil.copytree(run.base_tree / "megatron", self.tree / "megatron", symlinks=True)
        try:
            apply_patch(self.tree, patch_text.encode(), dry_run=False)
        except VerificationError as exc:  # reported in order, after the dry run on the pristine base
            self.apply_error = exc
            return
        if opts.import_check:
            self._out = open(self._dir / "import.out", "w+", encoding="utf-8")
            self._err = open(self._dir / "import.err", "w+", encoding="utf-8")
            # Shielded while the child starts: raised inside Popen (after the fork), an interrupt
            # would lose the only handle on a running child. A held signal is raised after it.
            with interrupts.shielded():
                self.proc = subprocess.Popen(
                    [opts.python, "-W", "ignore", "-c", PROBE, *recipe.import_check], cwd=self.tree,
                    stdout=self._out, stderr=self._err, encoding="utf-8",
                    env={**os.environ, "PYTHONPATH": str(self.tree), "PYTHONDONTWRITEBYTECODE": "1",
                         "CUDA_VISIBLE_DEVICES": "",
                         # torch's own caches go into this check's folder, removed with it (torch
                         # made $TMPDIR/torchinductor_<user> otherwise, left behind by every run)
                         "TORCHINDUCTOR_CACHE_DIR": str(self._dir / "torchinductor"),
                         "TRITON_CACHE_DIR": str(self._dir / "triton")})

    def import_result(self, timeout_s: float) -> "tuple[int, str, str]":
        """``(exit code, stdout, stderr)`` of the import check, waiting at most ``timeout_s`` seconds.

        Raises:
            subprocess.TimeoutExpired: it did not finish in time (:meth:`close` stops it).
        """
        rc = self.proc.wait(timeout=timeout_s)
        self._out.seek(0)
        self._err.seek(0)
        return rc, self._out.read(), self._err.read()

    def close(self) -> None:
        """Stop an unfinished import check (SIGKILL, then wait for it) and remove the folder, whole:
        no signal cuts this (:func:`backport.interrupts.shielded`)."""
        with interrupts.shielded():
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for f in (self._out, self._err):
                if f is not None:
                    f.close()
            interrupts.remove_folder(self._dir)

    def __enter__(self) -> "VerifyTree":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def verify(patch_text: str, patch_again: str, run, recipe, opts, progress,
           vtree: "VerifyTree | None" = None) -> list[dict]:
    """Run every check; return their records or raise VerificationError on the first failure.

    ``vtree`` is the patched scratch tree made from ``patch_text`` (:class:`VerifyTree`, import
    check already started); None makes one here.
    """
    if vtree is None:
        with VerifyTree(patch_text, run, recipe, opts) as made:
            return verify(patch_text, patch_again, run, recipe, opts, progress, made)
    checks = []
    if patch_text != patch_again:
        _fail("deterministic", "two runs on the same inputs produced different patches",
              hint="A transform is not deterministic; report it.")
    checks.append({"check": "deterministic", "ok": True, "detail": "two in-memory runs gave identical bytes"})

    patch = patch_text.encode()
    apply_patch(run.base_tree, patch, dry_run=True)
    if vtree.apply_error is not None:
        raise vtree.apply_error
    checks.append({"check": "applies", "ok": True, "detail": "GNU patch -p1 --fuzz=0: no fuzz, no offsets"})

    added = [(patch_path(pf), line.value) for pf in PatchSet(split_lines(patch_text)) for h in pf for line in h
             if line.is_added]
    bad = [p for p, v in added if CONFLICT.match(v)]
    if bad:
        _fail("no_conflict_markers", f"conflict markers in added lines of {sorted(set(bad))}")
    checks.append({"check": "no_conflict_markers", "ok": True, "detail": f"{len(added)} added lines scanned"})

    tree = vtree.tree
    progress("byte-compiling megatron/")
    # The files the patch does not change are the base's bytes: their verdict comes from the base
    # tree's compile record (computed once per cache entry and interpreter); the rest compile here.
    changed = sorted(f.path for f in run.ws.changed())
    changed_files = set(changed)
    base_errors = base_compile_errors(run.base_tree)
    count = 0
    for path in sorted((tree / "megatron").rglob("*.py")):
        rel = path.relative_to(tree).as_posix()
        if base_errors is not None and rel not in changed_files and rel not in base_errors:
            pass  # the base's bytes, recorded as compiling
        else:  # changed by the patch, or recorded as failing: the verdict is this compile's, never the record's
            try:
                compile(path.read_bytes(), rel, "exec", dont_inherit=True)
            except SyntaxError as exc:
                _fail("byte_compiles", f"{rel}:{exc.lineno}: {exc.msg}")
        count += 1
    checks.append({"check": "byte_compiles", "ok": True, "detail": f"{count} files under megatron/"})

    # A file taken whole stays upstream's bytes; a later step of the recipe may only append to it
    # (e.g. a re-export), so upstream's bytes stay its exact prefix.
    verbatim = [s.path for s in recipe.steps if isinstance(s, UpstreamFile)]
    appended = []
    for path in verbatim:
        later = [s.id for s in recipe.steps if not isinstance(s, UpstreamFile) and getattr(s, "path", None) == path]
        have, want = (tree / path).read_bytes(), run.mlm.read(run.upstream_sha, path)
        if have == want:
            continue
        if later and have.startswith(want):
            appended.append(f"{path} + {', '.join(later)} appended")
            continue
        _fail("verbatim_files", f"{path} differs from upstream {run.upstream_sha[:12]}"
              + (f" beyond what {', '.join(later)} appends" if later else ""))
    detail = f"{len(verbatim)} file(s) byte-identical to upstream"
    if appended:
        detail = f"{len(verbatim)} file(s) taken whole: upstream's bytes as their prefix ({'; '.join(appended)})"
    checks.append({"check": "verbatim_files", "ok": True, "detail": detail})

    def in_base(p: str, s: str) -> bool:  # the base's own file holds it: the patch does not bring it
        state = run.ws.files.get(p)
        return state is not None and state.exists_in_base and s in "".join(state.base_lines)

    hits = [(p, s) for p in changed if (tree / p).is_file()
            for s in recipe.forbidden_strings if s in (tree / p).read_text(encoding="utf-8") and not in_base(p, s)]
    hits += [(p, s) for p, v in added for s in recipe.forbidden_strings if s in v]
    if hits:
        _fail("forbidden_strings", "; ".join(f"{s!r} in {p}" for p, s in sorted(set(hits))),
              hint="Exclude the upstream hunk that brings it, or fix the transform.")
    checks.append({"check": "forbidden_strings", "ok": True,
                   "detail": f"{len(recipe.forbidden_strings)} strings absent from {len(changed)} changed files"})

    if vtree.proc is not None:
        progress("import check")
        limit = float(os.environ.get("GDN_IMPORT_CHECK_TIMEOUT", "900"))
        try:
            returncode, stdout, stderr = vtree.import_result(limit)
        except subprocess.TimeoutExpired:
            _fail("imports", f"the import check with {opts.python} did not finish in {limit:.0f} s (stopped)",
                  hint="Check that --python is a Python interpreter that imports torch quickly, or raise the limit "
                       "(GDN_IMPORT_CHECK_TIMEOUT=seconds), or pass --no-import-check (the lock is then left alone).")
        if returncode < 0:
            _fail("imports", f"the import check's interpreter {opts.python} was killed by signal {-returncode} "
                             "(out of memory, or stopped from outside)",
                  hint="Run again; if it recurs, free memory or pass --no-import-check (recorded in the manifest).")
        if returncode != 0:
            tail = ("\n".join(stderr.strip().splitlines()[-6:]) or
                    f"it exited {returncode} and printed nothing on stderr (is it a Python interpreter?)")
            _fail("imports", f"the patched modules do not import with {opts.python}:\n{tail}",
                  hint="Install the verify requirements (`pip install -r requirements/verify.txt`) into the "
                       "interpreter given by --python, or pass --no-import-check (recorded in the manifest; the "
                       "lock is then left alone).")
        versions = (stdout.strip().splitlines() or [""])[-1]
        if not _is_versions(versions):  # exit 0 without the probe's line: not a Python that ran it
            said = repr(" ".join(stdout.split())[:200]) if stdout.strip() else "nothing"
            _fail("imports", f"--python {opts.python} exited 0 but did not run the import probe (it printed "
                             f"{said}, not the probe's version line): it is not a Python interpreter",
                  hint="Pass --python a Python interpreter with torch, triton 3.6.0 and FLA 0.4.2 (e.g. "
                       "$PWD/.venv/bin/python after `make venv`), or --no-import-check (the lock is then left "
                       "alone).")
        checks.append({"check": "imports", "ok": True,
                       "detail": f"{len(recipe.import_check)} modules imported; cp_context accepted; {versions}"})
    else:
        checks.append({"check": "imports", "ok": False, "detail": "skipped by --no-import-check",
                       "skipped_by": "--no-import-check"})
    checks.append(carry_survival(run))
    return checks


class _FileView:
    """One text as ``carry_survival`` reads it: the lines of each symbol, counted (stripped of
    line ends), from its symbol map (one parse per text, shared through ``maps``), and its
    module/class-level bindings (parsed when first asked)."""

    def __init__(self, text: str, maps: SymbolMaps):
        self.text = text
        self.lines = [ln.rstrip("\r\n") for ln in split_lines(text)]
        self.symbols = maps.get(text)
        self._bindings: "BindingMap | None" = None
        self._counts: dict = {}

    @property
    def bindings(self) -> BindingMap:
        """The text's bindings (one parse, on first use)."""
        if self._bindings is None:
            self._bindings = BindingMap(self.text)
        return self._bindings

    def region(self, symbol) -> "Counter | None":
        """How often each line occurs in ``symbol``: the whole file for module level or a
        non-Python file; None when the symbol is gone."""
        if symbol not in self._counts:
            if not symbol or not self.symbols.valid:
                lines = self.lines
            else:
                span = self.symbols.span(symbol)
                lines = None if span is None else self.lines[span[0]:span[1] + 1]
            self._counts[symbol] = None if lines is None else Counter(lines)
        return self._counts[symbol]


def carry_survival(run) -> dict:
    """Every carried hunk's effect is in the output: its added lines present and its removed
    lines not brought back, inside the same enclosing class/function as in the carry
    (hunks the recipe declares ``superseded`` are listed, not checked).

    Counts per distinct non-blank line: an added line must occur in the symbol at least as
    often as the hunk adds it; a removed line at most as often as right after the carry.

    Raises:
        VerificationError: naming the carried hunk, its symbol and the first line lost.
    """
    carry = getattr(run, "carry_model", None)
    if carry is None:
        return {"check": "carry_survival", "ok": True, "detail": "no carried patch"}
    checked = superseded = 0
    maps = getattr(run, "symbol_maps", None) or SymbolMaps()
    for cf in carry.files:
        for path in (cf.old_path, cf.new_path):
            if not path:
                continue
            gone = cf.kind == "delete" or (cf.kind == "rename" and path == cf.old_path)
            state = run.ws.files.get(path)
            exists = state is not None and state.exists
            if gone and exists:
                _fail("carry_survival", f"the carried patch removes {path} ({cf.kind}), but the output has it again",
                      hint=_SURVIVAL_HINT)
            if not gone and not exists:
                _fail("carry_survival", f"the carried patch makes {path} ({cf.kind}), but the output lacks it",
                      hint=_SURVIVAL_HINT)
        if cf.kind == "delete":
            checked += len(cf.hunks)
            continue
        final_text = run.ws.files[cf.path].text
        carried_text = run.carried_text.get(cf.path) or ""
        final_view = _FileView(final_text, maps)  # one parse each per file (none when the runs parsed it)
        carried_view = final_view if carried_text == final_text else _FileView(carried_text, maps)
        state = run.ws.files[cf.path]
        if cf.new_mode and cf.old_mode and cf.new_mode != cf.old_mode and (state.mode or cf.new_mode) != cf.new_mode:
            _fail("carry_survival", f"{cf.path}: carried mode {cf.new_mode} is not in the output", hint=_SURVIVAL_HINT)
        for h in cf.hunks:
            if run.origins.get(h.oid, {}).get("status") == "superseded":
                superseded += 1
                continue
            kept = run.origins.get(h.oid, {}).get("kept_forms") or []
            for form in kept:
                _check_kept_form(h, form, final_text)
            for sign, symbol, lines in _by_symbol(h):
                where = f"carried hunk {h.n} of {h.path} ({h.oid}) in {symbol or 'module level'}"
                # statements a kept form wraps are the step's now (checked by _check_kept_form)
                restated = {ln for f in kept for ln in f["restated" if sign == "+" else "replaced"]}
                lines = [ln for ln in lines if ln.rstrip("\r\n") not in restated]
                final = final_view.region(symbol)
                if final is None:
                    if sign == "-":
                        continue  # the symbol is gone, and with it every removed line
                    _fail("carry_survival", f"{where}: {symbol} no longer exists in the output", hint=_SURVIVAL_HINT)
                before = carried_view.region(symbol) or Counter()
                need = Counter(x.rstrip("\r\n") for x in lines)
                for line in _distinct(lines):
                    if sign == "+":
                        if final[line] < min(need[line], before[line]):
                            _fail("carry_survival", f"{where}: added line {line.strip()!r} is missing from the "
                                  "output", hint=_SURVIVAL_HINT)
                    elif final[line] > before[line]:
                        _fail("carry_survival", f"{where}: removed line {line.strip()!r} is back in the output",
                              hint=_SURVIVAL_HINT)
            # no step changed the file: nothing can be bound twice (and nothing needs parsing)
            twice = _twice_bound(carried_view.bindings, final_view.bindings, h) if final_view is not carried_view \
                else None
            if twice:
                scope, name = twice
                _fail("carry_survival", f"carried hunk {h.n} of {h.path} ({h.oid}): {name} is bound again in "
                      f"{scope or 'module level'} of the output after the carried binding", hint=_SURVIVAL_HINT)
            checked += 1
    detail = (f"{checked} carried hunk(s): added lines present, removed lines absent, in their symbols"
              + (f"; {superseded} superseded by the recipe" if superseded else ""))
    return {"check": "carry_survival", "ok": True, "detail": detail}


def _check_kept_form(h, form: dict, final_text: str) -> None:
    """A carried ``with`` block kept around the step's statement (a preserved fix in the
    user's form, see :func:`backport.transforms.merge._carry_wrappers`) is still there: a
    ``with`` whose header is the carried one holds a call of the same callee.

    Raises:
        VerificationError: naming the carried hunk, its symbol and the header line.
    """
    import ast

    header = form["wrapper"][0]
    try:
        tree = ast.parse(final_text)
    except SyntaxError:
        tree = None
    node = tree
    for name in form["symbol"].split("."):
        node = next((n for n in getattr(node, "body", []) if getattr(n, "name", None) == name), None)
    lines = [ln.rstrip("\r\n") for ln in split_lines(final_text)]
    if form.get("kind") == "call":  # wrap(f)(...): a call whose callee is the carried wrapper
        want = ast.dump(ast.parse(header.strip(), mode="eval").body)
        if any(isinstance(c, ast.Call) and ast.dump(c.func) == want for c in ast.walk(node or ast.Module([], []))):
            return
    for w in (ast.walk(node) if node is not None else []):
        if isinstance(w, (ast.With, ast.AsyncWith)) and lines[w.lineno - 1].strip() == header.strip():
            calls = {ast.unparse(c.func) for st in w.body for c in ast.walk(st) if isinstance(c, ast.Call)}
            if calls & set(form["around"]):
                return
    _fail("carry_survival", f"carried hunk {h.n} of {h.path} ({h.oid}) in {form['symbol']}: the carried "
          f"{header.strip()!r} around {', '.join(form['around'])} is missing from the output", hint=_SURVIVAL_HINT)


def _by_symbol(h) -> list:
    """``(sign, symbol, lines)`` groups of a carried hunk's added/removed lines by the symbol
    each line lands in (``line_symbols``); the hunk's anchor symbol when they are unknown."""
    if not h.line_symbols:
        return [("+", h.symbol, list(h.added)), ("-", h.symbol, list(h.removed))]
    groups: dict = {}
    for sign, line, symbol in h.line_symbols:
        groups.setdefault((sign, symbol if symbol is not None else h.symbol), []).append(line)
    return [(sign, symbol, lines) for (sign, symbol), lines in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))]


def _twice_bound(carried: BindingMap, final: BindingMap, h):
    """A ``(scope, name)`` the hunk's added lines bind that the output binds more often than the
    carried file does (a step added a second field/def/import of that name), else None."""
    mine = carried.keys_at(h.added_at)
    if not mine:
        return None
    twice = new_bindings(carried, final, mine)
    return twice[0] if twice else None


def _distinct(lines: list) -> list:
    return sorted({ln.rstrip("\r\n") for ln in lines if ln.strip()})


_SURVIVAL_HINT = ("Nothing was written. A recipe step dropped a carried change: make the step keep it (a "
                  "transform that rewrites a function merges carried edits), or declare the hunk superseded in "
                  "the recipe with the reason.")
