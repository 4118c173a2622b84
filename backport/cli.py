"""Command line of the backport job (thin: parses flags, calls the engine, prints).

Exit codes: 0 ok; 1 system failure or unexpected error (one line naming the step and path,
a hint, the traceback in a log file or with --debug); 2 usage; 3 source; 4 pin; 5 recipe;
6 apply; 7 verification; 8 --check mismatch; 9-14 image (see image_pipeline/errors.py); 15 busy
(--no-wait); 16 an output path is a symbolic link; 17 the base already contains the upstream commit (native); 130 interrupted. The README's table lists them.

One run at a time per output folder (``build/.gdn/output.lock``, :mod:`backport.locks`); a
run first finishes or rolls back a switch of outputs that a killed run left
(:func:`backport.output.recover`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

import click
from rich.console import Console
from rich.table import Table

from . import __version__
from .errors import PinError, PipelineError, UsageError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = REPO_ROOT / "manifests" / "gdn-chunkwise-cp.yaml"


def _summary(build, written: list, mode: str) -> Table:
    return _summary_table(build.manifest, written, mode, build.timings, build.cold)


def _summary_table(m: dict, written: list, mode: str, timings: Optional[dict] = None,
                   cold: Optional[bool] = None) -> Table:
    """The run's table from a manifest dict; ``timings`` None (``--summary``) leaves out the time row."""
    table = Table(title=f"gdn-backport {mode}: {m['patch']['name']}", show_lines=False)
    table.add_column("item")
    table.add_column("value")
    p = m["pins"]
    table.add_row("upstream", f"{p['upstream']} ({p['upstream_ref']})")
    table.add_row("base", f"bridge {p['megatron_bridge'][:12]} + mcore {p['mcore_base'][:12]} ({p['commits_between']} commits before upstream)")
    if p.get("bridge_dev_commit", p["mcore_base"]) != p["mcore_base"]:
        table.add_row("pin mismatch", f"mcore base is not Bridge's .dev.commit {p['bridge_dev_commit'][:12]} "
                                      "(allowed by --allow-pin-mismatch)")
    table.add_row("upstream hunks", ", ".join(f"{k} {v}" for k, v in m["upstream_summary"].items()) + f" (of {len(m['upstream_hunks'])})")
    kinds: dict = {}
    for f in m["files"]:
        for h in f["hunks"]:
            for o in h["origins"]:
                kinds[o["kind"]] = kinds.get(o["kind"], 0) + o["added"] + o["removed"]
    table.add_row("patch", f"{m['patch']['files']} files, {m['patch']['hunks']} hunks, +{m['patch']['added']} -{m['patch']['removed']}")
    table.add_row("lines by origin", ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
                  + " (added + removed lines, by the kind of step that made them; README \"Reading the manifest\")")
    if "added_by_kind" in m["patch"]:
        table.add_row("added lines by kind", ", ".join(f"{k} {v}" for k, v in m["patch"]["added_by_kind"].items())
                      + " (per line: tools/backport annotate [HUNK ...])")
    table.add_row("sha256", m["patch"]["sha256"])
    for c in m["verification"]:
        table.add_row(f"check {c['check']}", ("ok: " if c["ok"] else "SKIPPED: ") + c["detail"])
    _report_rows(table, m)
    t = timings
    if t is not None:
        write = f", write {t['write_s']:.1f}" if "write_s" in t else ""
        total = t["total_s"] + t.get("write_s", 0.0)  # the build's total, then writing the outputs
        table.add_row("time", f"{total:.1f} s ({'cold' if cold else 'warm'}: sources {t['sources_s']:.1f}, tree "
                              f"{t['base_tree_s']:.1f}, recipe {t['recipe_s']:.1f}, verify {t['verify_s']:.1f}{write})")
    for path in written:
        table.add_row("wrote" if mode == "write" else mode, str(path))
    return table


def _report_rows(table: Table, m: dict) -> None:
    """Rows of a retargeted run (``m["retarget"]``): the recipe's pins and each step at this base."""
    from .retarget import report_counts

    r = m.get("retarget")
    if not r:
        return
    rp = r["recipe_pins"]
    table.add_row("retargeted", f"from the recipe's bridge {rp['megatron_bridge'][:12]} + mcore {rp['mcore_base'][:12]} "
                                f"(declared {rp['commits_between']} commits before upstream)")
    for s in r["steps"]:
        table.add_row(f"step {s['id']}", f"{s['status']}: {s['detail']}")
    table.add_row("upstream hunks here", ", ".join(f"{k} {v}" for k, v in report_counts(r).items()))


