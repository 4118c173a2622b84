"""The pins a run actually uses, and what a base other than the recipe's does to the recipe.

``--bridge SHA`` retargets the backport: the MCore base is that Bridge commit's ``.dev.commit``
(``--mcore-base`` overrides it only with ``--allow-pin-mismatch``); the recipe's pins stay the
defaults. :func:`resolve` opens both sources and measures ``commits_between`` (the recipe's
declared value is checked on the recipe's own pins and reported, never trusted, on others).

When the base already contains the upstream commit the feature is native: :func:`resolve`
raises :class:`~backport.errors.FeatureNative` (exit 17) listing what of ours still matters
there (:func:`native_fixes`). On a base the recipe was not written for, :func:`step_report`
says per recipe step and per upstream hunk what happened: taken verbatim (offset), adapted,
prerequisite already present at the base, upstream hunk already present ("already upstream",
with the line where its result sits); a step that fails names itself, its file and the anchor
(:func:`annotate_failure`, with where a missing anchor symbol went when another file defines it).
"""

from __future__ import annotations

import ast
import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .errors import ApplyError, FeatureNative, PinError, PipelineError, RecipeError, SourceError
from .recipe import AddFile, Recipe, Transform, Transplant, UpstreamFile, UpstreamHunks
from .sources import Source, open_source


@dataclass(frozen=True)
class RunPins:
    """The pins of one run (full SHAs).

    Attributes:
        bridge: Megatron-Bridge commit; dev_commit: its ``.dev.commit`` (None: it has none and
            ``--mcore-base`` was given with ``--allow-pin-mismatch``); base: the MCore base.
        upstream: the upstream commit; between: measured ``len(base..upstream)``.
        retargeted: the Bridge commit or the base differ from the recipe's pins.
        declared_between: the recipe's ``commits_between`` (for the recipe's own pins).
    """

    bridge: str
    dev_commit: Optional[str]
    base: str
    upstream: str
    between: int
    retargeted: bool
    declared_between: int


def resolve(opts, recipe: Recipe, progress: Callable[[str], None] = lambda _m: None
            ) -> tuple[Source, Source, RunPins]:
    """Open the Bridge source at ``opts.bridge`` (default the recipe's pin), read its
    ``.dev.commit`` as the base (``opts.mcore_base`` overrides it), open Megatron-LM and check the
    pins.

    Returns:
        (megatron-lm source, megatron-bridge source, the pins used).

    Raises:
        SourceError: a source cannot be opened, or the Bridge commit has no ``.dev.commit``.
        PinError (exit 4): unknown SHA; base differs from ``.dev.commit`` without
            ``allow_pin_mismatch``; the base is not an ancestor of upstream; on the recipe's
            own pins, a measured distance other than the declared ``commits_between``.
        RecipeError (exit 5): ``--upstream`` is not the recipe's upstream commit.
        FeatureNative (exit 17): the base already contains the upstream commit.
    """
    pins = recipe.pins
    bridge_rev = opts.bridge or pins.megatron_bridge
    bridge = open_source("megatron-bridge", opts.megatron_bridge, opts.cache_dir, (bridge_rev,),
                         progress, opts.offline)
    bridge_sha = bridge.resolve(bridge_rev)
    try:
        dev_commit = bridge.read(bridge_sha, ".dev.commit").decode().strip()
        if not dev_commit:
            raise SourceError(f"megatron-bridge: .dev.commit is empty at {bridge_sha[:12]}")
    except (SourceError, UnicodeDecodeError) as exc:
        if opts.mcore_base and opts.allow_pin_mismatch:
            dev_commit = None  # no pin to compare with: the base given is the one used
        else:
            raise SourceError(f"Megatron-Bridge {bridge_sha[:12]} has no readable .dev.commit (the MCore base pin).",
                              hint="Pick a Bridge commit that pins MCore in .dev.commit (`git log -- .dev.commit`), "
                                   "or pass --mcore-base SHA --allow-pin-mismatch.") from exc
    base_rev = opts.mcore_base or (dev_commit if opts.bridge else pins.mcore_base)
    upstream_rev = opts.upstream or pins.upstream
    needed = (upstream_rev, base_rev) + tuple(s.commit for s in recipe.steps if isinstance(s, Transplant))
    mlm = open_source("megatron-lm", opts.megatron_lm, opts.cache_dir, needed, progress, opts.offline)
    upstream_sha = mlm.resolve(upstream_rev)
    if upstream_sha != pins.upstream:
        raise RecipeError(
            f"--upstream {upstream_rev} is {upstream_sha}, but recipe {opts.recipe} is written for {pins.upstream}.",
            hint="Use the recipe's upstream commit, or write a recipe for the new commit.")
    base_sha = mlm.resolve(base_rev)
    if dev_commit != base_sha and not opts.allow_pin_mismatch:
        where = "--mcore-base" if opts.mcore_base else "MCore base pin"
        raise PinError(
            f"{where} {base_sha} differs from Megatron-Bridge {bridge_sha[:12]}'s .dev.commit ({dev_commit}).",
            hint="Pin the base to the Bridge's .dev.commit (--bridge SHA reads it), or pass --allow-pin-mismatch "
                 "to override.")
    if is_ancestor(mlm, upstream_sha, base_sha):  # also base == upstream
        fixes = native_fixes(recipe, lambda path: _read_text(mlm, base_sha, path))
        raise FeatureNative(native_message(base_sha, upstream_sha, fixes), base=base_sha, upstream=upstream_sha,
                            fixes=fixes)
    between = mlm.count_between(base_sha, upstream_sha)
    retargeted = bridge_sha != pins.megatron_bridge or base_sha != pins.mcore_base
    if not retargeted and between != pins.commits_between:
        raise PinError(f"{between} commits lie between base and upstream; the recipe expects {pins.commits_between}.",
                       hint="The mirror's history differs from the recipe's; check the pins.")
    return mlm, bridge, RunPins(bridge=bridge_sha, dev_commit=dev_commit, base=base_sha, upstream=upstream_sha,
                                between=between, retargeted=retargeted, declared_between=pins.commits_between)


