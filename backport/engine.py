"""The backport job: sources -> base tree -> carry -> recipe -> patch -> attribution -> verify.

:func:`build` computes everything in memory and returns a :class:`Build` (the recipe steps run
in :class:`_Run`; the patch text and its hunk attribution come from :mod:`backport.patchfile`,
the run's inputs from :mod:`backport.options`); :mod:`backport.output` puts it on disk
atomically or compares it with what is on disk. Nothing is written when any step or check fails.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from . import __version__, retarget
from .carry import apply_carry, check_paths, load_carry, read_base
from .errors import ApplyError, BindingExists, CacheDamaged, PipelineError, RecipeError, SourceError
from .recipe import (AddFile, Recipe, Transform, Transplant, UpstreamFile, UpstreamHunks, check_coverage, load_recipe,
                     load_references)
from .sources import Source, open_source
from .transforms import REGISTRY
from .transforms.fixes import FIX_FORMS
from .transforms.merge import CONFLICT_HINT, merge3, merge_carried_functions
from .transforms.transplant import transplant
from .tree import assemble_base_tree
from .options import Options, fs_text, validate
from .patchfile import attribute_hunks, kind_counts, make_patch
from .upstream_lines import beyond_upstream_rows, origin_line_totals, upstream_line_sets
from .upstream import UpstreamHunk, load_hunks
from .workspace import (BindingMap, FileState, SymbolMaps, Workspace, check_tree_path, hunk_lines, new_bindings,
                        split_lines)

ADAPTATIONS = Path(__file__).resolve().parent / "adaptations"


@dataclass
class Build:
    """Everything one run produced, in memory.

    Attributes:
        patch: bytes of ``megatron.patch``.
        manifest: the manifest as a JSON-able dict.
        base_tree: cached pristine assembled tree (contains ``megatron/``).
        timings: seconds per phase.
        cold: whether any source had to be cloned or fetched.
    """

    patch: bytes
    manifest: dict
    base_tree: Path
    timings: dict
    cold: bool
    recipe: Recipe
    #: per recipe step and upstream hunk, what happened at this base (:func:`retarget.step_report`)
    report: Optional[dict] = None


class _Run:
    """State of one in-memory application of carry + recipe to the base.

    ``warn`` receives warnings (offsets of placed hunks) for stderr; ``carry_model`` and
    ``carried_text`` (file text right after the carry) feed the ``carry_survival`` check.
    """

    def __init__(self, recipe: Recipe, mlm: Source, upstream_sha: str, hunks: dict[str, UpstreamHunk],
                 base_tree: Path, carry: Optional[Path], warn: Callable[[str], None] = lambda _m: None,
                 base_sha: Optional[str] = None, retargeted: bool = False, carry_model=None,
                 symbol_maps: Optional[SymbolMaps] = None):
        self.recipe, self.mlm, self.upstream_sha, self.hunks = recipe, mlm, upstream_sha, hunks
        self.base_sha = base_sha
        #: pins other than the recipe's (--bridge/--mcore-base): what the base already has is
        #: reported, not refused; at the recipe's own pins the recipe must say so (excluded:)
        self.retargeted = retargeted
        #: upstream hunk id / step id -> evidence that the base already has it (retargeted pins)
        self.already: dict[str, str] = {}
        self.base_tree, self.carry, self.warn = base_tree, carry, warn
        self.ws = Workspace()
        self.origins: dict[str, dict] = {}
        #: the carry parsed once per run (its bytes read once: the digest, the parse and the
        #: determinism re-run see the same bytes even when the file changes meanwhile)
        self.carry_model = carry_model
        self.carried_text: dict[str, Optional[str]] = {}
        #: symbol maps by file text, shared by the runs of one build and carry_survival (a
        #: carried file is parsed once, not once per hunk nor once per run)
        self.symbol_maps = symbol_maps if symbol_maps is not None else SymbolMaps()
        self._by_path: Optional[dict] = None
        self._upstream_parent: dict[str, Optional[str]] = {}
        #: path -> the file after the recipe steps so far, without the carry (the ancestor of the
        #: three-way merges); None when a step could not run on it (then the base is used)
        self.shadow: dict[str, Optional[str]] = {}

    def base_text(self, path: str) -> Optional[str]:
        return read_base(self.base_tree, path)

    def file(self, path: str):
        return self.ws.get(path, self.base_text)

    def apply(self) -> None:
        for step in self.recipe.steps:  # recipe paths are refused before anything is read
            for path in _step_paths(step, self.hunks):
                check_tree_path(path, self.base_tree, RecipeError, what=f"recipe step {step.id}: path",
                                hint="Recipe paths are relative to the tree root (megatron/...), without '..', "
                                     "a leading '/' or a symlink leading out.")
        if self.carry is not None:
            self._apply_carry()
        for step in self.recipe.steps:
            try:
                self._apply_step(step)
            except PipelineError as exc:
                raise retarget.annotate_failure(exc, step, self.base_tree)

    def _apply_carry(self) -> None:
        carry = self.carry_model if self.carry_model is not None else load_carry(self.carry)
        check_paths(carry, self.base_tree)
        apply_carry(carry, self.ws, self.base_text, self.base_tree, self.origins, self.warn, self.symbol_maps)
        self.carry_model = carry
        for cf in carry.files:
            for path in (cf.old_path, cf.new_path):
                if path:
                    state = self.ws.files[path]
                    self.carried_text[path] = state.text if state.exists else None
        for sup in self.recipe.superseded:
            if sup.hunk in self.origins and self.origins[sup.hunk]["kind"] == "carried":
                self.origins[sup.hunk].update(status="superseded", superseded_by=sup.step, superseded_why=sup.why)
            else:
                self.warn(f"warning: the recipe declares {sup.hunk} superseded, but the carried patch has no such hunk")

    def _upstream_source(self, path: str) -> Optional[str]:
        """The file an upstream hunk was made against (the upstream commit's parent), or None."""
        if path not in self._upstream_parent:
            try:
                self._upstream_parent[path] = self.mlm.read(f"{self.upstream_sha}^", path).decode("utf-8")
            except CacheDamaged:
                raise  # the cache's fault: never placed without the symbol check instead
            except (SourceError, UnicodeDecodeError):
                self._upstream_parent[path] = None
        return self._upstream_parent[path]

    def _carried_hunks(self, path: str) -> list:
        """The carried hunks of ``path`` (indexed by path once per run, not searched per call)."""
        if self.carry_model is None:
            return []
        if self._by_path is None:
            self._by_path = {}
            for h in self.carry_model.hunks:
                self._by_path.setdefault(h.path, []).append(h)
        return self._by_path.get(path, [])

    def _live_hunks(self, path: str) -> list:
        return [h for h in self._carried_hunks(path) if self.origins.get(h.oid, {}).get("status") != "superseded"]

    def _shadow_step(self, path: str, fn: Callable[[str], str]) -> None:
        """Run the step on the carry-free copy of ``path`` (only for paths the carry touches)."""
        if self.carry_model is None or not self._carried_hunks(path):
            return
        if path not in self.shadow:
            self.shadow[path] = self.base_text(path)
        if self.shadow[path] is None:
            return
        try:
            self.shadow[path] = fn(self.shadow[path])
        except PipelineError:
            self.shadow[path] = None

    def _ancestor(self, path: str) -> Optional[str]:
        text = self.shadow.get(path, self.base_text(path))
        return text if text is not None else self.base_text(path)

    def _check_not_deleted_by_carry(self, step) -> None:
        """A step that edits or takes a file the carried patch deletes (or renames away) cannot
        run: the carry is the culprit, not the recipe.

        Raises:
            ApplyError (exit 6): naming the carry's file section, the file and the step.
        """
        if self.carry_model is None or isinstance(step, AddFile):
            return
        for path in _step_paths(step, self.hunks):
            state = self.ws.files.get(path)
            if state is None or state.exists or not state.exists_in_base:
                continue
            n, cf = next(((i, cf) for i, cf in enumerate(self.carry_model.files, start=1)
                          if cf.old_path == path and cf.kind in ("delete", "rename")), (None, None))
            if cf is None:
                continue
            gone = f"deletes {path}" if cf.kind == "delete" else f"renames {path} to {cf.new_path}"
            verb = "takes whole from upstream" if isinstance(step, UpstreamFile) else "edits"
            raise ApplyError(
                f"carried patch {fs_text(self.carry.name)} {gone} (its file section {n}), a file recipe step "
                f"{step.id} ({self._what(step)}) {verb}; the step cannot run on a file the carry removed.",
                hint=f"Keep {path} in the carried patch (drop its {cf.kind} section, and carry only the edits "
                     f"you need as hunks against the base); or, if the backport must do without that file, "
                     f"use a --recipe without step {step.id} (its upstream hunks listed under `excluded:` "
                     "with a why).")

    def _apply_step(self, step) -> None:
        self._check_not_deleted_by_carry(step)
        if isinstance(step, UpstreamFile):
            content = self.mlm.read(self.upstream_sha, step.path).decode()
            state = self.file(step.path)
            if state.exists_in_base and state.text == content:
                mine = [h.oid for h in self._live_hunks(step.path)]
                if mine and self.base_text(step.path) != content:  # the carry made it upstream's file
                    raise ApplyError(
                        f"carried patch {fs_text(self.carry.name)} makes {step.path} identical to upstream's file "
                        f"({', '.join(mine)}), which recipe step {step.id} (upstream_file) takes whole; the step "
                        "would change nothing.",
                        hint=f"Drop {step.path} from the carried patch: step {step.id} takes the same file from "
                             "upstream.")
                if not self.retargeted:
                    raise ApplyError(f"step {step.id}: {step.path} is already identical to upstream at the base.",
                                     hint=f"Take step {step.id} out of the recipe and list its hunks under "
                                          "`excluded:` with a why (e.g. 'already in the base').")
                for hid in step.hunks:  # the base has the file already
                    self.already[hid] = f"{step.path} at the base is byte-identical to upstream's"
                return
            self._check_whole_file(step, state.text, content)
            state.replace_text(content, step.hunks[0])
            self._shadow_step(step.path, lambda _t: content)
            for hid in step.hunks:
                self.origins[hid] = self._upstream_origin(hid, "upstream-verbatim", step, offset=0)
        elif isinstance(step, UpstreamHunks):
            for hid in step.hunks:
                uh = self.hunks[hid]
                source = self._upstream_source(uh.path)
                kwargs = {"source_text": source, "source_symbol": "?"} if source is not None else {}
                state = self.file(uh.path)
                before, tags = state.text, list(state.tags)
                try:
                    offset = state.apply_hunk(uh.hunk, hid, **kwargs)
                except ApplyError as exc:
                    # the base itself (not the carry, not an earlier step) already holds its result
                    at = retarget.already_upstream(split_lines(self.base_text(uh.path) or ""), hunk_lines(uh.hunk))
                    if (self.retargeted and at is not None
                            and retarget.already_upstream(state.lines, hunk_lines(uh.hunk)) is not None):
                        self.already[hid] = f"its result is at {uh.path}:{at} of the base"
                        continue
                    blame = self._carry_blocks_upstream(step, hid, kwargs, exc)
                    if blame is not None:
                        raise blame from exc
                    raise ApplyError(f"step {step.id}: {exc.message}", hint=_upstream_hint(exc, step.id, hid)) from exc
                self._check_bindings(step, uh.path, before, state.text, tags)

                def on_shadow(text, uh=uh, hid=hid, kwargs=kwargs):
                    fs = FileState.from_base(uh.path, text)
                    fs.apply_hunk(uh.hunk, hid, **kwargs)
                    return fs.text
                self._shadow_step(uh.path, on_shadow)
                self.origins[hid] = self._upstream_origin(hid, "upstream-verbatim", step, offset=offset)
                if offset:
                    self.warn(f"warning: upstream hunk {hid} placed at offset {offset:+d} lines")
        elif isinstance(step, Transplant):
            state = self.file(step.path)
            have = self._prerequisite_at_base(step)
            if have:
                self.already[step.id] = have
                self.origins[step.id] = {"kind": "prerequisite", "commit": step.commit, "upstream_ref": step.upstream_ref,
                                         "symbols": step.symbols, "why": step.why, "status": "already-present"}
                return
            up_text = self.mlm.read(step.commit, step.path).decode()
            new = transplant(state.text, up_text, step.symbols, step.path, step.commit[:12])
            before, tags = state.text, list(state.tags)
            state.replace_text(self._merge_carry(step, state.text, new), step.id)
            self._check_bindings(step, step.path, before, state.text, tags)
            self._shadow_step(step.path, lambda t: transplant(t, up_text, step.symbols, step.path, step.commit[:12]))
            self.origins[step.id] = {"kind": "prerequisite", "commit": step.commit, "upstream_ref": step.upstream_ref,
                                     "symbols": step.symbols, "why": step.why, "status": "applied"}
        elif isinstance(step, AddFile):
            state = self.file(step.path)
            if state.exists_in_base or state.exists:
                mine = next((h.oid for h in self._live_hunks(step.path)), None) if not state.exists_in_base else None
                raise ApplyError(f"step {step.id}: {step.path} already exists in the "
                                 f"{'base tree' if state.exists_in_base else 'carried patch'}"
                                 + (f" ({mine}); the step would replace the carried file." if mine else "."),
                                 hint="Drop the file from the carried patch (the recipe adds it), or carry your "
                                      "changes as edits on top of the recipe's file." if mine else None)
            state.replace_text((ADAPTATIONS / step.template).read_text(encoding="utf-8"), step.id)
            self.origins[step.id] = {"kind": "adaptation", "template": step.template, "adapts": step.adapts,
                                     "why": step.why, "status": "applied"}
        elif isinstance(step, Transform):
            fn = REGISTRY.get(step.transform)
            if fn is None:
                raise RecipeError(f"step {step.id}: unknown transform {step.transform!r}; known: {', '.join(sorted(REGISTRY))}.")
            state = self.file(step.path)
            try:
                result = fn(state.text, step.path)
            except BindingExists as exc:
                self._binding_conflict(step, step.path, state.text, state.tags, exc)
                raise
            except ApplyError as exc:
                blame = self._carry_blocks_transform(step, fn, exc)
                if blame is not None:
                    raise blame from exc
                raise
            before, tags = state.text, list(state.tags)
            changed = state.replace_text(self._merge_carry(step, state.text, result.text), step.id)
            self._check_bindings(step, step.path, before, state.text, tags)
            self._shadow_step(step.path, lambda t: fn(t, step.path).text)
            status = result.status if changed or result.status == "already-present" else "no-op"
            if status == "no-op":
                raise ApplyError(f"step {step.id}: transform {step.transform} changed nothing in {step.path}.")
            kind = "preserved-fix" if step.kind == "fix" else "adaptation"
            self.origins[step.id] = {"kind": kind, "transform": step.transform, "adapts": step.adapts,
                                     "why": step.why, "status": status}
            if step.source:
                self.origins[step.id]["source"] = step.source

    def _carry_blocks_upstream(self, step, hid: str, kwargs: dict, exc: ApplyError) -> Optional[ApplyError]:
        """The error naming the carried hunk when upstream hunk ``hid`` fails only because of the
        carry, else None (then the recipe's message stands).

        The carry is the culprit when the hunk applies to the file without the carry (the base
        after the earlier steps: the three-way merge's ancestor) and fails on the file with it.
        The carried hunk named is the one that changed a line inside the upstream hunk's source
        range (context and removed lines) there, found by diffing the two versions of the file;
        when no carried change lies inside that range (the carry made the context match twice, or
        in another symbol), every carried hunk of the file is named.
        """
        uh = self.hunks[hid]
        carried = list(self._carried_hunks(uh.path))
        if not carried:
            return None
        ancestor = self.shadow[uh.path] if uh.path in self.shadow else self.base_text(uh.path)
        if ancestor is None and getattr(exc, "reason", "") == "exists" and self.base_text(uh.path) is None:
            ids = ", ".join(h.oid for h in carried)
            return ApplyError(
                f"carried patch {fs_text(self.carry.name)} adds {uh.path} ({ids}), a file upstream hunk {hid} of "
                f"recipe step {step.id} creates; the upstream hunk cannot create it again.",
                hint=f"Drop {uh.path} from the carried patch: step {step.id} creates it from upstream; or, to keep "
                     f"your file instead, move {hid} to the recipe's `excluded:` list with a why (docs/carry.md).")
        if ancestor is None:
            return None
        alone = FileState.from_base(uh.path, ancestor)
        try:
            offset = alone.apply_hunk(uh.hunk, hid, **kwargs)
        except ApplyError:
            return None  # fails without the carry too: the recipe's (the base's) problem
        hl = hunk_lines(uh.hunk)
        start = hl.header_pos + offset
        end = start + len(hl.source)
        state = self.file(uh.path)
        anc, base = split_lines(ancestor), split_lines(self.base_text(uh.path) or "")
        to_base = _line_map(anc, base)
        first = f"{to_base(start)}-{to_base(end - 1)}"
        own = {h.oid: h for h in carried}
        found = None
        matcher = difflib.SequenceMatcher(None, anc, state.lines, autojunk=False)
        for op, i1, i2, j1, j2 in matcher.get_opcodes():
            if op == "equal" or not (start < i1 < end if op == "insert" else i1 < end and i2 > start):
                continue
            old = anc[max(i1, start):min(i2, end)]
            h = next((own[t[1]] for t in state.tags[j1:j2] if t[0] == "origin" and t[1] in own), None) or next(
                (h for h in carried if any(ln in h.removed for ln in old)), None)
            if h is not None:
                found = (h, op, max(i1, start), old, state.lines[j1:j2])
                break
        what = f"upstream hunk {hid} ({uh.header.split(' @@')[0]} @@) of recipe step {step.id}"
        strip = lambda ln: ln.rstrip("\r\n")  # noqa: E731
        same = "; the carry already makes that hunk's change" if getattr(exc, "reason", "") == "already" else ""
        if found is not None and self.origins.get(found[0].oid, {}).get("status") == "superseded":
            same += (f"; the recipe's `superseded` entry for {found[0].oid} does not help here: an upstream_hunks step "
                     "applies upstream's hunk verbatim to the carried file (superseded works for steps that rewrite "
                     "a function)")
        if found is None:
            ids = ", ".join(h.oid for h in carried)
            return ApplyError(
                f"{what} applies to {uh.path} without the carried patch but not after it ({exc.message}); "
                f"the carried hunks of {uh.path} ({ids}) change the lines it needs (lines {first} of the base).",
                hint=f"Edit those carried hunks (still diffs against the pinned base) so that the upstream hunk's "
                     f"lines {first} of {uh.path} stay as in the base, or drop them; or, to keep your version, "
                     f"move {hid} from step {step.id} to the recipe's `excluded:` list with a why (docs/carry.md).")
        h, op, at, old, new = found
        if op == "insert":
            change = f"adds {strip(new[0])!r} inside lines {first}"
        elif op == "delete":
            change = f"removes line {to_base(at)} {strip(old[0])!r}"
        else:
            change = f"replaces line {to_base(at)} {strip(old[0])!r} by {strip(new[0])!r}"
        return ApplyError(
            f"carried hunk {h.n} of {h.path} ({h.oid}, {h.header.split(' @@')[0]} @@) {change}, inside the lines "
            f"{what} needs as in the base (lines {first}): after the carry that hunk no longer applies verbatim "
            f"(it applies without the carry){same}.",
            hint=f"The carry is applied before the recipe. If the recipe's upstream hunk makes your change "
                 f"unnecessary, drop {h.oid} from the carried patch; else edit it (still a diff against the pinned "
                 f"base) so that it leaves lines {first} of {h.path} alone; or, to keep your version of those "
                 f"lines, move {hid} from step {step.id} to the recipe's `excluded:` list with a why "
                 "(docs/carry.md).")

    def _carry_blocks_transform(self, step, fn, exc: ApplyError) -> Optional[ApplyError]:
        """The error naming the carried hunk when transform step ``step`` fails (its anchor gone)
        only because of the carry, else None (then the transform's message stands).

        The carry is the culprit when the transform's refusal blames the recipe (the default
        hint) and the transform runs on the file without the carry (the three-way merge's ancestor). The hunk named is the one whose removed lines hold a name
        or code the message quotes (the anchor), else every carried hunk of the file.
        """
        path = step.path
        carried = list(self._carried_hunks(path))
        if exc.hint != ApplyError.default_hint:
            return None  # the transform already names its culprit (e.g. a form of the user's it will not replace)
        if not carried or (path in self.shadow and self.shadow[path] is None):
            return None
        ancestor = self.shadow.get(path, self.base_text(path))
        if ancestor is None:
            return None
        try:
            fn(ancestor, path)
        except PipelineError:
            return None  # fails without the carry too: the recipe's (the base's) problem
        quoted = [a or b for a, b in re.findall(r"`([^`]+)`|'([^']+)'", exc.message)]
        named = [h for h in carried if any(q in ln for q in quoted for ln in h.removed)] or carried
        which = ", ".join(f"carried hunk {h.n} of {h.path} ({h.oid}, {h.header.split(' @@')[0]} @@)" for h in named)
        ids = ", ".join(h.oid for h in named)
        return ApplyError(
            f"{which} {'removes or changes' if len(named) == 1 else 'remove or change'} what recipe step {step.id} "
            f"({self._what(step)}) anchors on: {exc.message.rstrip('.')}; the step runs on {path} without the "
            "carried patch.",
            hint=f"Edit {ids} (still a diff against the pinned base) so that it keeps the step's anchor as in the "
                 f"base, or drop it: step {step.id} makes its own change there. If your hunk already makes that "
                 f"change, run with a --recipe without step {step.id} (the upstream hunks it adapts listed under "
                 "`excluded:` with a why).")

    def _prerequisite_at_base(self, step) -> Optional[str]:
        """Evidence that the base already has a prerequisite: it descends from the step's commit
        and its file defines every symbol (so the base's own, later version stays); else None."""
        if self.base_sha is None or not retarget.is_ancestor(self.mlm, step.commit, self.base_sha):
            return None
        text = self.base_text(step.path) or ""
        names = set(retarget._defined_names(text))
        if not all(sym in names for sym in step.symbols):
            return None
        return (f"the base descends from {step.commit[:12]} and {step.path} defines "
                f"{', '.join(step.symbols)}; the base's version is kept")

    def _what(self, step) -> str:
        return f"transform {step.transform}" if getattr(step, "transform", None) else step.kind

    def _carried_bindings(self, path: str, text: str, tags: list) -> dict:
        """``(scope, name) -> carried hunk`` for every module/class-level name whose binding
        statement holds a line a live carried hunk added (by the line tags of ``text``)."""
        live = self._live_hunks(path)
        if not live:
            return {}
        found = text if isinstance(text, BindingMap) else BindingMap(text)  # one parse for all the hunks
        at: dict = {}
        for i, tag in enumerate(tags):  # one pass over the tags
            if tag[0] == "origin":
                at.setdefault(tag[1], []).append(i)
        out = {}
        for h in live:
            for key in sorted(found.keys_at(at.get(h.oid, ()))):
                out.setdefault(key, h)
        return out

    def _check_bindings(self, step, path: str, before: str, after: str, tags: list) -> None:
        """A step must not bind again a name that a carried line binds (a second field, def or
        import of that name would override or shadow the carried one); a second binding of
        the identical form (the same import, the same statement) is accepted.

        Raises:
            ApplyError (exit 6): naming the carried hunk, the name and the step.
        """
        if not self._live_hunks(path) or before == after:
            return
        was = BindingMap(before)
        mine = self._carried_bindings(path, was, tags)
        if not mine:
            return
        twice = new_bindings(was, after, mine)
        if twice:
            key = twice[0]
            h, (scope, name) = mine[key], key
            line = split_lines(before)[was.spans[key][0][0]].rstrip("\r\n") if was.spans.get(key) else name
            raise ApplyError(
                f"carried hunk {h.n} of {h.path} ({h.oid}, in {scope or 'module level'}) conflicts with recipe "
                f"step {step.id} ({self._what(step)}), which binds {name} again in {scope or 'module level'}: "
                f"first conflicting line {line!r}.",
                hint=CONFLICT_HINT.format(oid=h.oid, step=step.id))

    def _binding_conflict(self, step, path: str, text: str, tags: list, exc: BindingExists) -> None:
        """Re-raise a transform's :class:`BindingExists` naming the carried hunk that binds the
        name (or wrote the line it names), when there is one (else the caller re-raises ``exc``
        itself, exit 6 all the same)."""
        h = self._carried_bindings(path, text, tags).get((exc.scope, exc.name))
        if h is None:  # not a module/class-level binding: the carried hunk that wrote that line
            h = next((h for h in self._live_hunks(path)
                      if 0 < exc.lineno <= len(tags) and tags[exc.lineno - 1] == ("origin", h.oid)), None)
        if h is None:
            return
        line = split_lines(text)[exc.lineno - 1].rstrip("\r\n") if 0 < exc.lineno <= len(split_lines(text)) else ""
        raise ApplyError(
            f"carried hunk {h.n} of {h.path} ({h.oid}, in {exc.scope or 'module level'}) conflicts with recipe step "
            f"{step.id} ({self._what(step)}), which adds {exc.name} to {exc.scope or 'module level'} again: first "
            f"conflicting line {line!r}.", hint=_binding_hint(exc, h.oid, step.id)) from exc

    def _check_whole_file(self, step, before: str, content: str) -> None:
        """An ``upstream_file`` step replaces a file the carry changed: fine only when upstream's
        file already holds every carried change (a clean three-way merge gives upstream's bytes).

        Raises:
            ApplyError (exit 6): naming the first carried hunk whose change upstream's file lacks.
        """
        live = self._live_hunks(step.path)
        ancestor = self._ancestor(step.path) or ""
        if not live or before == ancestor:
            return
        merged, n = merge3(content, ancestor, before)
        if n == 0 and merged == content:
            return
        h = next((h for h in live if any(ln not in split_lines(content) for ln in h.added)
                  or any(ln in split_lines(content) for ln in h.removed)), live[0])
        line = next((ln for ln in h.added if ln not in split_lines(content) and ln.strip()), (h.added or h.removed or [""])[0])
        raise ApplyError(
            f"carried hunk {h.n} of {h.path} ({h.oid}) conflicts with recipe step {step.id} (upstream_file), which "
            f"takes {step.path} whole from upstream: first conflicting line {line.rstrip(chr(13) + chr(10))!r}.",
            hint=CONFLICT_HINT.format(oid=h.oid, step=step.id))

    def _merge_carry(self, step, before: str, after: str) -> str:
        """``after`` with the carried changes to functions the step rewrote merged back in
        (three-way: ancestor the file before the step without the carry, ours the step's
        result, theirs the file before the step); ``after`` itself without a carry."""
        if self.carry_model is None or before == after:
            return after
        hunks = list(self._carried_hunks(step.path))
        if not hunks:
            return after
        base = self._ancestor(step.path)
        if base is None:
            return after
        superseded = {k for k, v in self.origins.items() if v.get("status") == "superseded"}
        fix_forms = [(s.id, FIX_FORMS[s.transform]) for s in self.recipe.steps if isinstance(s, Transform)
                     and s.kind == "fix" and s.path == step.path and s.transform in FIX_FORMS]
        kept: list = []
        merged = merge_carried_functions(base, before, after, hunks, step, step.path, superseded,
                                         fix_forms=fix_forms, kept_forms=kept)
        for rec in kept:  # the user's form of a preserved fix, carried onto the step's statement
            for oid in rec["hunks"]:
                self.origins[oid].setdefault("kept_forms", []).append(
                    {k: rec[k] for k in ("kind", "step", "fix", "symbol", "wrapper", "around", "restated", "replaced")})
        return merged

    def _upstream_origin(self, hid: str, kind: str, step, offset: int) -> dict:
        uh = self.hunks[hid]
        return {"kind": kind, "commit": self.upstream_sha, "step": step.id, "header": uh.header,
                "digest": uh.digest, "offset": offset, "why": step.why}


def _step_paths(step, hunks: dict) -> list[str]:
    """Every tree path a recipe step reads or writes."""
    if isinstance(step, UpstreamHunks):
        return sorted({hunks[h].path for h in step.hunks if h in hunks})
    return [step.path] if hasattr(step, "path") else []


def _line_map(lines: list, base: list) -> Callable[[int], int]:
    """0-based index into ``lines`` -> 1-based line of the same text in ``base`` (the file before
    the recipe's earlier steps), through their diff; a line the steps wrote keeps its own number."""
    where: dict[int, int] = {}
    for op, i1, i2, j1, _j2 in difflib.SequenceMatcher(None, lines, base, autojunk=False).get_opcodes():
        if op == "equal":
            where.update({i1 + k: j1 + k for k in range(i2 - i1)})
    return lambda i: where.get(i, i) + 1


def _upstream_hint(exc: ApplyError, step_id: str, hid: str) -> str:
    """What to do about upstream hunk ``hid`` that does not apply to the base (no carry to blame):
    the placement hints of :mod:`backport.workspace` are written for a carried hunk (regenerate it,
    give it more context, drop it from the carry), which an upstream hunk cannot do."""
    adapt = (f"take {hid} out of step {step_id} and make its change with a transform step that adapts it "
             f"(`adapts: [{hid}]`), or move it to the recipe's `excluded:` list with a why")
    reason = getattr(exc, "reason", "")
    if reason == "exists":
        return (f"The pinned base already has the file upstream hunk {hid} creates: take the file with an "
                f"`upstream_file` step, or move {hid} to the recipe's `excluded:` list with a why.")
    if reason == "already":
        return (f"The pinned base already holds upstream hunk {hid}'s change: move it from step {step_id} to the "
                "recipe's `excluded:` list with a why (e.g. 'already in the base').")
    if reason == "elsewhere":
        return f"At the base this code sits in another class/function than upstream's: {adapt}."
    if reason == "twice":
        return f"At the base the hunk's context matches several times in its class/function: {adapt}."
    if reason == "differs":
        return f"The base differs from upstream's parent where this hunk goes: {adapt}."
    return exc.hint


def _binding_hint(exc: BindingExists, oid: str, step_id: str) -> str:
    """What to do about a carried binding a step would add again: the transform's own advice
    (drop it, or give it the recipe's form), or the recipe's ``superseded`` route."""
    if not exc.hint or exc.hint == type(exc).default_hint:
        return CONFLICT_HINT.format(oid=oid, step=step_id)
    return (f"{exc.hint.rstrip('.')}. Or, if the backport makes the carried hunk unnecessary, declare it in the "
            f"recipe: `superseded: [{{hunk: {oid}, step: {step_id}, why: ...}}]`.")


def build(opts: Options, progress: Callable[[str], None] = lambda _m: None) -> Build:
    """Run the whole job in memory and verify it; return the result.

    Raises:
        PipelineError subclasses: see :mod:`backport.errors`; nothing is written.
    """
    import time

    from .verify import VerifyTree, verify

    validate(opts)
    t0 = time.perf_counter()
    timings = {}
    recipe, recipe_sha = load_recipe(opts.recipe)
    pins = recipe.pins
    progress("opening sources")
    mlm, bridge, used = retarget.resolve(opts, recipe, progress)
    timings["sources_s"] = time.perf_counter() - t0
    upstream_sha, base_sha, bridge_sha, dev_commit, between = (
        used.upstream, used.base, used.bridge, used.dev_commit, used.between)
    if dev_commit is not None and dev_commit != base_sha:
        progress(f"warning: MCore base {base_sha} differs from Megatron-Bridge {bridge_sha[:12]}'s .dev.commit "
                 f"({dev_commit}); allowed by --allow-pin-mismatch (recorded in the manifest)")

    references = load_references(opts.recipe)
    hunk_list = load_hunks(mlm, upstream_sha)
    dispositions = check_coverage(recipe, [h.id for h in hunk_list])
    hunks = {h.id: h for h in hunk_list}

    t1 = time.perf_counter()
    progress("assembling the base tree")
    base_tree = assemble_base_tree(bridge, bridge_sha, mlm, base_sha, opts.cache_dir)
    timings["base_tree_s"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    progress("applying carry and recipe")
    carry_model = load_carry(opts.carry) if opts.carry else None
    carry_sha = hashlib.sha256(carry_model.raw).hexdigest() if carry_model else None
    header = (
        f"gdn-backport {__version__} megatron.patch, {opts.date[:4]}-{opts.date[4:6]}-{opts.date[6:]}\n"
        f"base: Megatron-Bridge {bridge_sha} + Megatron-LM {base_sha}\n"
        f"upstream: {upstream_sha} ({pins.upstream_ref})\n"
        f"recipe: {recipe.name} sha256 {recipe_sha}\n"
        + (f"carry: sha256 {carry_sha}\n" if carry_sha else "")
        + "Apply with: patch -p1 --fuzz=0 < megatron.patch (from the tree root holding megatron/)\n\n"
    )

    symbol_maps = SymbolMaps()  # one parse per file text for both runs and carry_survival

    def once(warn=lambda _m: None):
        run = _Run(recipe, mlm, upstream_sha, hunks, base_tree, opts.carry, warn=warn, base_sha=base_sha,
                   retargeted=used.retargeted, carry_model=carry_model, symbol_maps=symbol_maps)
        run.apply()
        return run, make_patch(run.ws.changed(), header, base_tree)

    run, patch_text = once(warn=progress)
    timings["recipe_s"] = time.perf_counter() - t2
    changed_paths = [f.path for f in run.ws.changed()]
    files, attribution = attribute_hunks(patch_text, run.ws, run.origins,
                                         upstream_line_sets(mlm, upstream_sha, changed_paths))

    upstream_records = []
    for h in hunk_list:
        disp, by = dispositions[h.id]
        rec = {"id": h.id, "header": h.header, "added": h.added, "removed": h.removed, "digest": h.digest,
               "disposition": disp, "by": by}
        if disp == "excluded":
            rec["reason"] = next(e.why for e in recipe.excluded if e.id == by)
        upstream_records.append(rec)

    patch_bytes = patch_text.encode()
    manifest = {
        "schema": 1,
        "tool": {"name": "gdn-backport", "version": __version__},
        "date": f"{opts.date[:4]}-{opts.date[4:6]}-{opts.date[6:]}",
        "recipe": {"name": recipe.name, "path": opts.recipe.name, "sha256": recipe_sha},
        "pins": {
            "megatron_bridge": bridge_sha, "mcore_base": base_sha, "bridge_dev_commit": dev_commit,
            "upstream": upstream_sha, "upstream_ref": pins.upstream_ref, "commits_between": between,
            "prerequisites": sorted({s.commit for s in recipe.steps if isinstance(s, Transplant)}),
            # only when --allow-pin-mismatch let another base through (the usual manifest keeps its bytes)
            **({"pin_mismatch_allowed": True} if dev_commit != base_sha else {}),
        },
        "carry": None if opts.carry is None else {
            "name": fs_text(opts.carry.name), "sha256": carry_sha,
            "hunks": sorted(k for k, v in run.origins.items() if v["kind"] == "carried")},
        "patch": {
            "name": patch_name(opts.date, base_sha, carry_sha), "sha256": hashlib.sha256(patch_bytes).hexdigest(),
            "files": len(files), "hunks": sum(len(f["hunks"]) for f in files),
            "added": sum(f["added"] for f in files), "removed": sum(f["removed"] for f in files),
            "added_by_kind": kind_counts(r["kind"] for f in files for h in f["hunks"] for r in h["lines"]
                                         for _ in range(r["n"])),
        },
        "attribution": {"exact": attribution.get("exact", 0), "by_neighbour": attribution.get("by_neighbour", 0)},
        "files": files,
        "origins": {k: run.origins[k] for k in sorted(run.origins)},
        "lines_vs_upstream": origin_line_totals(files),
        "beyond_upstream": beyond_upstream_rows(recipe),
        "upstream_hunks": upstream_records,
        "upstream_summary": dict(sorted(Counter(r["disposition"] for r in upstream_records).items())),
        "forbidden_strings": recipe.forbidden_strings,
        **({"references": references} if references is not None else {}),
    }
    adapted = [h for h, (disp, _by) in dispositions.items() if disp == "adapted"]
    report = retarget.step_report(recipe, run.origins, dispositions, [h.id for h in hunk_list], run.already,
                                  retarget.verbatim_at_base(hunks, adapted, run.base_text))
    if used.retargeted:  # the recipe's own pins: the recipe is the report (and the lock's bytes stay)
        manifest["retarget"] = {"recipe_pins": {"megatron_bridge": pins.megatron_bridge, "mcore_base": pins.mcore_base,
                                                "commits_between": pins.commits_between}, **report}

    t3 = time.perf_counter()
    progress("verifying")
    # The import check (a second interpreter) runs on the patched scratch tree while this process
    # makes the determinism run and the other checks: the two slowest steps overlap.
    with VerifyTree(patch_text, run, recipe, opts) as vtree:
        _, patch_again = once()
        checks = verify(patch_text, patch_again, run, recipe, opts, progress, vtree)
    manifest["verification"] = checks
    timings["verify_s"] = time.perf_counter() - t3
    timings["total_s"] = time.perf_counter() - t0
    return Build(patch=patch_bytes, manifest=manifest, base_tree=base_tree, timings=timings,
                 cold=mlm.cold or bridge.cold, recipe=recipe, report=report)


def patch_name(date: str, base_sha: str, carry_sha: Optional[str] = None) -> str:
    """The dated patch's file name: ``<YYYYMMDD>-<base9>.patch``, or with a carry
    ``<YYYYMMDD>-<base9>-carry-<sha256[:8] of the carried patch>.patch``, so the outputs of a run
    with a carry never take the name (and the place in patches/megatron/) of the plain run's."""
    stem = f"{date}-{base_sha[:9]}"
    return f"{stem}-carry-{carry_sha[:8]}.patch" if carry_sha else f"{stem}.patch"


def list_hunks(opts: Options, progress: Callable[[str], None] = lambda _m: None) -> list[str]:
    """Lines ``<id>  +A -R  <header>`` for every hunk of the upstream commit."""
    recipe, _ = load_recipe(opts.recipe)
    rev = opts.upstream or recipe.pins.upstream
    mlm = open_source("megatron-lm", opts.megatron_lm, opts.cache_dir, (rev,), progress, opts.offline)
    return [f"{h.id}  +{h.added} -{h.removed}  {h.header}" for h in load_hunks(mlm, mlm.resolve(rev))]