def _date_choice(date: Optional[str], release: bool, out: Path, check: bool) -> tuple[Optional[str], str]:
    """(date for :func:`backport.options.parse_date`, where it came from).

    ``--date``, else SOURCE_DATE_EPOCH, else today with ``--release``, else the date of
    ``<out>/manifests/lock.json`` (so a plain run reproduces the committed lock), else today
    when there is no lock.
    """
    from . import output

    if date is not None:
        return date, "--date"
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return None, "SOURCE_DATE_EPOCH"
    if release:
        return None, "today (UTC), --release"
    lock_day = output.lock_date(out, check=check)
    if lock_day:
        return lock_day, str(out / output.LOCK)
    return None, "today (UTC): there is no lock"


def _read_json(path: Path) -> Optional[dict]:
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _save_traceback(exc: BaseException, places: list) -> Optional[Path]:
    """Write the traceback of ``exc`` to the first writable place; return the log's path."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for folder in places + [Path(tempfile.gettempdir())]:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"gdn-backport-error-{stamp}-{os.getpid()}.log"
            path.write_text(f"tools/backport {' '.join(sys.argv[1:])}\n{text}", encoding="utf-8",
                            errors="backslashreplace")
            return path
        except OSError:
            continue
    return None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--upstream", metavar="SHA", help="Upstream Megatron-LM commit to backport (full or unique short SHA). Default: the recipe's pin (5139086e).")
@click.option("--bridge", "bridge", metavar="SHA", help="Megatron-Bridge commit to build on (full or unique short SHA); the MCore base is its .dev.commit and commits_between is measured. Default: the recipe's pins.")
@click.option("--mcore-base", "mcore_base", metavar="SHA", help="MCore base other than the Bridge's .dev.commit; only with --allow-pin-mismatch.")
@click.option("--recipe", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_RECIPE, show_default=True, help="Recipe YAML.")
@click.option("--megatron-lm", metavar="URL|PATH", help="Megatron-LM remote or local mirror. Env MEGATRON_LM_REPO; default the GitHub URL.")
@click.option("--megatron-bridge", metavar="URL|PATH", help="Megatron-Bridge remote or local mirror. Env MEGATRON_BRIDGE_REPO; default the GitHub URL.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), help="Bare-repo and tree cache. Env GDN_BACKPORT_CACHE; default ~/.cache/gdn-backport.")
@click.option("--offline", is_flag=True, help="Use only the cache; never clone or fetch.")
@click.option("--carry", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Downstream patch applied first with zero fuzz; its hunks are recorded as carried.")
@click.option("--date", "date", metavar="YYYY-MM-DD", help="Date of the output names and manifest (1970-01-01 to 9999-12-31); a date other than the lock's is a new release. Default SOURCE_DATE_EPOCH, else the date of <out>/manifests/lock.json (the committed bytes), else today (UTC).")
@click.option("--release", is_flag=True, help="Make a new dated release: date today (UTC) unless --date or SOURCE_DATE_EPOCH says otherwise; says what changed in manifests/lock.json.")
@click.option("--out", type=click.Path(file_okay=False), default=str(REPO_ROOT), show_default=True, help="Output root (patches/, manifests/lock.json, build/tree/); not inside the patches/, build/tree/ or build/.gdn/ of another output root; no output path below it may be a symbolic link.")
@click.option("--allow-pin-mismatch", is_flag=True, help="Accept an MCore base that differs from the Bridge's .dev.commit.")
@click.option("--no-import-check", is_flag=True, help="Skip the import check (recorded as SKIPPED in the manifest): the outputs are written but the lock is left alone (a lock states that every check ran); with --check, compare the rest.")
@click.option("--python", "python", default=sys.executable, show_default=True, help="Interpreter for the import check (needs torch, triton==3.6.0, FLA 0.4.2); checked before any work.")
@click.option("--no-trees", is_flag=True, help="Do not write build/tree/base and build/tree/patched.")
@click.option("--dry-run", is_flag=True, help="Run and verify everything, write the outputs to a scratch dir only and print its path.")
@click.option("--check", is_flag=True, help="Regenerate with the lock's date and compare with the files on disk (the lock alone in a fresh clone); exit 8 on any difference.")
@click.option("--list-hunks", is_flag=True, help="Print the upstream commit's hunk ids (for writing a recipe) and exit.")
@click.option("--summary", is_flag=True, help="Print the last run's table from <out>/patches/latest/manifest.json without rebuilding, and exit.")
@click.option("--no-wait", is_flag=True, help="Exit 15 at once when another run holds the output folder or a cache entry, instead of waiting for it.")
@click.option("--debug", "debug", is_flag=True, help="Print the traceback of an error (otherwise it goes to a log file whose path is printed).")
@click.option("-v", "--verbose", "verbose", is_flag=True, help="Alias of --debug.")
@click.option("--version", "version", is_flag=True, help="Print the version and exit (on its own only).")
def cli(upstream, bridge, mcore_base, recipe, megatron_lm, megatron_bridge, cache_dir, offline, carry, date, release, out,
        allow_pin_mismatch, no_import_check, python, no_trees, dry_run, check, list_hunks, summary, no_wait, debug,
        verbose, version):
    """Backport Megatron-LM chunkwise CP for Gated DeltaNet onto the pinned tree.

    Writes patches/megatron/<YYYYMMDD>-<base9>[-carry-<sha8>].patch, patches/latest/megatron.patch and the
    hunk manifest (JSON + Markdown), after verifying the patch against the pristine base.
    A plain run reproduces the date of manifests/lock.json; --release or --date makes a new one.

    One action per run (a plain run writes; --check, --dry-run, --list-hunks, --summary); a flag the
    action does not use exits 2 naming both (--summary takes only --out; --list-hunks takes --upstream,
    --recipe, --megatron-lm, --cache-dir, --offline, --no-wait; --no-trees is for a plain run only).

    `tools/backport annotate [HUNK ...]` prints the patch with each line's provenance (upstream, ours,
    carried) in a margin; `tools/backport annotate --help` says more.
    """
    from . import locks, output

    # Not a terminal (CI, a pipe, a log file): one line per message, never wrapped mid-phrase.
    err = Console(stderr=True, soft_wrap=not sys.stderr.isatty())
    debug = debug or verbose
    from . import interrupts

    step = interrupts.STEP  # the step an interrupt names (locks and output.write update it too)
    step["now"], step["done"] = "checking the inputs", None  # each run starts uncommitted
    cache = cache_dir or None
    try:
        refuse_unused_flags(click.get_current_context())
        if version:
            click.echo(f"tools/backport, version {__version__}")
            return
        out = _out_folder(out)
        from .cache import default_cache_dir

        output.refuse_out_in_cache(out, Path(cache_dir) if cache_dir else default_cache_dir())
        if summary:
            _print_summary(out)
            return
        with locks.policy(wait=not no_wait):
            _run(err, step, upstream, recipe, megatron_lm, megatron_bridge, cache_dir, offline, carry, date,
                 release, out, allow_pin_mismatch, no_import_check, python, no_trees, dry_run, check, list_hunks,
                 bridge=bridge, mcore_base=mcore_base)
    except PipelineError as exc:
        if debug:
            err.print_exception()
        click.echo(f"error: {exc.message}\nhint: {exc.hint}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt as exc:
        interrupts.say_and_exit(exc)
    except Exception as exc:  # noqa: BLE001 - the one top-level handler: one line, a hint, no traceback
        cause = _interrupt_in_chain(exc)
        if cause is not None:  # a clean-up that failed while an interrupt unwound: the interrupt is the cause
            interrupts.say_and_exit(cause)
        from .errors import describe_unexpected
        from .cache import default_cache_dir

        message, hint = describe_unexpected(exc, step["now"])
        message = " ".join(message.split())
        if debug:
            err.print_exception()
            hint += " (traceback above)"
        else:
            log = _save_traceback(exc, [(cache or default_cache_dir()) / "logs"])
            hint += f" The traceback is in {log}." if log else " Re-run with --debug for the traceback."
        click.echo(f"error: {message}\nhint: {hint}", err=True)
        sys.exit(1)


#: The action a run does, named by its action flag (none: write the outputs).
ACTION_FLAGS = {"summary": "summary", "list_hunks": "list-hunks", "check": "check", "dry_run": "dry-run"}
#: What each action does, for the refusals.
ACTION_DOES = {"write": "writes the outputs", "dry-run": "writes the outputs to a scratch folder only",
               "check": "compares a fresh build with the outputs on disk and writes nothing",
               "list-hunks": "only lists the upstream commit's hunks",
               "summary": "only prints the last run's table from its manifest"}
_BUILDS = frozenset({"write", "dry-run", "check"})
_ALL = frozenset(ACTION_DOES)
#: Flag (click parameter name) -> the actions it takes effect in. A flag given on the command line
#: to any other action is refused (exit 2) naming both flags, never silently dropped;
#: tests/unit/test_cli_flags.py runs every pair of the click definition's flags against it, so a new
#: flag must be entered here.
FLAG_ACTIONS = {
    "upstream": _BUILDS | {"list-hunks"}, "bridge": _BUILDS, "mcore_base": _BUILDS,
    "recipe": _BUILDS | {"list-hunks"}, "megatron_lm": _BUILDS | {"list-hunks"}, "megatron_bridge": _BUILDS,
    "cache_dir": _BUILDS | {"list-hunks"}, "offline": _BUILDS | {"list-hunks"}, "no_wait": _BUILDS | {"list-hunks"},
    "carry": _BUILDS, "date": _BUILDS, "release": frozenset({"write", "dry-run"}),
    "out": frozenset({"write", "dry-run", "check", "summary"}),  # dry-run: the lock there gives the date
    "allow_pin_mismatch": _BUILDS, "no_import_check": _BUILDS, "python": _BUILDS,
    "no_trees": frozenset({"write"}),  # --dry-run never writes trees, --check writes nothing
    "debug": _ALL, "verbose": _ALL,  # how an error is shown
    "version": frozenset(),  # on its own only
    **{name: frozenset({action}) for name, action in ACTION_FLAGS.items()},
}
#: Pairs of flags that exclude each other whatever the action: (a, b, message, hint).
EXCLUDED_PAIRS = (
    ("python", "no_import_check",
     "--python and --no-import-check exclude each other: --python names the import check's interpreter, and "
     "--no-import-check skips that check (the interpreter would be ignored).",
     "Drop --no-import-check to run the import check with that interpreter, or drop --python."),
    ("release", "no_import_check",
     "--release makes a new lock, and a lock states that every check ran: it excludes --no-import-check.",
     "Drop --no-import-check and pass --python an interpreter with torch, triton 3.6.0 and FLA 0.4.2 (e.g. "
     "$PWD/.venv/bin/python after `make venv`)."),
)


def _flag(param: click.Parameter) -> str:
    """The long spelling of a click option (``--verbose`` for ``-v/--verbose``)."""
    return max(param.opts, key=len)


def _uses(name: str) -> str:
    actions = sorted(FLAG_ACTIONS.get(name, ()), key=list(ACTION_DOES).index)
    return ", ".join("a plain run" if a == "write" else f"--{a}" for a in actions) or "nothing else"


def refuse_unused_flags(ctx: click.Context) -> None:
    """Refuse, before any work, a flag given on the command line that the run's action would not
    use (:data:`FLAG_ACTIONS`), two action flags at once, and the pairs of :data:`EXCLUDED_PAIRS`:
    every flag given either takes effect or the run exits 2 naming the flags that conflict.

    Raises:
        UsageError: naming both flags and what the action does.
    """
    from click.core import ParameterSource

    params = {p.name: p for p in ctx.command.params}
    given = [name for name in params if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE]
    if "version" in given and len(given) > 1:
        other = _flag(params[next(n for n in given if n != "version")])
        raise UsageError(f"--version and {other} exclude each other: --version only prints the version, and "
                         f"{other} would be ignored.", hint="Run `tools/backport --version` on its own.")
    actions = sorted((n for n in given if n in ACTION_FLAGS), key=list(ACTION_FLAGS).index)
    if len(actions) > 1:
        (a, b), (x, y) = (_flag(params[n]) for n in actions[:2]), (ACTION_FLAGS[n] for n in actions[:2])
        raise UsageError(f"{a} and {b} exclude each other: {a} {ACTION_DOES[x]}, and {b} {ACTION_DOES[y]}; one run "
                         "does one of them.", hint="Run them as two commands.")
    action = ACTION_FLAGS[actions[0]] if actions else "write"
    named = f"--{action}" if actions else "a plain run"
    for name in given:
        if action not in FLAG_ACTIONS.get(name, _ALL):
            flag = _flag(params[name])
            raise UsageError(f"{named} and {flag} exclude each other: {named} {ACTION_DOES[action]}, and {flag} "
                             "would be ignored.",
                             hint=f"Drop {flag} (it takes effect with {_uses(name)}), or run them as two commands.")
    for a, b, message, hint in EXCLUDED_PAIRS:
        if a in given and b in given:
            raise UsageError(message, hint=hint)


def _out_folder(value: str) -> Path:
    """``--out`` as a path, refused when it names no folder ("" or blanks: it would mean the
    current folder) or lies inside the output trees of another output root (the repository
    root, where a run without ``--out`` writes, included).

    Raises:
        UsageError: naming the value.
    """
    from . import output

    if not value.strip():
        raise UsageError(f"--out {value!r} names no folder (an empty --out is not taken as the current folder)",
                         hint="Pass --out a folder (--out . for the current one), or drop --out to write to "
                              f"{REPO_ROOT}; check the variable that gave the empty value.")
    out = Path(value)
    output.refuse_nested_out(out, REPO_ROOT)
    return out


def _carry_read_once(carry: Optional[Path]) -> Optional[Path]:
    """``carry`` itself when it is a regular file; else (``/dev/stdin``, ``<(...)``, a FIFO) its
    bytes read once, fully, into a private temporary file of the same name, since the run reads
    the carry more than once (digest, parse, determinism re-run) and a pipe yields its bytes once.

    Raises:
        ApplyError: the pipe cannot be read.
    """
    if carry is None or carry.is_file():
        return carry
    from .errors import ApplyError

    try:
        data = carry.read_bytes()
    except OSError as exc:
        raise ApplyError(f"cannot read carried patch {carry}: {exc.strerror}",
                         hint="Pass --carry an existing file or a readable pipe.") from exc
    from . import interrupts

    snap = interrupts.make_folder("gdn-carry-")  # removed at exit (interrupts.finish)
    path = snap / (carry.name or "carry.patch")
    path.write_bytes(data)
    return path


def _run(err, step, upstream, recipe, megatron_lm, megatron_bridge, cache_dir, offline, carry, date, release, out,
         allow_pin_mismatch, no_import_check, python, no_trees, dry_run, check, list_hunks, bridge=None,
         mcore_base=None):
    from . import engine, interrupts, locks, options as run_options, output
    from .cache import default_cache_dir

    carry = _carry_read_once(carry)

    def options(day: Optional[str]) -> "run_options.Options":
        return run_options.Options(
            recipe=recipe, upstream=upstream, megatron_lm=megatron_lm, megatron_bridge=megatron_bridge,
            cache_dir=cache_dir or default_cache_dir(), carry=carry, date=run_options.parse_date(day),
            allow_pin_mismatch=allow_pin_mismatch, offline=offline, import_check=not no_import_check and not list_hunks,
            python=str(Path(python).absolute()) if "/" in python else python,
            bridge=bridge, mcore_base=mcore_base,
        )

    def say(msg: str) -> None:
        if not msg.startswith("warning: "):  # a warning on the way is no step an interrupt could name
            step["now"] = msg
        err.print(f"[dim]… {msg}[/dim]", highlight=False)

    # Inputs first (before any lock or work): flags, --date/SOURCE_DATE_EPOCH, --python.
    run_options.validate(options(date))
    if list_hunks:
        step["now"] = "listing the upstream hunks"
        for line in engine.list_hunks(options(date), progress=say):
            click.echo(line)
        return
    if dry_run:
        day, source = _date_choice(date, release, out, check=False)
        opts = options(day)
        say(f"date {opts.date[:4]}-{opts.date[4:6]}-{opts.date[6:]} from {source}")
        build = _build(err, opts, say)
        step["now"] = "writing the dry-run outputs"
        scratch = interrupts.make_folder("gdn-backport-dry-")  # removed on a failure or an interrupt

        def kept() -> None:  # complete: the user's to read, kept whatever comes next
            interrupts.keep_folder(scratch)
            interrupts.committed(f"the dry-run folder {scratch}")
            step["now"] = "printing the dry-run summary"

        t0 = time.perf_counter()
        written = output.write(build, scratch, trees=False, on_commit=kept)
        build.timings["write_s"] = time.perf_counter() - t0
        Console(width=200).print(_summary(build, written, "dry-run"))
        click.echo(f"dry run: outputs in {scratch}; nothing else written (remove that folder when done)")
        return

    step["now"] = f"checking the output paths in {out}"
    output.preflight(out)  # before the lock, which lives under build/.gdn/ too
    step["now"] = f"taking the lock of the output folder {out}"
    with locks.hold(out / output.OUTPUT_LOCK, f"the output folder {out}"):
        step["now"] = f"recovering {out} from a killed run"
        done = output.recover(out)
        if done:
            click.echo(f"recovered {out}: {done}", err=True)
        if check:
            output.refuse_nothing_to_check(out)
        step["now"] = f"reading the date of {out / output.LOCK}"
        day, source = _date_choice(date, release, out, check)
        from_lock: dict = {}
        if check:  # pins given that differ from the lock's: named first, before the build (which may fail on them)
            output.refuse_other_pins(out, {"megatron_bridge": bridge, "upstream": upstream, "mcore_base": mcore_base,
                                           **({"pin_mismatch_allowed": True} if mcore_base else {})})
        if check and bridge is None and mcore_base is None:
            bridge, mcore_base = _lock_pins(out, recipe, allow_pin_mismatch, say)
            from_lock = {what: sha for what, sha in (("Megatron-Bridge", bridge), ("MCore base", mcore_base)) if sha}
        opts = options(day)
        lock_day = output.lock_date(out) if check else output.lock_date(out, check=False) if no_import_check else None
        shown = f"{opts.date[:4]}-{opts.date[4:6]}-{opts.date[6:]}"
        if not check and no_import_check and lock_day and shown != lock_day:
            raise UsageError(f"{source} dates this run {shown}, and {out / output.LOCK} is dated {lock_day}: a new "
                             "dated release makes a new lock, and a lock states that every check ran, so it excludes "
                             "--no-import-check (as --release does).",
                             hint=f"Drop --no-import-check to make the {shown} release, or drop "
                                  f"{'--date' if source == '--date' else 'SOURCE_DATE_EPOCH'} to write the "
                                  f"{lock_day} outputs without the import check.")
        if not check:
            _warn_pins_left(out, recipe, bridge, mcore_base)
        say(f"{'check: ' if check else ''}date {shown} from {source}")
        if check and lock_day and shown != lock_day:
            click.echo(f"warning: {output.LOCK} is dated {lock_day}; checking with another date ({source}) "
                       "makes the lock differ. Drop it to check against the lock's date.", err=True)
        try:
            build = _build(err, opts, say)
        except PinError as exc:  # a pin --check took from the lock: the lock is the culprit, say so first
            named = [(what, sha) for what, sha in from_lock.items() if sha in exc.message or sha[:12] in exc.message]
            if not named:
                raise
            what, sha = named[0]
            raise PinError(f"{out / output.LOCK} pins {what} {sha[:12]}, which --check takes from it: {exc.message}",
                           hint=f"Restore the lock (`git checkout {output.LOCK}`) if it was edited; else point "
                                f"--{'megatron-bridge' if what == 'Megatron-Bridge' else 'megatron-lm'} at a mirror "
                                f"that has {sha[:12]}, then --check again.") from exc
        out_console = Console(width=200)
        if check:
            step["now"] = f"comparing with the outputs in {out}"
            report = output.check(build, out, warn=lambda msg: click.echo(msg, err=True))
            out_console.print(_summary(build, [f"{rel}: {verdict}" for rel, verdict in report.items()], "check"))
            return
        old_lock = _read_json(out / output.LOCK)
        step["now"] = f"writing the outputs to {out}"
        t0 = time.perf_counter()

        def committed() -> None:  # the commit point passed: an interrupt from here says the release is in place
            interrupts.committed(f"{out} (dated {shown})")
            step["now"] = f"removing the previous outputs from {out / output.TXN}"

        written = output.write(build, out, trees=not no_trees, warn=lambda msg: click.echo(msg, err=True),
                               on_commit=committed)
        step["now"] = "printing the summary and the lock's news"
        build.timings["write_s"] = time.perf_counter() - t0
        out_console.print(_summary(build, written, "write"))
        skipped = output.skipped_checks(build.manifest)
        if skipped:
            flags = " ".join(flag for _name, flag in skipped)
            state = ("not written (there was none)" if not (out / output.LOCK).exists() else
                     "left alone" + (f" (dated {old_lock.get('date')})" if old_lock and old_lock.get("date") else ""))
            click.echo(f"lock: {out / output.LOCK} {state}: this run skipped {output.describe_skipped(skipped)}, and a "
                       f"lock states that every check ran; the other outputs were written. Run without {flags} to "
                       "write or check the lock.", err=True)
            return
        new_lock = output.lock_data(build)
        committed = _committed_lock(out)
        changes = output.lock_changes(old_lock, new_lock)
        if committed is not None and not output.lock_changes(committed, new_lock):
            back = f"; the previous run's lock differed ({'; '.join(changes)})" if changes else ""
            click.echo(f"lock: {output.LOCK} equals the committed lock (dated {shown}){back}")
        elif not changes:
            click.echo(f"lock: {output.LOCK} unchanged (dated {shown}, as the previous run wrote it)")
        elif old_lock is None:
            click.echo(f"lock: {out / output.LOCK} written (there was none in --out; dated {shown}, {source}). "
                       "Later plain runs into this --out take its date.")
        else:
            same_day = old_lock is not None and old_lock.get("date") == output.lock_data(build)["date"]
            if same_day and not release:
                click.echo(f"lock: {output.LOCK} changed: {'; '.join(changes)}. {_lock_cause(old_lock, new_lock, carry)} "
                           "changed since the lock was committed (same date); commit the lock to publish these bytes, or "
                           f"`git checkout {output.LOCK}` and run again to undo"
                           f"{' (and pass the same --carry to --check)' if carry else ''}.")
            else:
                click.echo(f"release: {output.LOCK} changed: {'; '.join(changes)}. Commit it to publish this "
                           f"release, or `git checkout {output.LOCK}` and run without --date/--release to undo.")


def _warn_pins_left(out: Path, recipe: Path, bridge: Optional[str], mcore_base: Optional[str]) -> None:
    """A run without ``--bridge``/``--mcore-base`` into an ``--out`` whose lock pins other commits
    (written with them) goes back to the recipe's pins: one warning line says so, naming the
    flag that keeps the lock's pins."""
    if bridge is not None or mcore_base is not None:
        return
    from . import output
    from .recipe import load_recipe

    pins = (_read_json(out / output.LOCK) or {}).get("pins")
    if not isinstance(pins, dict):
        return
    try:
        default = load_recipe(recipe)[0].pins
    except PipelineError:
        return  # the build names the recipe's problem
    moved = [(what, str(pins.get(key))) for what, key, want in (
        ("Megatron-Bridge", "megatron_bridge", default.megatron_bridge), ("MCore base", "mcore_base", default.mcore_base))
        if isinstance(pins.get(key), str) and pins.get(key) != want]
    if moved:
        keep = f"--bridge {str(pins.get('megatron_bridge'))[:12]}" + (
            f" --mcore-base {str(pins.get('mcore_base'))[:12]} --allow-pin-mismatch"
            if pins.get("mcore_base") != pins.get("bridge_dev_commit") else "")
        click.echo(f"warning: {out / output.LOCK} pins {', '.join(f'{w} {sha[:12]}' for w, sha in moved)} (written "
                   f"with --bridge); this run has no --bridge and goes back to the recipe's pins (Megatron-Bridge "
                   f"{default.megatron_bridge[:12]}), replacing those outputs. To keep the lock's pins, run with "
                   f"{keep}.", err=True)