def is_ancestor(source: Source, ancestor: str, descendant: str) -> bool:
    """``git merge-base --is-ancestor ancestor descendant`` in ``source``.

    Raises:
        CacheDamaged: git could not answer (any failure but exit 1 with nothing on stderr).
    """
    import git

    from .sources import git_words

    try:
        source.repo.git.merge_base("--is-ancestor", ancestor, descendant)
    except git.GitCommandError as exc:
        if exc.status != 1 or git_words(exc):
            raise source.damaged(exc, f"merge-base --is-ancestor {ancestor[:12]} {descendant[:12]}") from exc
        return False
    return True


def _read_text(source: Source, sha: str, path: str) -> Optional[str]:
    try:
        return source.read(sha, path).decode("utf-8")
    except (SourceError, UnicodeDecodeError):
        return None


# --- the feature is native: what of ours still matters -------------------------------------

GDN = "megatron/core/ssm/gated_delta_net.py"
CONFIG = "megatron/core/transformer/transformer_config.py"

#: Our fail-fast checks (decision 6) and the words a base's raise/assert must hold to count as
#: the same check (symbols only: the tool reads messages and names, not behaviour).
FAIL_FAST = (
    ("chunkwise with deterministic mode", ("deterministic",)),
    ("chunkwise with an inference context", ("inference",)),
    ("sequence length divisible by 2*CP", ("divisible",)),
    ("local_cp_size == cp_group.size()", ("local_cp_size",)),
    ("SBHD input with batch > 1 under CP", ("batch",)),
)


def _probe_empty_segments(read) -> tuple[str, str]:
    text = read(GDN)
    if text is None or "cu_seqlens" not in text:
        return "not applicable", f"{GDN} passes no cu_seqlens to FLA at the base"
    if "packed_cu_seqlens" in text or "packed_seq_metadata" in text or re.search(r"unique_consecutive|seqlens\w*\s*>\s*0|!= *0\]", text):
        return "already present", f"{GDN} filters zero-length segments of cu_seqlens"
    return "needed", (f"{GDN} hands cu_seqlens to FLA without dropping zero-length segments (no filter found); "
                      "FLA 0.4.2 misnumbers every chunk after an empty segment (check the base's FLA pin)")


