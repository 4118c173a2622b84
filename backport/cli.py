"""Command line of the backport job (thin: parses flags, calls the engine, prints).

Exit codes: 0 ok; 1 unexpected; 2 usage; 3 source; 4 pin; 5 recipe; 6 apply;
7 verification; 8 --check mismatch; 9-14 image (see backport/image.py and the README).
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
from .errors import PipelineError, UsageError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = REPO_ROOT / "manifests" / "gdn-chunkwise-cp.yaml"


def _summary(build, written: list, mode: str) -> Table:
    m = build.manifest
    table = Table(title=f"gdn-backport {mode}: {m['patch']['name']}", show_lines=False)
    table.add_column("item")
    table.add_column("value")
    p = m["pins"]
    table.add_row("upstream", f"{p['upstream']} ({p['upstream_ref']})")
    table.add_row("base", f"bridge {p['megatron_bridge'][:12]} + mcore {p['mcore_base'][:12]} ({p['commits_between']} commits before upstream)")
    table.add_row("upstream hunks", ", ".join(f"{k} {v}" for k, v in m["upstream_summary"].items()) + f" (of {len(m['upstream_hunks'])})")
    kinds: dict = {}
    for f in m["files"]:
        for h in f["hunks"]:
            for o in h["origins"]:
                kinds[o["kind"]] = kinds.get(o["kind"], 0) + o["added"] + o["removed"]
    table.add_row("patch", f"{m['patch']['files']} files, {m['patch']['hunks']} hunks, +{m['patch']['added']} -{m['patch']['removed']}")
    table.add_row("lines by origin", ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    table.add_row("sha256", m["patch"]["sha256"])
    for c in m["verification"]:
        table.add_row(f"check {c['check']}", ("ok: " if c["ok"] else "SKIPPED: ") + c["detail"])
    t = build.timings
    table.add_row("time", f"{t['total_s']:.1f} s ({'cold' if build.cold else 'warm'}: sources {t['sources_s']:.1f}, tree {t['base_tree_s']:.1f}, recipe {t['recipe_s']:.1f}, verify {t['verify_s']:.1f})")
    for path in written:
        table.add_row("wrote" if mode == "write" else mode, str(path))
    return table


def _check_date(date: Optional[str], out: Path, err: Console) -> Optional[str]:
    """The date ``--check`` rebuilds with: ``--date``, else SOURCE_DATE_EPOCH, else the lock's.

    Says on stderr which one and where it came from, and warns when it is not the lock's
    (the lock then differs, since the date is in the patch name and header).
    """
    from . import engine, output

    lock_day = output.lock_date(out)
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if date:
        source = "--date"
    elif epoch:
        source = "SOURCE_DATE_EPOCH"
    elif lock_day:
        date, source = lock_day, str(out / output.LOCK)
    else:
        source = "today (UTC): there is no lock"
    day = engine.parse_date(date)
    err.print(f"[dim]… check: date {day[:4]}-{day[4:6]}-{day[6:]} from {source}[/dim]")
    if lock_day and day != lock_day.replace("-", ""):
        click.echo(f"warning: {output.LOCK} is dated {lock_day}; checking with another date ({source}) "
                   "makes the lock differ. Drop it to check against the lock's date.", err=True)
    return date


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--upstream", metavar="SHA", help="Upstream Megatron-LM commit to backport (full or unique short SHA). Default: the recipe's pin (5139086e).")
@click.option("--recipe", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_RECIPE, show_default=True, help="Recipe YAML.")
@click.option("--megatron-lm", metavar="URL|PATH", help="Megatron-LM remote or local mirror. Env MEGATRON_LM_REPO; default the GitHub URL.")
@click.option("--megatron-bridge", metavar="URL|PATH", help="Megatron-Bridge remote or local mirror. Env MEGATRON_BRIDGE_REPO; default the GitHub URL.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), help="Bare-repo and tree cache. Env GDN_BACKPORT_CACHE; default ~/.cache/gdn-backport.")
@click.option("--offline", is_flag=True, help="Use only the cache; never clone or fetch.")
@click.option("--carry", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Downstream patch applied first with zero fuzz; its hunks are recorded as carried.")
@click.option("--date", "date", metavar="YYYY-MM-DD", help="Date of the output names and manifest. Default SOURCE_DATE_EPOCH, else today (UTC); with --check, SOURCE_DATE_EPOCH, else the date of <out>/manifests/lock.json.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=REPO_ROOT, show_default=True, help="Output root (patches/, manifests/lock.json, build/tree/).")
@click.option("--allow-pin-mismatch", is_flag=True, help="Accept an MCore base that differs from the Bridge's .dev.commit.")
@click.option("--no-import-check", is_flag=True, help="Skip the import check (recorded as SKIPPED in the manifest).")
@click.option("--python", "python", default=sys.executable, show_default=True, help="Interpreter for the import check (needs torch, triton==3.6.0, FLA 0.4.2).")
@click.option("--no-trees", is_flag=True, help="Do not write build/tree/base and build/tree/patched.")
@click.option("--dry-run", is_flag=True, help="Run and verify everything, write the outputs to a scratch dir only and print its path.")
@click.option("--check", is_flag=True, help="Regenerate with the lock's date and compare with the files on disk (the lock alone in a fresh clone); exit 8 on any difference.")
@click.option("--list-hunks", is_flag=True, help="Print the upstream commit's hunk ids (for writing a recipe) and exit.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks of errors.")
@click.version_option(__version__)
def cli(upstream, recipe, megatron_lm, megatron_bridge, cache_dir, offline, carry, date, out, allow_pin_mismatch,
        no_import_check, python, no_trees, dry_run, check, list_hunks, verbose):
    """Backport Megatron-LM chunkwise CP for Gated DeltaNet onto the pinned tree.

    Writes patches/megatron/<YYYYMMDD>-<base9>.patch, patches/latest/megatron.patch and the
    hunk manifest (JSON + Markdown), after verifying the patch against the pristine base.
    """
    from . import engine, output
    from .sources import default_cache_dir

    err = Console(stderr=True)
    try:
        if dry_run and check:
            raise UsageError("--dry-run and --check exclude each other.", hint="Use one of them.")
        if check:
            date = _check_date(date, out, err)
        opts = engine.Options(
            recipe=recipe, upstream=upstream, megatron_lm=megatron_lm, megatron_bridge=megatron_bridge,
            cache_dir=cache_dir or default_cache_dir(), carry=carry, date=engine.parse_date(date),
            allow_pin_mismatch=allow_pin_mismatch, offline=offline, import_check=not no_import_check,
            python=str(Path(python).absolute()) if "/" in python else python,
        )
        if list_hunks:
            for line in engine.list_hunks(opts, progress=lambda msg: err.print(f"[dim]… {msg}[/dim]")):
                click.echo(line)
            return
        with err.status("backport") as status:
            build = engine.build(opts, progress=lambda msg: (status.update(msg), err.print(f"[dim]… {msg}[/dim]")))
        out_console = Console(width=200)
        if check:
            report = output.check(build, out)
            out_console.print(_summary(build, [f"{rel}: {verdict}" for rel, verdict in report.items()], "check"))
            return
        if dry_run:
            import tempfile

            scratch = Path(tempfile.mkdtemp(prefix="gdn-backport-dry-"))
            written = output.write(build, scratch, trees=False)
            out_console.print(_summary(build, written, "dry-run"))
            click.echo(f"dry run: outputs in {scratch}; nothing else written")
            return
        t0 = time.perf_counter()
        written = output.write(build, out, trees=not no_trees)
        build.timings["write_s"] = time.perf_counter() - t0
        out_console.print(_summary(build, written, "write"))
    except PipelineError as exc:
        if verbose:
            err.print_exception()
        click.echo(f"error: {exc.message}\nhint: {exc.hint}", err=True)
        sys.exit(exc.exit_code)


def main(argv: Optional[list] = None) -> None:
    """Entry point of ``tools/backport`` and the ``gdn-backport`` script."""
    cli.main(args=argv, prog_name="tools/backport")