def _lock_cause(old: dict, new: dict, carry: Optional[Path]) -> str:
    """Which input made a same-day lock change, as far as the two locks tell: the recipe (its
    sha256), the pins, the carried patch (the patch name carries its digest), else the tool's code."""
    causes = []
    def field(key: str) -> dict:
        return old.get(key) if isinstance(old.get(key), dict) else {}

    if carry is not None and field("patch").get("name") != new["patch"]["name"]:
        causes.append(f"The carried patch ({carry.name})")
    if field("recipe").get("sha256") != new["recipe"]["sha256"]:
        causes.append("the recipe")
    if old.get("pins") != new["pins"]:
        causes.append("the pins")
    if not causes:
        return (f"The carried patch ({carry.name}) or the tool's code" if carry else
                "Neither the recipe nor the pins changed: the tool's code (or a file it reads at the pins)")
    text = " and ".join(causes)
    return text[:1].upper() + text[1:]


def _committed_lock(out: Path) -> Optional[dict]:
    """``manifests/lock.json`` as committed at HEAD of the git work tree ``out``, else None (not a
    work tree, no commit, or the lock not tracked there)."""
    import json

    import git

    from . import output

    try:
        repo = git.Repo(out)
        if Path(repo.working_tree_dir).resolve() != out.resolve():
            return None
        return json.loads(repo.git.show(f"HEAD:{output.LOCK}"))
    except (git.exc.GitError, ValueError, OSError):
        return None