def _raise_texts(text: str) -> list[str]:
    """Source of every ``raise`` and ``assert`` statement of ``text`` (lower case)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    return [(ast.get_source_segment(text, n) or "").lower() for n in ast.walk(tree) if isinstance(n, (ast.Raise, ast.Assert))]


def _probe_fail_fast(read) -> tuple[str, str]:
    text = read(GDN)
    if text is None:
        return "not applicable", f"{GDN} is absent at the base"
    raises = _raise_texts(text)
    missing = [what for what, words in FAIL_FAST if not any(all(w in r for w in words) for r in raises)]
    if not missing:
        return "already present", f"every check has a raise/assert naming it in {GDN}"
    found = len(FAIL_FAST) - len(missing)
    return "needed", f"{found} of {len(FAIL_FAST)} checks found in {GDN}; missing: {', '.join(missing)}"


def _probe_all_gather(read) -> tuple[str, str]:
    texts = {p: read(p) or "" for p in (GDN, CONFIG)}
    if not any("linear_cp_mode" in t for t in texts.values()):
        return "not applicable", "the base has no linear_cp_mode"
    for path, t in texts.items():
        for line in t.splitlines():
            if "all_gather" in line and ("linear_cp_mode" in line or "headwise" in line):
                return "already present", f"{path}: {line.strip()[:100]}"
    return "needed", f"linear_cp_mode at the base has no all_gather value ({CONFIG}, {GDN}); decision 4 wants it"


#: Our fixes beyond upstream: (id, what, probe of the base's files).
BEYOND_UPSTREAM = (
    ("empty-cu-seqlens-segments", "our fix: empty segments in cu_seqlens dropped before FLA", _probe_empty_segments),
    ("fail-fast-checks", "our fix: fail-fast checks before any collective (decision 6)", _probe_fail_fast),
    ("all-gather-mode", "our fix: the all_gather mode (decision 4)", _probe_all_gather),
)


def native_fixes(recipe: Recipe, read: Callable[[str], Optional[str]]) -> list[dict]:
    """What of ours still matters at a base that has the feature: the recipe's ``fix`` steps
    (preserved downstream fixes, decision 7), each run on the base's file, then our fixes beyond
    upstream (:data:`BEYOND_UPSTREAM`), each probed by symbols.

    Args:
        read: tree path -> the base's file text, or None when absent.

    Returns:
        rows ``{"id", "what", "status", "evidence"}``, status ``needed`` (the fix would change
        the base), ``already present`` or ``not applicable`` (its anchor is absent).
    """
    from .transforms import REGISTRY

    rows = []
    for step in recipe.steps:
        if not (isinstance(step, Transform) and step.kind == "fix"):
            continue
        what = f"preserved downstream fix: {step.why.split(':', 1)[-1].strip()}" if ":" in step.why else step.why
        text = read(step.path)
        fn = REGISTRY.get(step.transform)
        if text is None or fn is None:
            rows.append({"id": step.id, "what": what, "status": "not applicable",
                         "evidence": f"{step.path} is absent at the base" if text is None
                         else f"unknown transform {step.transform}"})
            continue
        renamed = ""
        try:
            result = fn(text, step.path)
        except PipelineError as exc:
            # the anchor renamed (one close name in the file): try the fix on it under the old name
            anchor = _ANCHOR.search(exc.message)
            name = anchor and (anchor.group(1) or anchor.group(2))
            close = _close_names(name, text) if name else []
            try:
                if len(close) != 1:
                    raise exc
                result = fn(re.sub(rf"\b{re.escape(close[0])}\b", name, text), step.path)
                renamed = f" on {close[0]} (the base's name of {name})"
                text = re.sub(rf"\b{re.escape(close[0])}\b", name, text)
            except PipelineError:
                rows.append({"id": step.id, "what": what, "status": "not applicable",
                             "evidence": _with_close_names(exc.message, text)})
                continue
        if result.status == "already-present" or result.text == text:
            rows.append({"id": step.id, "what": what, "status": "already present",
                         "evidence": f"transform {step.transform} finds it in {step.path}{renamed}"})
        else:
            rows.append({"id": step.id, "what": what, "status": "needed",
                         "evidence": f"transform {step.transform} changes {step.path}{renamed} at the base"})
    for fid, what, probe in BEYOND_UPSTREAM:
        status, evidence = probe(read)
        rows.append({"id": fid, "what": what, "status": status, "evidence": evidence})
    return rows


_ANCHOR = re.compile(r"anchor (?:function|class) '(\w+)'|'(\w+)' not found")


def _defined_names(text: str) -> list[str]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    return sorted({n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))})


def _close_names(name: str, text: str) -> list[str]:
    """Names defined in ``text`` close to ``name`` (other than it): candidates for a rename."""
    names = _defined_names(text)
    if name in names:
        return []
    return [n for n in difflib.get_close_matches(name, names, n=3, cutoff=0.75) if n != name]


def _with_close_names(message: str, text: str) -> str:
    """``message`` plus the file's names closest to a missing anchor it names (a rename?)."""
    m = _ANCHOR.search(message)
    if not m:
        return message
    close = _close_names(m.group(1) or m.group(2), text)
    return message + (f" (the file defines {', '.join(close)}: renamed?)" if close else "")


