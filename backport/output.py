"""Write a :class:`~backport.engine.Build` to disk all at once, or compare it (``--check``).

Layout (relative to the output root, normally the repository root):
``patches/megatron/<date>-<base9>.patch`` (+ ``.manifest.json``/``.manifest.md``),
``patches/latest/megatron.patch`` (same bytes) + ``manifest.json``/``manifest.md``,
``manifests/lock.json`` (committed digests), and the trees ``build/tree/base`` and
``build/tree/patched``.

All of them switch in together, through a journal under ``build/.gdn/txn/`` (ignored by git,
same file system as the outputs):

1. **stage**: every output is written under ``txn/new/`` (trees built there too);
2. **journal**: ``txn/journal.json`` names the targets, which of them existed, and the sha256
   of the new lock (written to a temp file, fsynced, renamed);
3. **switch**: per target, the old file/tree is renamed to ``txn/old/`` and the new one into
   place (``os.rename``, same file system);
4. **commit**: the new ``manifests/lock.json`` replaces the old one (one ``os.replace``); when
   the lock on disk is the new one, every file it names is already in place;
5. **clean**: ``txn/`` is removed.

:func:`recover` (run first by every write, and by the CLI under the output lock) finishes
what a killed run left: without a journal it removes the staging folder; with one, it rolls
**forward** when the lock on disk is the journal's new lock, else **back** (old files moved
back, new ones removed). Both are idempotent, so a kill during recovery is recovered too.
After recovery the disk holds exactly the old set or exactly the new set.

Where outputs may go (docs/outputs.md, "Outputs stay inside --out"): no output path and no
folder on the way to one below the output root may be a symbolic link (:func:`refuse_links`,
:class:`~backport.errors.OutputLinkError`, exit 16: neither written through nor replaced), and
the output root may not lie inside the trees of another output root (:func:`refuse_nested_out`).
Files in ``build/tree/*`` that the tool did not write are named in one warning line before the
trees are replaced (:func:`foreign_tree_files`).

A lock states that every check ran: a build that skipped one (``--no-import-check``; the manifest
names it, :func:`skipped_checks`) writes its other outputs but never creates, rewrites or
re-dates ``manifests/lock.json``; its switch has no lock to commit on and always rolls forward.
``--check`` of such a build compares what it can and names what it did not check
(:func:`check`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path, PurePosixPath
from typing import Callable, Iterable, Optional

from . import interrupts
from .errors import CheckMismatch, OutputLinkError, PipelineError, UsageError, WriteError, oserror_hint
from .manifest_md import render_markdown
from .tree import copy_tree
from .tree_digest import check_against_lock as check_tree_against_lock
from .tree_digest import describe as describe_tree
from .tree_digest import lock_fields as tree_lock_fields
from .verify import apply_patch

#: Tool state under the output root (git ignores build/): the output lock and the journal.
LOCK = "manifests/lock.json"
STATE = "build/.gdn"
OUTPUT_LOCK = STATE + "/output.lock"
TXN = STATE + "/txn"
TREES = ("build/tree/base", "build/tree/patched")
#: Every output path whose name does not depend on the build (the dated patch and manifests under
#: ``patches/megatron/`` do), and the tool's state: what :func:`preflight` checks for links.
FIXED_PATHS = ("patches/megatron", "patches/latest/megatron.patch", "patches/latest/manifest.json",
               "patches/latest/manifest.md", LOCK, *TREES, OUTPUT_LOCK, OUTPUT_LOCK + ".owner",
               TXN + "/journal.json", TXN + "/journal.json.tmp", TXN + "/new", TXN + "/old")
#: The output paths among those that are folders (the rest are files), for messages.
FOLDERS = ("patches/megatron", *TREES, STATE, TXN, TXN + "/new", TXN + "/old")
#: Folders of an output root that a run writes or replaces: no ``--out`` may lie inside them.
OUTPUT_TREES = ("patches", "build/tree", STATE)
#: How many of the files a tree replacement deletes the warning names.
NAMED = 5

#: ``on_step(name)`` is called after each write step: the fault-injection tests kill the
#: process there (tests/unit/test_output_atomic.py).
StepHook = Optional[Callable[[str], None]]


def canonical_json(data) -> bytes:
    """The one JSON writer: sorted keys, indent 2, trailing newline, UTF-8."""
    return (json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def skipped_checks(manifest: dict) -> list[tuple[str, str]]:
    """``(check, flag)`` for every verification check a run skipped (``("imports",
    "--no-import-check")``); empty when every check ran. Manifests written before the
    ``skipped_by`` field say it in their detail (``skipped by --no-import-check``)."""
    found = []
    checks = manifest.get("verification") if isinstance(manifest, dict) else None
    for c in checks if isinstance(checks, list) else []:
        if not isinstance(c, dict):
            continue
        flag = c.get("skipped_by")
        detail = str(c.get("detail", ""))
        if not flag and not c.get("ok") and detail.startswith("skipped by "):
            flag = detail[len("skipped by "):]
        if flag:
            found.append((str(c.get("check")), str(flag)))
    return found


def describe_skipped(skipped: list[tuple[str, str]]) -> str:
    """``the import check (--no-import-check)``, for messages; several joined with ``and``."""
    return " and ".join(("the import check" if name == "imports" else f"the {name} check") + f" ({flag})"
                        for name, flag in skipped)


def lock_data(build) -> dict:
    """The committed lock: pins, recipe digest, patch and manifest sha256, tree digests.

    ``base_tree_sha256`` / ``patched_tree_sha256`` / ``tree_files``: see ``backport.tree_digest``.
    """
    m = build.manifest
    trees = build.__dict__.get("_tree_lock_fields")  # a tree copy and two digests: computed once per build
    if trees is None:
        trees = build.__dict__["_tree_lock_fields"] = tree_lock_fields(build.base_tree, build.patch)
    return {
        "schema": 1,
        "pins": m["pins"],
        "recipe": m["recipe"],
        "patch": {"name": m["patch"]["name"], "sha256": m["patch"]["sha256"]},
        "manifest_sha256": hashlib.sha256(canonical_json(m)).hexdigest(),
        "date": m["date"],
        **trees,
    }


def rendered(build) -> dict[str, bytes]:
    """Every output file (path relative to the output root -> bytes), sorted."""
    name = build.manifest["patch"]["name"]
    stem = name[: -len(".patch")]
    manifest_json = canonical_json(build.manifest)
    manifest_md = render_markdown(build.manifest).encode("utf-8")
    files = {
        f"patches/megatron/{name}": build.patch,
        f"patches/megatron/{stem}.manifest.json": manifest_json,
        f"patches/megatron/{stem}.manifest.md": manifest_md,
        "patches/latest/megatron.patch": build.patch,
        "patches/latest/manifest.json": manifest_json,
        "patches/latest/manifest.md": manifest_md,
        "manifests/lock.json": canonical_json(lock_data(build)),
    }
    return dict(sorted(files.items()))


def refuse_links(root: Path, rels: Iterable[str]) -> None:
    """Refuse when any of ``rels`` (paths relative to the output root), or any folder on the way
    to one below ``root``, is a symbolic link. ``root`` itself may be one (it is the user's
    ``--out``); what lies above it is not looked at.

    Raises:
        OutputLinkError: naming the first link (in the order of ``rels``) and its target.
    """
    seen = set()
    for rel in rels:
        parts = PurePosixPath(rel).parts
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if sub in seen:
                continue
            seen.add(sub)
            path = root / sub
            if path.is_symlink():
                target = os.readlink(path)
                kind = "folder" if i < len(parts) or sub in FOLDERS else "file"
                dangling = "" if path.exists() else " (a dangling link)"
                raise OutputLinkError(
                    f"{sub} in the output folder {root} is a symbolic link to {target}{dangling}: the run never "
                    f"writes its outputs through a link (that would replace files outside --out) nor replaces "
                    f"a link with its own {kind}",
                    link=str(path), target=target,
                    hint=f"Remove the link (`rm {path}`; {target} stays as it is) and run the same command again, "
                         f"so the run makes a real {kind} there; to write the outputs elsewhere, pass --out "
                         f"<folder> instead of linking.")
            if not path.exists():
                break  # nothing below a missing folder exists either


def preflight(root: Path) -> None:
    """Refuse before any work when an output path of ``root`` is a link (:data:`FIXED_PATHS`).

    :func:`write`, :func:`recover` and :func:`check` check again, with the dated names.

    Raises:
        OutputLinkError: see :func:`refuse_links`.
    """
    refuse_links(root, FIXED_PATHS)


def refuse_nested_out(out: Path, default_root: Path) -> None:
    """Refuse an output root inside an output tree (:data:`OUTPUT_TREES`) of another output root.

    An output root is ``default_root`` (where a run without ``--out`` writes) or any folder
    holding ``manifests/lock.json`` or ``build/.gdn/``. A run there would replace or delete the
    nested output set (a plain run replaces ``build/tree/*`` whole). Links in ``out`` are
    followed, so a link into such a tree is refused too.

    Raises:
        UsageError: naming ``out``, the output tree it lies in and that tree's output root.
    """
    target = out.resolve()
    default = default_root.resolve()
    for anc in target.parents:
        rel = target.relative_to(anc).parts
        tree = next((t for t in OUTPUT_TREES if rel[: len(PurePosixPath(t).parts)] == PurePosixPath(t).parts), None)
        if tree is None:
            continue
        if anc == default or (anc / LOCK).is_file() or (anc / STATE).is_dir():
            which = " (where a run without --out writes)" if anc == default else ""
            raise UsageError(
                f"--out {out} lies inside {anc / tree}, a folder the outputs of the output folder {anc}{which} are "
                f"written to: a run there would replace or delete this output set",
                hint=f"Pass --out a folder of its own, outside {anc}'s patches/, build/tree/ and build/.gdn/ "
                     f"(e.g. --out {anc / 'build' / 'out'} or a folder elsewhere), then run the same command again.")


def refuse_out_in_cache(out: Path, cache: Path) -> None:
    """Refuse an output root that is the tool's cache or lies inside it (or holds it): the run
    would write its outputs and lock into cache entries it reads (a cached base tree), which then
    fail their digest and are rebuilt, deleting what was written there.

    Raises:
        UsageError: naming ``out`` and the cache.
    """
    target, cache_r = out.resolve(), cache.resolve()
    for tree in OUTPUT_TREES:
        folder = target / tree
        if cache_r == folder or folder in cache_r.parents:
            raise UsageError(
                f"--cache-dir {cache} lies inside {folder}, a folder of the output folder {out} that every run "
                "replaces or deletes (a plain run replaces build/tree/base and build/tree/patched whole): the cache "
                "would be deleted by the run that uses it",
                hint="Pass --cache-dir a folder outside --out's patches/, build/tree/ and build/.gdn/ (the default "
                     "~/.cache/gdn-backport, or e.g. --cache-dir " + str(target / "build" / "cache") + "), then run "
                     "the same command again.")
    if target == cache_r or cache_r in target.parents:
        raise UsageError(
            f"--out {out} lies inside the tool's cache {cache_r}; a run there would write into cache entries "
            "it reads (a cached base tree is checked against its digest and rebuilt)",
            hint="Pass --out a folder outside the cache ($GDN_BACKPORT_CACHE or --cache-dir, default "
                 "~/.cache/gdn-backport), then run the same command again.")


def _entries(top: Path) -> set:
    """Relative paths of the files and symlinks under ``top`` (links not followed), without
    the caches :mod:`backport.tree_digest` ignores too (``__pycache__``, ``*.pyc``...)."""
    from .tree_digest import _ignored

    found = set()
    if not top.is_dir() or top.is_symlink():
        return found
    for dirpath, dirnames, filenames in os.walk(top):
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        dirnames[:] = [d for d in dirnames if not _ignored(d) and d not in links]
        for name in filenames + links:
            if not _ignored(name):
                found.add(Path(dirpath, name).relative_to(top).as_posix())
    return found


def _lock_tree_ids(lock: dict, which: str) -> set:
    """The paths a lock's ``tree_files`` lists for the ``which`` (base | patched) tree; empty
    when the lock has none or is malformed."""
    from .tree_digest import patched_ids

    try:
        trees = lock["tree_files"]
        return set(trees["base"] if which == "base" else patched_ids(trees))
    except (KeyError, TypeError, AttributeError, ValueError):
        return set()


def foreign_tree_files(root: Path, known: dict) -> list[str]:
    """Files in ``root/build/tree/*`` that replacing the trees deletes and the tool did not write.

    Args:
        root: output root.
        known: tree (``build/tree/base``) -> the set of paths (relative to the tree, e.g.
            ``megatron/core/x.py``) the tool wrote or writes there.

    Returns:
        sorted paths relative to ``root`` (``build/tree/base/notes.txt``).
    """
    found = []
    for rel, paths in known.items():
        found += [f"{rel}/{p}" for p in sorted(_entries(root / rel) - paths)]
    return sorted(found)


def _warn_foreign(found: list, root: Path, what: str, warn: Callable[[str], None]) -> None:
    if found:
        shown = ", ".join(found[:NAMED]) + (f" and {len(found) - NAMED} more" if len(found) > NAMED else "")
        warn(f"warning: {what} deletes {len(found)} file{'s' if len(found) > 1 else ''} in {root} that the tool did "
             f"not write: {shown}; keep your own files outside build/tree/ (it holds generated trees only)")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif _exists(path):
        path.unlink()


def _sha256_file(path: Path) -> "str | None":
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def _redo(root: Path, txn: Path, rel: str, step) -> None:
    """Put ``txn/new/rel`` in place, moving an existing target to ``txn/old/rel`` first."""
    target, old, new = root / rel, txn / "old" / rel, txn / "new" / rel
    if not _exists(new):
        return  # already placed
    if _exists(target):
        old.parent.mkdir(parents=True, exist_ok=True)
        os.rename(target, old)
        step(f"move old {rel} aside")
    target.parent.mkdir(parents=True, exist_ok=True)
    os.rename(new, target)
    step(f"put new {rel} in place")


def _undo(root: Path, txn: Path, rel: str, existed: bool, step) -> None:
    """Undo :func:`_redo` for ``rel``: remove a placed new target, move the old one back."""
    target, old, new = root / rel, txn / "old" / rel, txn / "new" / rel
    if _exists(new):
        placed = False
    else:
        placed = _exists(target) and (not existed or _exists(old))
    if placed:
        _remove(target)
        step(f"remove new {rel}")
    if existed and _exists(old):
        os.rename(old, target)
        step(f"move old {rel} back")


def _rollback(root: Path, txn: Path, journal: dict, step) -> None:
    for rel in reversed(journal["targets"]):
        _undo(root, txn, rel, journal["existed"][rel], step)


def recover(root: Path, on_step: StepHook = None) -> "str | None":
    """Finish what a killed write left under ``root``; return what was done (None: nothing).

    Call it holding the output lock. Also removes the leftovers of older versions of this
    tool (``.gdn-stage-*`` folders in ``root``, ``build/tree/*.old``).

    Raises:
        OSError: the file system refuses a step (the journal stays; the next run retries).
        OutputLinkError: the state folder, or a target the journal names, is a symbolic link
            (nothing done; the journal stays).
    """
    with interrupts.shielded():  # a signal waits for the end: the disk is then the old set or the new one
        return _recover(root, on_step)


def _recover(root: Path, on_step: StepHook) -> "str | None":
    step = on_step or (lambda _name: None)
    done = []
    refuse_links(root, (TXN + "/journal.json", TXN + "/new", TXN + "/old"))
    for leftover in sorted(root.glob(".gdn-stage-*")) + [root / (t + ".old") for t in TREES]:
        if leftover.is_dir() and not leftover.is_symlink():  # a link there is the user's, not a leftover
            shutil.rmtree(leftover)
            done.append(f"removed {leftover.relative_to(root)}")
    txn = root / TXN
    if not _exists(txn):
        return "; ".join(done) or None
    journal_path = txn / "journal.json"
    try:
        journal = json.loads(journal_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        journal = None  # killed while staging: the old outputs were never touched
    if journal is None:
        shutil.rmtree(txn)
        step("remove unfinished staging")
        done.append(f"removed the unfinished staging folder {TXN} of a killed run")
        return "; ".join(done)
    problem = _journal_problem(journal)
    if problem:
        raise WriteError(f"the journal {journal_path} of a killed run is not one this tool writes ({problem}); "
                         f"nothing was moved", hint=f"Move {txn} out of the way (its old/ holds the outputs before "
                         "that run, new/ the staged ones), then run `tools/backport` (without --check): it writes "
                         "every output again.")
    refuse_links(root, list(journal["targets"]) + [LOCK])
    if journal["lock_sha256"] is None or _sha256_file(root / LOCK) == journal["lock_sha256"]:
        for rel in journal["targets"]:
            _redo(root, txn, rel, step)
        done.append(f"completed the switch of a killed run (its {LOCK} was already in place)"
                    if journal["lock_sha256"] else
                    f"completed the switch of a killed run (it skipped a check, so it left {LOCK} alone)")
    else:
        _rollback(root, txn, journal, step)
        done.append(f"rolled back the switch of a killed run (its {LOCK} was not yet in place)")
    shutil.rmtree(txn)
    step("remove journal")
    return "; ".join(done)


def _journal_problem(journal) -> "str | None":
    """What makes ``journal`` one this tool never writes (a shape it lacks, a target outside the
    output set, ``..`` included), or None. A journal is written whole (temp file, rename), so
    this is damage from elsewhere; recovering from it could move or delete files outside --out."""
    if not isinstance(journal, dict):
        return "not a JSON object"
    targets, existed, lock = journal.get("targets"), journal.get("existed"), journal.get("lock_sha256")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        return "no list of targets"
    if not isinstance(existed, dict) or any(not isinstance(existed.get(t), bool) for t in targets):
        return "no existed flag for every target"
    if lock is not None and not (isinstance(lock, str) and len(lock) == 64):
        return "lock_sha256 is not a sha256"
    for target in targets:
        parts = PurePosixPath(target).parts
        if (PurePosixPath(target).is_absolute() or ".." in parts or
                not (target in TREES or (parts[:1] == ("patches",) and len(parts) >= 3))):
            return f"target {target!r} is not an output path"
    return None


def write(build, root: Path, trees: bool = True, on_step: StepHook = None,
          warn: Callable[[str], None] = _stderr, on_commit: Optional[Callable[[], None]] = None) -> list[Path]:
    """Write all outputs under ``root`` all at once; return the written paths.

    Stages everything under ``root/build/.gdn/txn/new``, writes the journal, switches the
    files and trees in, and replaces ``manifests/lock.json`` last (the commit point). A build
    that skipped a check (:func:`skipped_checks`) leaves the lock as it is (or absent): its
    switch commits with the journal and a killed one is rolled forward. Call it holding the
    output lock (:data:`OUTPUT_LOCK`; the CLI does).

    Args:
        build: the verified build.
        root: output root.
        trees: also write ``build/tree/base`` and ``build/tree/patched``.
        on_step: called with a step name after each step that changes the disk (tests).
        warn: where the warning line about files in ``build/tree/*`` that the tool did not
            write goes (stderr by default); it comes before the switch.
        on_commit: called once the new outputs are complete and in place (the CLI's interrupt
            message then says so).

    Signals (:mod:`backport.interrupts`): one that arrives while staging removes the staging
    folder (nothing was switched in); from the journal to the removal of ``txn/`` (the switch,
    the commit point, the old outputs' removal) a signal is held and raised after it, so an
    interrupted run leaves exactly the old set or exactly the new set, and no ``txn/``.

    Raises:
        OutputLinkError: an output path, or a folder on the way to one, is a symbolic link
            (checked first, and again just before the switch; nothing switched).
        WriteError: a file system step failed (disk full, read-only folder...); the message
            names the step and path; the previous outputs are back in place.
        VerificationError: the patch does not apply to the staged tree (nothing switched).
    """
    step = on_step or (lambda _name: None)
    files = rendered(build)
    skipped = skipped_checks(build.manifest)
    every = list(files) + list(TREES) + list(FIXED_PATHS)
    if skipped:  # a lock states that every check ran: this build's is never written
        del files[LOCK]
    targets = [rel for rel in files if rel != LOCK] + (list(TREES) if trees else [])
    refuse_links(root, every)
    root.mkdir(parents=True, exist_ok=True)
    recover(root, step)
    txn = root / TXN
    new = txn / "new"
    doing = f"staging the outputs in {new}"
    try:
        new.mkdir(parents=True)
        step("create the staging folder")
        for rel, data in files.items():
            doing = f"staging {rel} in {new}"
            _write_file(new / rel, data)
            step(f"stage {rel}")
        if trees:
            doing = f"staging build/tree/base in {new}"
            copy_tree(build.base_tree, new / TREES[0])
            step(f"stage {TREES[0]}")
            doing = f"staging build/tree/patched in {new}"
            copy_tree(build.base_tree, new / TREES[1])
            apply_patch(new / TREES[1], build.patch, dry_run=False)
            step(f"stage {TREES[1]}")
            old_lock = _json_on_disk(root / LOCK)
            _warn_foreign(foreign_tree_files(root, {rel: _entries(new / rel) | _lock_tree_ids(old_lock, which)
                                                    for rel, which in zip(TREES, ("base", "patched"))}),
                          root, "replacing build/tree/base and build/tree/patched", warn)
        refuse_links(root, every)  # again: a link made while staging is not written through either
        journal = {"schema": 1, "targets": targets,
                   "existed": {rel: _exists(root / rel) for rel in targets},
                   # None: a build that skipped a check writes no lock; its switch rolls forward
                   "lock_sha256": hashlib.sha256(files[LOCK]).hexdigest() if LOCK in files else None}
        doing = f"writing the journal {txn / 'journal.json'}"
        _write_file(txn / "journal.json.tmp", canonical_json(journal))
        os.replace(txn / "journal.json.tmp", txn / "journal.json")
        _fsync_dir(txn)
        step("write the journal")
    except (OSError, shutil.Error, PipelineError) as exc:
        shutil.rmtree(txn, ignore_errors=True)
        if isinstance(exc, PipelineError):
            raise
        raise _write_error(exc, doing, "nothing was switched in; the previous outputs are untouched") from exc
    except KeyboardInterrupt:  # cut while staging: nothing was switched in; the staging goes, whole
        with interrupts.shielded():
            shutil.rmtree(txn, ignore_errors=True)
        raise
    with interrupts.shielded():  # renames only, then the old outputs' removal: never cut half way
        _switch(root, txn, new, files, targets, journal, step)
        if on_commit is not None:
            on_commit()
        try:
            shutil.rmtree(txn)
            step("remove the journal")
        except OSError:
            pass  # committed; the next run removes what is left
    return [root / rel for rel in files] + ([root / t for t in TREES] if trees else [])


def _switch(root: Path, txn: Path, new: Path, files: dict, targets: list, journal: dict, step) -> None:
    """Switch the staged outputs in and commit (replace the lock); on a file system error roll
    back and raise :class:`WriteError` naming the step."""
    doing = "switching in the outputs"
    try:
        for rel in targets:
            doing = f"switching in {rel}"
            _redo(root, txn, rel, step)
        if LOCK in files:
            doing = f"replacing {LOCK}"
            (root / LOCK).parent.mkdir(parents=True, exist_ok=True)
            os.replace(new / LOCK, root / LOCK)
            _fsync_dir((root / LOCK).parent)
            step(f"commit {LOCK}")
    except OSError as exc:
        try:
            _rollback(root, txn, journal, lambda _name: None)
            shutil.rmtree(txn)
            state = "rolled back: the previous outputs are in place"
        except OSError as again:
            state = (f"the roll-back failed too ({again.strerror}: {again.filename}); the next run finishes "
                     f"it from the journal in {txn}")
        raise _write_error(exc, doing, state) from exc


def _write_error(exc: BaseException, doing: str, state: str) -> WriteError:
    if isinstance(exc, shutil.Error):
        from .errors import describe_unexpected

        message, hint = describe_unexpected(exc, doing)
        return WriteError(f"{message}; {state}.", hint=hint)
    return WriteError(f"{doing} failed: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
                      + f"; {state}.", hint=oserror_hint(exc))


#: Report word of a generated file that is not on disk while the lock pins its digest.
PINNED_BY_LOCK = "absent; covered by the patch and manifest sha256 in " + LOCK


def lock_date(root: Path, check: bool = True) -> "str | None":
    """The ``date`` (YYYY-MM-DD) of ``root/manifests/lock.json``, or None when there is no lock.

    ``--check`` without ``--date`` rebuilds with this date, and so does a plain run, so the
    committed outputs compare equal on any later day.

    Raises:
        CheckMismatch (``check``) or UsageError (a plain run): the lock exists but is not JSON
        with a date from 1970-01-01 on.
    """
    import datetime as dt

    from .errors import UsageError

    path = root / LOCK
    if not path.exists():
        return None
    if path.is_dir():
        problem = f"{path} is a folder, not the lock file"
        hint = f"Remove it (`rm -r {path}`), then restore the lock (`git checkout {LOCK}`) and run the same command again."
        raise CheckMismatch(problem, hint=hint) if check else UsageError(problem, hint=hint)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))["date"]
        day = dt.datetime.strptime(value, "%Y-%m-%d")
        if day.year < 1970:
            raise ValueError(f"date {value} is before 1970-01-01")
        return day.strftime("%Y-%m-%d")
    except (ValueError, KeyError, TypeError, OSError) as exc:
        problem = f"{path} is not a lock with a valid date ({exc.__class__.__name__}: {exc})"
        if check:
            raise CheckMismatch(problem, hint=f"Restore it with `git checkout {LOCK}`, then run --check again.") from exc
        raise UsageError(problem, hint=f"Restore it with `git checkout {LOCK}` and run the same command again, or "
                                       "make a new dated release over it with --release (or --date).") from exc


def lock_changes(old: "dict | None", new: dict) -> list[str]:
    """What differs between two locks, as short phrases (empty when identical).

    Used by the CLI after a write and by :func:`check` to say which fields of the lock differ.
    """
    if old is None:
        return ["new lock"]
    changes = []
    if old.get("date") != new["date"]:
        changes.append(f"date {old.get('date')} -> {new['date']}")
    if old.get("patch") != new["patch"]:
        o = old.get("patch") if isinstance(old.get("patch"), dict) else {}
        changes.append(f"patch {o.get('name')} ({str(o.get('sha256'))[:12]}) -> "
                       f"{new['patch']['name']} ({new['patch']['sha256'][:12]})")
    for key in sorted((set(old) | set(new)) - {"date", "patch"}):
        if old.get(key) != new.get(key):
            if isinstance(old.get(key), dict) and isinstance(new.get(key), dict):
                inner = sorted(k for k in set(old[key]) | set(new[key]) if old[key].get(k) != new[key].get(k))
                changes.append(f"{key} changed ({', '.join(inner)})")
            else:
                changes.append(f"{key} changed")
    return changes


def check(build, root: Path, warn: Callable[[str], None] = _stderr) -> dict[str, str]:
    """Compare fresh outputs with the files on disk.

    The lock must be on disk and equal. The generated files (patch, manifests) must all be
    equal, or all be absent, as in a fresh clone where only the lock is committed: the lock
    holds the patch's and the manifest's sha256, so comparing it compares them.

    Pins that differ from the lock's are named first, alone: every output
    differs with them, so nothing else is compared or warned about.

    A build that skipped a check (``--no-import-check``) compares what it can: the skipped
    check's result is taken from the manifest on disk as it is (one ``warn`` line says so), and
    when no manifest on disk holds it, the lock is compared but for its ``manifest_sha256``.

    Files in ``build/tree/*`` that neither the fresh lock nor the lock on disk lists (a plain
    run would delete them) are named in one warning line (``warn``); they are no mismatch.

    Returns:
        relative path -> ``"identical"``, :data:`PINNED_BY_LOCK` or what was left out, sorted by path.

    Raises:
        CheckMismatch: the pins differ from the lock's (naming each), or listing every path that
            is missing or differs.
        OutputLinkError: an output path, or a folder on the way to one, is a symbolic link.
    """
    refuse_links(root, list(rendered(build)) + list(TREES) + list(FIXED_PATHS))
    refuse_nothing_to_check(root)
    disk_lock = _json_on_disk(root / LOCK)
    refuse_other_pins(root, build.manifest["pins"], disk_lock)
    build, unchecked = _adopt_skipped(build, root, warn)
    files = rendered(build)
    generated = [rel for rel in files if rel != LOCK]
    lock_only = not any((root / rel).exists() for rel in generated)
    report, diffs = {}, []
    for rel, data in files.items():
        path = root / rel
        if not path.exists():
            if lock_only and rel != LOCK:
                report[rel] = PINNED_BY_LOCK
            else:
                diffs.append(f"{rel} (missing)")
        elif rel == LOCK and unchecked:
            verdict, problem = _lock_but_manifest(json.loads(data), disk_lock, root, unchecked)
            if problem:
                diffs.append(f"{rel} ({problem})")
            else:
                report[rel] = verdict
        elif path.read_bytes() != data:
            detail = "differs"
            if rel == LOCK:
                try:
                    on_disk = json.loads(path.read_text(encoding="utf-8"))
                except ValueError:
                    on_disk = None
                if isinstance(on_disk, dict):
                    detail = "differs: " + "; ".join(lock_changes(on_disk, json.loads(data)) or ["formatting"])
            diffs.append(f"{rel} ({detail})")
        else:
            report[rel] = "identical"
    # The trees, when on disk, must be the ones the fresh lock pins (a --no-trees run or an
    # edit after the run would otherwise leave trees that disagree with the patch unnoticed).
    fresh_lock = json.loads(files[LOCK])
    _warn_foreign(foreign_tree_files(root, {rel: _lock_tree_ids(fresh_lock, which) | _lock_tree_ids(disk_lock, which)
                                            for rel, which in zip(TREES, ("base", "patched"))
                                            if (root / rel).is_dir()}),
                  root, "a plain run replaces build/tree/base and build/tree/patched and so", warn)
    for rel, which in zip(TREES, ("base", "patched")):
        if not (root / rel / "megatron").is_dir() or f"{which}_tree_sha256" not in fresh_lock:
            continue
        result = check_tree_against_lock(root / rel, fresh_lock, which)
        if result["ok"]:
            report[rel] = "identical"
        else:
            diffs.append(f"{rel} ({describe_tree(result, which)})")
    if diffs:
        raise CheckMismatch("outputs on disk differ from a fresh run: " + ", ".join(diffs),
                            hint=_mismatch_hint(build, root))
    return report


def refuse_nothing_to_check(root: Path) -> None:
    """Refuse ``--check`` of a folder that holds no output at all (no lock, no patch, manifest or
    tree): the user named the wrong ``--out`` (or a clone lost its lock); the CLI calls it before
    the build, :func:`check` again.

    Raises:
        CheckMismatch: naming ``root``.
    """
    fixed = (LOCK, "patches/megatron", "patches/latest/megatron.patch", "patches/latest/manifest.json",
             "patches/latest/manifest.md", *TREES)
    if not any(_exists(root / rel) for rel in fixed):
        raise CheckMismatch(f"nothing to check in {root}: there is no {LOCK} and no output there",
                            hint=f"Pass --out the folder that holds the outputs, or write them first (`tools/backport "
                                 f"--out {root}`); in a clone of the repository, `git checkout {LOCK}`.")


#: The flag that sets each pin of the lock (the rest follow from them or from the recipe).
PIN_FLAGS = {"megatron_bridge": "--bridge", "mcore_base": "--mcore-base", "upstream": "--upstream"}


def refuse_other_pins(root: Path, new: dict, disk_lock: "dict | None" = None) -> None:
    """Raise :class:`CheckMismatch` naming each pin of ``new`` (a build's pins, full SHAs, or the
    pin flags the user gave, hex prefixes: the CLI calls it before the build) that differs from
    the lock's (Megatron-Bridge, MCore base, upstream), the lock's value first; nothing when the
    lock has no pins (absent or malformed: the comparison names that)."""
    disk_lock = _json_on_disk(root / LOCK) if disk_lock is None else disk_lock
    old = disk_lock.get("pins")
    if not isinstance(old, dict):
        return
    differ = [key for key in PIN_FLAGS if isinstance(old.get(key), str) and isinstance(new.get(key), str)
              and not old[key].startswith(new[key].strip().lower())]
    if not differ:
        return
    def why(key: str) -> str:
        if key == "mcore_base" and not new.get("pin_mismatch_allowed"):
            return "the .dev.commit of that Megatron-Bridge commit"
        return PIN_FLAGS[key]

    said = "; ".join(f"{key} {str(old[key])[:12]} in the lock, {str(new.get(key))[:12]} in this check ({why(key)})"
                     for key in differ)
    route = {"megatron_bridge": "drop --bridge (--check takes the lock's Megatron-Bridge pin)",
             "mcore_base": "drop --mcore-base (with --allow-pin-mismatch, --check takes the lock's base)",
             "upstream": f"pass --upstream {str(old.get('upstream'))[:12]} (the lock's)"}
    todo = "; ".join(route[key] for key in differ if why(key) == PIN_FLAGS[key]) or route["megatron_bridge"]
    raise CheckMismatch(
        f"the pins of this check differ from {root / LOCK}: {said}; every output differs with other pins, "
        "so nothing else was compared",
        hint=f"To check with the lock's pins: {todo}. To check other pins, write them to a --out of their own "
             "first (`tools/backport --bridge SHA --out DIR`) and pass that --out to --check.")


def _adopt_skipped(build, root: Path, warn: Callable[[str], None]):
    """``(build, unchecked)`` for ``--check``: each check the build skipped takes its result
    from the manifest on disk, when one there holds it (that run ran it), so that the manifests
    and the lock compare byte for byte; ``unchecked`` lists the skipped checks whose result no
    manifest on disk holds. One ``warn`` line says what was not checked."""
    import dataclasses

    skipped = skipped_checks(build.manifest)
    if not skipped:
        return build, []
    stem = build.manifest["patch"]["name"][: -len(".patch")]
    disk, source = {}, None
    for rel in (f"patches/megatron/{stem}.manifest.json", "patches/latest/manifest.json"):
        disk = _json_on_disk(root / rel)
        if disk:
            source = rel
            break
    skipped_there = {name for name, _flag in skipped_checks(disk)}
    results = {c["check"]: c for c in disk.get("verification") or [] if isinstance(c, dict) and "check" in c
               and c["check"] not in skipped_there and c.get("ok") is True} if isinstance(
                   disk.get("verification"), list) else {}
    names = {name for name, _flag in skipped}
    taken = [name for name in names if name in results]
    unchecked = [(name, flag) for name, flag in skipped if name not in results]
    what = describe_skipped(skipped)
    if not unchecked:
        manifest = dict(build.manifest)
        manifest["verification"] = [results[c["check"]] if c["check"] in names else c for c in manifest["verification"]]
        warn(f"check: not checked: {what}; its result was taken as written in {root / source} (the run that "
             "wrote it ran it); everything else is compared as usual")
        return dataclasses.replace(build, manifest=manifest), []
    where = (f"{root / source} records it as skipped too" if source else
             f"no manifest on disk records its result")
    warn(f"check: not checked: {what}; {where}, so the lock's manifest_sha256 is compared with the manifest on "
         "disk, not with a fresh one; everything else is compared as usual" if source else
         f"check: not checked: {what}; {where}, so the lock's manifest_sha256 is not compared; everything else "
         "is compared as usual")
    return build, unchecked


def _lock_but_manifest(fresh: dict, disk_lock: dict, root: Path, unchecked: list) -> tuple[str, "str | None"]:
    """(verdict, problem) of the lock on disk against a fresh lock whose ``manifest_sha256`` the
    build could not make (``unchecked`` checks skipped): every other field must be equal, and its
    ``manifest_sha256`` must be the sha256 of ``patches/latest/manifest.json`` when that is on disk."""
    if not disk_lock:
        return "", "not a lock"
    changes = lock_changes({k: v for k, v in disk_lock.items() if k != "manifest_sha256"},
                           {k: v for k, v in fresh.items() if k != "manifest_sha256"})
    if changes:
        return "", "differs: " + "; ".join(changes)
    latest = root / "patches/latest/manifest.json"
    flags = ", ".join(flag for _name, flag in unchecked)
    if latest.is_file():
        if _sha256_file(latest) != disk_lock.get("manifest_sha256"):
            return "", ("differs: its manifest_sha256 is not that of patches/latest/manifest.json, which was "
                        f"written by a run with {flags}")
        return "identical (its manifest_sha256 is that of patches/latest/manifest.json)", None
    return f"identical but manifest_sha256, not compared ({flags})", None


def _json_on_disk(path: Path) -> dict:
    """The JSON object in ``path``; {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _mismatch_hint(build, root: Path) -> "str | None":
    """A hint naming the usual causes, a carry or date mismatch, or outputs written by a run that
    skipped a check; None keeps the class's."""
    latest = _json_on_disk(root / "patches/latest/manifest.json")
    skipped_there = skipped_checks(latest)
    if skipped_there:
        flags = " ".join(flag for _name, flag in skipped_there)
        state = "wrote no" if not _exists(root / LOCK) else "left"
        return (f"patches/latest in {root} was written by a run with {flags} (it skipped "
                f"{describe_skipped(skipped_there)}), which {state} {LOCK}{' alone' if state == 'left' else ''}: run "
                f"`tools/backport --out {root}` without {flags} (it rewrites the outputs and writes the lock), then "
                "--check again.")
    if not _exists(root / LOCK):
        restore = (f"restore it (`git checkout {LOCK}`) and --check again, or " if (root / ".git").exists() else "")
        return (f"{LOCK} is missing from {root} (the other outputs are there): {restore}write it with a plain run "
                f"(`tools/backport --out {root}`), then --check again.")
    disk_carry = latest.get("carry") if isinstance(latest.get("carry"), dict) else None
    run_carry = build.manifest.get("carry")
    if disk_carry and (not isinstance(run_carry, dict) or run_carry.get("sha256") != disk_carry.get("sha256")):
        return (f"patches/latest was made with --carry {disk_carry.get('name')} (sha256 "
                f"{str(disk_carry.get('sha256'))[:12]}), and this check "
                + ("ran without --carry" if not run_carry else f"ran with --carry {run_carry.get('name')}")
                + ": pass the same --carry to --check, or run `tools/backport` without it to go back to the "
                  "carry-free outputs.")
    day = build.manifest["date"]
    lock = _json_on_disk(root / LOCK)
    old_recipe = lock.get("recipe") if isinstance(lock.get("recipe"), dict) else {}
    new_recipe = build.manifest["recipe"]
    if old_recipe.get("sha256") and old_recipe.get("sha256") != new_recipe["sha256"]:
        return (f"The recipe {new_recipe['path']} is not the one {LOCK} was written with (sha256 "
                f"{str(old_recipe.get('sha256'))[:12]} in the lock, {new_recipe['sha256'][:12]} now): regenerate with "
                f"`tools/backport` and commit {LOCK} to publish the recipe's change, or restore the recipe file "
                "(`git checkout` it) and --check again.")
    tool = latest.get("tool") if isinstance(latest.get("tool"), dict) else {}
    if tool.get("version") and tool.get("version") != build.manifest["tool"]["version"]:
        return (f"patches/latest was written by gdn-backport {tool.get('version')}, this is "
                f"{build.manifest['tool']['version']}: regenerate with `tools/backport` and commit {LOCK}.")
    lock_day = str(lock["date"]) if "date" in lock else None
    latest_day = str(latest["date"]) if "date" in latest else None
    if lock_day and lock_day != day:
        return (f"This check rebuilt the {day} patch, but {LOCK} is dated {lock_day} (the date is part of the "
                f"patch). Run the check without --date and with SOURCE_DATE_EPOCH unset to use the lock's date; "
                f"re-date the lock only on purpose (`tools/backport --release`, then commit {LOCK}).")
    if latest_day and latest_day != day:
        return (f"patches/latest holds the {latest_day} outputs, and this check rebuilt the lock's {day} ones. "
                f"To check the committed lock alone, run the check in a clean clone (or with --out at a folder "
                f"holding only {LOCK}); to compare on disk, first run `tools/backport` (it takes the lock's date).")
    return None