def _lock_pins(out: Path, recipe: Path, allow_pin_mismatch: bool, say) -> tuple[Optional[str], Optional[str]]:
    """(bridge, mcore_base) for ``--check`` of outputs written with ``--bridge``/``--mcore-base``:
    the lock's pins where they differ from the recipe's (the base only with
    ``--allow-pin-mismatch``, as when it was written); (None, None) on the recipe's own pins."""
    from . import output
    from .recipe import load_recipe

    pins = (_read_json(out / output.LOCK) or {}).get("pins")
    if not isinstance(pins, dict):
        return None, None
    try:
        default = load_recipe(recipe)[0].pins
    except PipelineError:
        return None, None  # the build names the recipe's problem
    bridge = pins.get("megatron_bridge")
    bridge = bridge if isinstance(bridge, str) and bridge != default.megatron_bridge else None
    base = pins.get("mcore_base")
    base = base if (allow_pin_mismatch and isinstance(base, str) and base != pins.get("bridge_dev_commit")) else None
    if bridge or base:
        say(f"check: pins from {out / output.LOCK}: Megatron-Bridge {(bridge or default.megatron_bridge)[:12]}"
            + (f", MCore base {base[:12]}" if base else ""))
    return bridge, base


def _print_summary(out: Path) -> None:
    """``--summary``: the table of the run that wrote ``<out>/patches/latest/manifest.json``."""
    path = out / "patches" / "latest" / "manifest.json"
    from .readers import manifest_view

    manifest = _read_json(path)
    hint = "Run `tools/backport --upstream 5139086e` first (or pass --out where it wrote)."
    if manifest is None or "patch" not in manifest:
        raise UsageError(f"--summary: {path} is missing or not a manifest.", hint=hint)
    manifest_view(manifest, path, "--summary", "Write it again with `tools/backport` (pass --out where it wrote; "
                                               "with the same --carry, --bridge or --date as before).")
    Console(width=200).print(_summary_table(manifest, [str(path)], "summary"))