def native_message(base: str, upstream: str, fixes: list[dict]) -> str:
    """The one-line message of :class:`FeatureNative`: the verdict, then each fix's status."""
    return (f"MCore base {base[:12]} contains {upstream[:12]}: chunkwise CP is native; nothing to backport. "
            "Ours at that base, as far as its symbols tell: "
            + "; ".join(f"{r['id']}: {r['status']} ({r['evidence']})" for r in fixes) + ".")


# --- per-step report -----------------------------------------------------------------------

def already_upstream(lines: list[str], hunk_lines_) -> Optional[int]:
    """1-based line where the hunk's result (context + added lines) already sits in ``lines``
    while its source (context + removed lines) does not; None otherwise.

    Args:
        lines: the file as :func:`backport.workspace.split_lines` gives it.
        hunk_lines_: :class:`backport.workspace.HunkLines` of the upstream hunk.
    """
    source, target = list(hunk_lines_.source), list(hunk_lines_.target)
    if not target or source == target:
        return None
    n, m = len(source), len(target)
    if any(lines[i:i + n] == source for i in range(len(lines) - n + 1)):
        return None
    return next((i + 1 for i in range(len(lines) - m + 1) if lines[i:i + m] == target), None)


def annotate_failure(exc: PipelineError, step, base_tree: Optional[Path]) -> PipelineError:
    """Name the step and its file in ``exc`` (sets ``exc.step`` / ``exc.path``) and, when the
    message names a missing anchor symbol that another file of the base tree defines, say where
    it went. Returns ``exc`` (changed in place)."""
    path = getattr(step, "path", None)
    exc.step, exc.path = step.id, path
    if path and exc.message.startswith(f"{path}: "):  # the step's file is named once, in the prefix
        exc.message = f"recipe step {step.id} ({path}): {exc.message[len(path) + 2:]}"
    elif not exc.message.startswith(("step ", "recipe step ", "carried hunk ", "carried patch ", "upstream hunk ")):
        exc.message = f"recipe step {step.id} ({path or step.kind}): {exc.message}"
    m = _ANCHOR.search(exc.message)
    if m and base_tree is not None and isinstance(exc, ApplyError):
        moved = find_symbol(base_tree, m.group(1) or m.group(2), exclude=path)
        if moved:
            exc.message += f" {m.group(1) or m.group(2)} is defined in {', '.join(moved)} at this base (moved?)."
    exc.args = (f"{exc.message}\nhint: {exc.hint}",)
    return exc