def _build(err, opts, say):
    from . import engine

    with err.status("backport") as status:
        return engine.build(opts, progress=lambda msg: (status.update(msg), say(msg)))


def _utf8_file_names() -> None:
    """Under a non-UTF-8 locale (``LC_ALL=C PYTHONUTF8=0``, ``en_US.ISO-8859-1``) run again in
    Python's UTF-8 mode (``-X utf8``): the patch, the trees and git speak UTF-8 file names, which
    an ASCII or Latin-1 file system encoding cannot write (a valid carry adding ``donnée.py`` was
    refused as a patch that does not apply). Messages to a terminal of that locale stay escaped
    (:func:`_ascii_safe_streams`)."""
    encoding = sys.getfilesystemencoding().lower().replace("-", "").replace("_", "")
    if sys.flags.utf8_mode or encoding == "utf8":  # after the exec utf8_mode is on: never a loop
        return
    os.execv(sys.executable, [sys.executable, "-X", "utf8", *sys.orig_argv[1:]])


def _ascii_safe_streams() -> None:
    """Under a non-UTF-8 locale (LC_ALL=C, PYTHONUTF8=0) escape what the terminal cannot show."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        if encoding != "utf8" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def _interrupt_in_chain(exc: BaseException) -> "KeyboardInterrupt | None":
    """The ^C or SIGTERM an exception was raised while handling (``__context__`` chain), if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, KeyboardInterrupt):
            return exc
        exc = exc.__context__
    return None