def find_symbol(tree: Path, name: str, exclude: Optional[str] = None, limit: int = 3) -> list[str]:
    """Tree paths (under ``megatron/``) whose text defines ``def name`` or ``class name``."""
    pattern = re.compile(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b", re.M)
    found = []
    for p in sorted((tree / "megatron").rglob("*.py")):
        rel = p.relative_to(tree).as_posix()
        if rel == exclude or p.is_symlink():
            continue
        try:
            if pattern.search(p.read_text(encoding="utf-8", errors="replace")):
                found.append(rel)
        except OSError:
            continue
        if len(found) >= limit:
            break
    return found


def verbatim_at_base(hunks: dict, ids: list[str], base_text: Callable[[str], Optional[str]]) -> dict[str, int]:
    """Upstream hunk id -> offset, for each of ``ids`` that would apply verbatim (zero fuzz, in
    its symbol) to the pristine base file on its own: an adapted hunk the base no longer needs
    adapting (the recipe still adapts it; the report says so)."""
    from .workspace import FileState

    out = {}
    for hid in ids:
        uh = hunks.get(hid)
        text = base_text(uh.path) if uh is not None else None
        if text is None:
            continue
        try:
            out[hid] = FileState.from_base(uh.path, text).apply_hunk(uh.hunk, hid)
        except PipelineError:
            continue
    return out


def step_report(recipe: Recipe, origins: dict, dispositions: dict, upstream_ids: list[str],
                already: dict[str, str], verbatim: Optional[dict] = None) -> dict:
    """Per recipe step and per upstream hunk, what happened on this base.

    Args:
        origins: the run's origins (``_Run.origins``); dispositions: ``check_coverage``'s.
        already: upstream hunk id / step id -> evidence of "already upstream" / "already
            present at the base".
        verbatim: adapted hunk id -> offset at which it would apply verbatim at this base
            (:func:`verbatim_at_base`).

    Returns:
        ``{"steps": [{"id", "kind", "status", "detail"}], "upstream_hunks": [{"id", "status", "detail"}]}``;
        step status ``verbatim``, ``adapted``, ``applied``, ``already present at the base``,
        ``already upstream``; hunk status ``verbatim``, ``adapted``, ``already upstream``,
        ``already present at the base``, ``excluded``.
    """
    steps = []
    hunk_status: dict[str, tuple[str, str]] = {}
    for step in recipe.steps:
        if isinstance(step, (UpstreamFile, UpstreamHunks)):
            parts, statuses = [], set()
            for hid in step.hunks:
                if hid in already:
                    hunk_status[hid] = ("already upstream", already[hid])
                    statuses.add("already upstream")
                    parts.append(f"{hid} already upstream ({already[hid]})")
                    continue
                off = origins.get(hid, {}).get("offset", 0)
                hunk_status[hid] = ("verbatim", f"offset {off:+d}" if off else "offset 0")
                statuses.add("verbatim")
                parts.append(f"{hid} offset {off:+d}" if off else f"{hid} in place")
            status = statuses.pop() if len(statuses) == 1 else "verbatim, some already upstream"
            steps.append({"id": step.id, "kind": step.kind, "status": status, "detail": "; ".join(parts)})
            continue
        o = origins.get(step.id, {})
        if step.id in already:
            status, detail = "already present at the base", already[step.id]
        elif o.get("status") == "already-present":
            status, detail = "already present at the base", f"{getattr(step, 'transform', step.kind)} found it in {step.path}"
        elif isinstance(step, Transplant):
            status, detail = "applied", f"{', '.join(step.symbols)} from {step.commit[:12]} into {step.path}"
        elif isinstance(step, AddFile):
            status, detail = "applied", f"adds {step.path}"
        else:
            status, detail = ("applied" if step.kind == "fix" else "adapted"), f"{step.transform} on {step.path}"
        steps.append({"id": step.id, "kind": step.kind, "status": status, "detail": detail})
        for hid in getattr(step, "adapts", []) or []:
            note = f"by {step.id}"
            if hid in (verbatim or {}):
                note += f"; the upstream hunk itself applies verbatim at this base (offset {verbatim[hid]:+d})"
            hunk_status[hid] = (("already present at the base" if status.startswith("already") else "adapted"), note)
    hunks = []
    for hid in upstream_ids:
        disp, by = dispositions[hid]
        status, detail = hunk_status.get(hid, (disp, f"by {by}"))
        hunks.append({"id": hid, "status": status, "detail": detail})
    return {"steps": steps, "upstream_hunks": hunks}


def report_counts(report: dict) -> dict:
    """``status -> count`` over the report's upstream hunks (sorted)."""
    counts: dict = {}
    for h in report["upstream_hunks"]:
        counts[h["status"]] = counts.get(h["status"], 0) + 1
    return dict(sorted(counts.items()))