#: tools/lib/venv_entry.py keeps its start-up signal handlers until main() installs these.
INSTALLS_SIGNAL_HANDLERS = True


def main(argv: Optional[list] = None) -> None:
    """Entry point of ``tools/backport`` and the ``gdn-backport`` script (``argv`` None: the
    process's own arguments, and it ends the process with ``os._exit``; a list: called inside
    another program, which gets ``SystemExit`` and its signal handlers back).

    Signals (:mod:`backport.interrupts`): the first SIGINT/SIGTERM stops the run with exit 130/143
    naming the step; the clean-up runs to its end whatever follows; every temporary folder goes.
    """
    if argv is None:
        _utf8_file_names()  # re-executes in Python's UTF-8 mode where file names need it
    from . import interrupts

    interrupts.install(protect=(main.__code__,))  # main's own lines below are never cut
    code: "int | str | None" = 0
    try:
        _main(argv)
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt as exc:  # raised outside cli()'s handlers (parsing, printing an error)
        code, text = interrupts.message(exc)
        click.echo(text, err=True)
    late = interrupts.finish()  # no signal raises from here; the temporary folders are gone
    if late is not None and code in (0, None):  # arrived after the work, before the exit: still reported
        code, text = interrupts.message(late, f"finishing ({interrupts.STEP['now']})")
        click.echo(text, err=True)
    if argv is not None:  # called inside another program (tests): its handlers back, then SystemExit
        interrupts.restore()
        sys.exit(code)
    if code is not None and not isinstance(code, int):  # sys.exit("text"), as Python prints it
        click.echo(str(code), err=True)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(code or 0)  # the process entry: no interpreter shutdown for a late signal to cut


def _main(argv: Optional[list]) -> None:
    _ascii_safe_streams()
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["annotate"]:  # the one subcommand: the patch with each line's provenance
        from .annotate import main as annotate_main

        annotate_main(args[1:])
        return
    try:
        cli.main(args=args, prog_name="tools/backport", standalone_mode=False)
    except click.exceptions.UsageError as exc:  # unknown flag, missing --carry file, bad value
        click.echo(f"error: {exc.format_message()}\nhint: Run `tools/backport --help` for the flags, then the "
                   "same command again, corrected.", err=True)
        sys.exit(UsageError.exit_code)
    except click.exceptions.Abort as exc:  # click turns an interrupt outside cli()'s body into Abort
        from . import interrupts

        cause = _interrupt_in_chain(exc)
        interrupts.say_and_exit(cause if cause is not None else KeyboardInterrupt())
