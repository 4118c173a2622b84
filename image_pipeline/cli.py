"""Command line of the image pipeline (`tools/image`): parses flags, calls the stage modules, prints.

Progress and diagnostics go to stderr; results (JSON paths, the image id) to stdout.
Exit codes: 0 ok; 1 unexpected; 2 usage; 9 a build step failed; 10 no Docker Engine;
11 disk space; 12 gate refused; 13 inputs missing or inconsistent; 14 base image missing.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import click

from backport import locks
from backport.errors import PipelineError
from backport.tree_digest import sha256_file

from .build import (IMAGE_REPO, BuildResult, build_args, build_image, host_ca_bundle, image_tags, one_line_change,
                    stage_context)
from .engine import (DEFAULT_MIN_FREE_GIB, MIN_FREE_GIB, DiskPeak, check_disk, docker_client, docker_storage,
                     engine_lock, ensure_base_image, image_exists, pull_image)
from .errors import PULL_FAILED_HINT, BaseImageMissing, InputError
from .gate import cases_path, cases_record, require_gate_ok, run_gate, suite_digest, write_json
from .inputs import (CPU_BASE_IMAGE, CPU_TORCH_WHEEL, FLAVOURS, REPO_ROOT, Inputs, flavour_lock, preflight,
                     read_tree_lock)
from .lock import DEFAULT_FLA, FLA_SETS, FLA_TARGETS, target_for

try:
    from rich.console import Console

    _console: Optional["Console"] = Console(stderr=True, highlight=False, soft_wrap=True)
except ImportError:  # rich is a dependency; plain stderr still works without it
    _console = None

RESULTS = REPO_ROOT / "results" / "pipeline"
#: Where a gate writes its report unless told: ignored by git. The committed gate on record,
#: results/pipeline/gate-report.json, changes only through `make record-gate`.
GATE_REPORTS = REPO_ROOT / "build" / "ci"


def say(text: str, style: str = "") -> None:
    if _console is not None:
        _console.print(text, style=style or None, markup=False)
    else:
        print(text, file=sys.stderr, flush=True)


def stream_line(line: str) -> None:
    """Build/suite log lines: steps bold, script markers cyan, the rest dim."""
    if line.startswith("Step "):
        say(line, "bold")
    elif line.startswith(("==> ", "error: ")):
        say(line, "cyan" if line.startswith("==> ") else "bold red")
    else:
        say(f"  {line}", "dim")


def _inputs(tree, patch, manifest, lock, torch_wheel, tree_lock=None, flavour=None, fla=DEFAULT_FLA) -> Inputs:
    base = Inputs()
    return Inputs(
        tree=Path(tree) if tree else base.tree,
        patch=Path(patch) if patch else base.patch,
        manifest=Path(manifest) if manifest else base.manifest,
        lock=Path(lock) if lock else flavour_lock(flavour, fla) if flavour else base.lock,
        torch_wheel=Path(torch_wheel) if torch_wheel else base.torch_wheel,
        tree_lock=Path(tree_lock) if tree_lock else base.tree_lock,
    )


def _fla_option(help_text: str):
    return click.option("--fla", type=click.Choice(sorted(FLA_SETS)), default=DEFAULT_FLA, show_default=True,
                        help=help_text)


def _build_options(f):
    options = [
        click.option("--flavour", type=click.Choice(sorted(FLAVOURS)), default="cuda", show_default=True,
                     help="cuda: NGC PyTorch base, for users. cpu: local Debian base + CPU torch, for gating."),
        _fla_option("FLA set of the image: 0.4.2 (triton 3.6.0, the default), 0.5.2 or 0.6.0 (cuda flavour "
                    "only: triton 3.7.1 with torch 2.12.1; 0.6.0 is fla-core alone; image tags "
                    "gdn-megatron:cuda-fla052, gdn-megatron:cuda-fla060)."),
        click.option("--base-image", default=None, help="Override the flavour's BASE_IMAGE."),
        click.option("--tree", type=click.Path(), help="Tree root holding megatron/ [build/tree/base]."),
        click.option("--patch", type=click.Path(), help="Patch [patches/latest/megatron.patch]."),
        click.option("--manifest", type=click.Path(), help="Manifest [patches/latest/manifest.json]."),
        click.option("--lock", type=click.Path(),
                     help="Requirements lock [docker/requirements-<flavour>.lock]."),
        click.option("--tree-lock", type=click.Path(),
                     help="Backport lock with the tree digests [manifests/lock.json]."),
        click.option("--torch-wheel", type=click.Path(), help=f"cpu torch wheel [{CPU_TORCH_WHEEL}]."),
        click.option("--no-cache", is_flag=True, help="Build every layer again."),
        click.option("--pull", is_flag=True, help="Pull a missing base image (cuda flavour; needs a registry)."),
        click.option("--min-free-gb", type=float, default=None,
                     help="Refuse to start with less free disk (GiB) under Docker's root "
                          f"[by storage driver: {', '.join(f'{d} {g:g}' for d, g in sorted(MIN_FREE_GIB.items()))}; "
                          f"others {DEFAULT_MIN_FREE_GIB:g}]."),
        click.option("--context-dir", type=click.Path(), default=None,
                     help="Where to stage the build context [build/image/context-<flavour>]."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def do_build(flavour, base_image, tree, patch, manifest, lock, torch_wheel, no_cache, min_free_gb,
             context_dir, pull=False, client=None, tags=None, tree_lock=None, fla=DEFAULT_FLA) -> BuildResult:
    """Preflight, base image, context, build: the shared part of `build`, `gate`, `measure`."""
    fl = FLAVOURS[flavour]
    target_for(flavour, fla)  # a flavour/FLA pair without a lock is refused before anything else
    inputs = _inputs(tree, patch, manifest, lock, torch_wheel, tree_lock, flavour, fla)
    pre = preflight(inputs, fl)
    say(f"==> [preflight] patch {pre.patch_name} sha256 {pre.patch_sha256[:12]}, {pre.hunks} hunks; "
        f"flavour {fl.name}, FLA {fla} ({inputs.lock.name}); pristine tree sha256 {pre.tree_sha256[:12]} "
        f"equals {inputs.tree_lock.name}'s", "cyan")
    client = client or docker_client()
    root, driver = docker_storage(client)
    free = check_disk(root, min_free_gb, driver)
    say(f"==> [preflight] {free:.0f} GiB free under {root} (storage driver {driver})", "cyan")
    base = base_image or fl.base_image
    base_record = {"ref": base, "made": False, "seconds": 0.0}
    if fl.name == "cpu" and base == CPU_BASE_IMAGE:
        made = ensure_base_image(client, base, on_line=stream_line)
        if made["created"]:
            base_record.update(made=True, seconds=made["seconds"])
            say(f"==> [base-image] made {base} in {made['seconds']} s", "cyan")
    elif not image_exists(client, base):
        if not pull:
            raise BaseImageMissing(f"base image {base} is not on this machine (the build never pulls "
                                       f"unless asked with --pull)")
        say(f"==> [base-image] pulling {base}", "cyan")
        try:
            pull_image(client, base, on_line=stream_line)
        except BaseImageMissing as exc:  # --pull was given: the default hint's "add --pull" would mislead
            raise BaseImageMissing(exc.message, PULL_FAILED_HINT) from exc
        base_record["pulled"] = True
    ctx = Path(context_dir) if context_dir else (REPO_ROOT / "build" / "image"
                                                 / f"context-{target_for(fl.name, fla).key}")
    stage_context(inputs, fl, ctx, host_ca_bundle(), trees=pre.trees)
    say(f"==> [context] staged {ctx}", "cyan")
    args = build_args(fl, pre, base, fla)
    tags = tags or image_tags(fl, pre, fla)
    result = build_image(client, ctx, args, tags, on_line=stream_line, nocache=no_cache)
    result.base_image = base_record
    say(f"==> [build] {result.tags[0]} = {result.image_id[:19]} in {result.seconds} s "
        f"({result.cached_steps}/{len(result.steps)} steps cached)", "bold green")
    return result


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--no-wait", is_flag=True,
              help="Exit 15 at once when another image command holds the Docker Engine, instead of waiting.")
@click.pass_context
def cli(ctx, no_wait):
    """Build and gate the GDN training image through docker-py."""
    ctx.obj = {"wait": not no_wait}


def _one_per_engine(fn):
    """Run the command holding the Docker Engine's lock (:func:`engine_lock`): one image command
    at a time per engine, so a prune never deletes an image a build has not tagged yet."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        ctx = click.get_current_context()
        wait = (ctx.find_root().obj or {}).get("wait", True)
        with locks.policy(wait=wait), engine_lock(say=lambda m: say(m, "yellow")):
            return fn(*args, **kwargs)

    return run


@cli.command()
@_build_options
@click.option("--json", "json_out", type=click.Path(), default=None, help="Write the build record here.")
@_one_per_engine
def build(json_out, **kw):
    """Build the image from the pinned tree and the verified patch (`make image`)."""
    result = do_build(**kw)
    if json_out:
        write_json(Path(json_out), result.to_dict())
    click.echo(result.image_id)


@cli.command()
@_build_options
@click.option("--image", "image_ref", default=None, help="Gate this image instead of building one.")
@click.option("--gpus", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="GPU part of the suite: auto runs it when the host has GPUs.")
@click.option("--report", type=click.Path(), default=str(GATE_REPORTS / "gate-report.json"), show_default=True,
              help="Where the JSON report goes (ignored by git; `make record-gate` copies it over the "
                   "committed results/pipeline/gate-report.json).")
@_one_per_engine
def gate(image_ref, gpus, report, **kw):
    """Build the image, run its regression suite inside it, write a JSON report (`make gate`).

    First checks the image's trees: their digests, computed inside the image, must be the
    ones manifests/lock.json records (exit 13 names the first differing file).
    """
    client = docker_client()
    trees = read_tree_lock(Path(kw["tree_lock"]) if kw.get("tree_lock") else Inputs().tree_lock)
    build_record = None
    if image_ref is None:
        result = do_build(client=client, **kw)
        image_ref, build_record = result.image_id, result
    say(f"==> [suite] running the image's regression suite in {image_ref[:19]}", "cyan")
    data = run_gate(client, image_ref, gpus={"auto": None, "on": True, "off": False}[gpus],
                        on_line=stream_line, trees=trees)
    if build_record is not None:
        data["build"] = {"seconds": build_record.seconds, "cached_steps": build_record.cached_steps,
                         "steps": len(build_record.steps)}
    records = data.pop("cases", {})
    path = write_json(Path(report), data)
    # Per test: outcome and seconds, for which patch and suite (.ci/run's test-gated step leaves
    # out what passed here) and for the CI timing table.
    write_json(cases_path(path), cases_record(data, records, suite_digest(Inputs().tests)))
    s = data["suite"]
    say(f"==> [gate] {'PASS' if data['ok'] else 'REFUSED'}: {s['passed']} passed, {s['failed']} failed, "
        f"{s['errors']} errors, {s['skipped']} skipped; report {path}", "bold green" if data["ok"] else "bold red")
    click.echo(str(path))
    require_gate_ok(data)


@cli.command()
@click.option("--tag", default=CPU_BASE_IMAGE, show_default=True)
@_one_per_engine
def base(tag):
    """Make the local cpu base image (debootstrap bookworm minbase + python3, venv, patch)."""
    client = docker_client()
    made = ensure_base_image(client, tag, on_line=stream_line)
    say(f"==> [base-image] {tag}: {'made in %s s' % made['seconds'] if made['created'] else 'already present'}",
        "cyan")
    click.echo(tag)


@cli.command()
@click.option("--flavour", type=click.Choice(["cpu", "cuda", "all"]), default="all", show_default=True)
@_fla_option("FLA set to lock: 0.4.2 writes docker/requirements-<flavour>.lock; 0.5.2 and 0.6.0 (cuda only) "
             "write docker/requirements-cuda-fla052.lock and -cuda-fla060.lock.")
@click.option("--torch-wheel", type=click.Path(exists=True), default=str(CPU_TORCH_WHEEL), show_default=True)
def lock(flavour, fla, torch_wheel):
    """Regenerate docker/requirements-<flavour>.lock from docker/requirements.in (needs PyPI).

    cpu resolves on CPython 3.11 next to the cpu torch wheel; cuda on CPython 3.12 next to
    torch 2.10.0 (the NGC base's), leaving out what that base provides. With --fla 0.5.2
    (cuda): FLA 0.5.2 and triton 3.7.1 in place of requirements.in's FLA lines, next to torch
    2.12.1, which that lock holds with torchvision and torch's CUDA runtime wheels. --fla 0.6.0
    likewise, with fla-core 0.6.0 alone (flash-linear-attention 0.6.0 needs transformers>=5.6.2,
    which Megatron-Bridge refuses).
    """
    from .lock import write_lock

    inputs = Inputs()
    names = ["cpu", "cuda"] if flavour == "all" else [flavour]
    if fla != DEFAULT_FLA and flavour == "all":
        names = ["cuda"]
    for name in names:
        target = target_for(name, fla)
        path = flavour_lock(name, fla)
        entries = write_lock(inputs.docker_dir / "requirements.in", target, path, Path(torch_wheel))
        say(f"==> [lock] {target.key}: {len(entries)} packages pinned with hashes in {path}", "cyan")
        click.echo(str(path))


@cli.command("check-lock")
@click.option("--flavour", type=click.Choice(["cpu", "cuda"]), default="cuda", show_default=True)
@click.option("--fla", type=click.Choice([*sorted(FLA_SETS), "all"]), default=DEFAULT_FLA, show_default=True,
              help="FLA set whose lock to check (0.5.2, 0.6.0: docker/requirements-cuda-fla052.lock, "
                   "-cuda-fla060.lock, cuda only); "
                   "all: every lock of the flavour, sharing one dry run of the pins they hold alike.")
@click.option("--lock", "lock_path", type=click.Path(exists=True), default=None,
              help="Lock to check [docker/requirements-<flavour>.lock, or -cuda-fla0NN with --fla 0.N.N].")
def check_lock(flavour, fla, lock_path):
    """Prove a lock installs on its flavour's Python and platform, without installing it (CI; needs PyPI).

    pip's dry run with --require-hashes --no-deps for the target (cuda: CPython 3.12,
    manylinux x86_64 up to glibc 2.39), then every declared dependency of every pin, markers
    evaluated for the target, must be met by a pin or by what the base provides, and the lock
    must hold its FLA set. With --fla all (cuda: the 0.4.2, 0.5.2 and 0.6.0 locks) each lock
    after the first dry-runs only the pins no earlier one holds alike (its FLA set, and torch's
    closure for the first lock that has it).
    """
    from .lock import check_locks

    if fla == "all":
        if lock_path:
            raise click.UsageError("--lock names one lock; --fla all checks every lock of the flavour")
        versions = [DEFAULT_FLA] + [v for (f, v) in sorted(FLA_TARGETS) if f == flavour]
    else:
        versions = [fla]
    checks = [(Path(lock_path) if lock_path else flavour_lock(flavour, v), target_for(flavour, v)) for v in versions]
    for (path, _target), v in zip(checks, versions):
        if lock_path and not path.is_file():
            raise InputError(f"--lock {lock_path} is not a lock file", hint="Pass --lock the path of a "
                             "requirements lock (docker/requirements-*.lock), or leave it out to check the flavour's.")
        if not path.is_file():
            raise InputError(f"the {flavour} lock for FLA {v} is missing: {path}",
                             hint=f"Make it with `tools/image lock --flavour {flavour} --fla {v}` (needs PyPI) and "
                                  "commit it, or restore it with `git checkout -- docker/`.")
    for (path, _target), result in zip(checks, check_locks(checks, Inputs().docker_dir / "requirements.in")):
        shared = f"; {result['shared']} pins taken from an earlier lock's dry run" if result.get("shared") else ""
        say(f"==> [check-lock] {path.name} (FLA {result['fla']}, triton {result['triton']}): "
            f"{result['packages']} packages install on CPython {result['python']} "
            f"({result['platforms']}) with their hashes; every declared dependency is met{shared}", "bold green")
        click.echo(json.dumps(result, sort_keys=True))


@cli.command()
@_build_options
@click.option("--out", type=click.Path(), default=str(RESULTS / "image-timings.json"), show_default=True)
@_one_per_engine
def measure(out, **kw):
    """Time a cold build, then a rebuild after a one-line patch change; write the figures.

    Tags gdn-megatron-measure:cold and :rebuild, so gdn-megatron:<flavour> stays the real image.
    """
    import json

    client = docker_client()
    kw = dict(kw)
    root, _driver = docker_storage(client)
    with DiskPeak(root) as disk:
        kw["no_cache"] = True
        say("==> [measure] cold build (no layer cache)", "bold")
        cold = do_build(client=client, tags=[f"{IMAGE_REPO}-measure:cold"], **kw)
        inputs = _inputs(kw["tree"], kw["patch"], kw["manifest"], kw["lock"], kw["torch_wheel"], kw["tree_lock"],
                         kw["flavour"], kw.get("fla", DEFAULT_FLA))
        probe = REPO_ROOT / "build" / "image" / "probe"
        probe.mkdir(parents=True, exist_ok=True)
        changed = one_line_change(inputs.patch.read_text(encoding="utf-8"))
        (probe / "megatron.patch").write_text(changed, encoding="utf-8")
        manifest = json.loads(inputs.manifest.read_text(encoding="utf-8"))
        manifest.setdefault("patch", {})["sha256"] = sha256_file(probe / "megatron.patch")
        write_json(probe / "manifest.json", manifest)
        # The changed patch makes another patched tree: the probe's lock records its digest.
        from backport.tree_digest import lock_fields

        write_json(probe / "lock.json", lock_fields(inputs.tree, changed.encode()))
        kw.update(no_cache=False, patch=str(probe / "megatron.patch"), manifest=str(probe / "manifest.json"),
                  tree_lock=str(probe / "lock.json"))
        say("==> [measure] rebuild after a one-line patch change", "bold")
        rebuilt = do_build(client=client, tags=[f"{IMAGE_REPO}-measure:rebuild"], **kw)
    info = client.info()
    data = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "flavour": cold.flavour,
        "machine": {"cpus": info.get("NCPU"), "memory_gib": round(info.get("MemTotal", 0) / 2**30, 1),
                    "storage_driver": info.get("Driver"), "docker": info.get("ServerVersion"),
                    "builder": "classic (docker-py)"},
        "disk": {"root": str(root), "growth_bytes": disk.growth_bytes,
                 "peak_growth_bytes": disk.peak_growth_bytes,
                 "failed_samples": disk.failed_samples,
                 "note": "used bytes of the file system holding Docker's root, over both builds "
                         "(and the base image when base_image.made), sampled every 0.5 s"},
        "base_image": cold.base_image,
        "cold": {"seconds": cold.seconds, "image_size_bytes": cold.size_bytes,
                 "steps": [{k: s[k] for k in ("number", "instruction", "cached", "seconds")} for s in cold.steps]},
        "rebuild_one_line_patch_change": {
            "seconds": rebuilt.seconds,
            "rebuilt_steps": rebuilt.rebuilt_steps,
            "cached_steps": rebuilt.cached_steps, "steps": len(rebuilt.steps),
            "step_seconds": [{k: s[k] for k in ("number", "instruction", "cached", "seconds")}
                             for s in rebuilt.steps],
        },
    }
    path = write_json(Path(out), data)
    say(f"==> [measure] cold {cold.seconds} s, rebuild {rebuilt.seconds} s, disk peak "
        f"+{disk.peak_growth_bytes / 2**30:.1f} GiB; {path}", "bold green")
    click.echo(str(path))


@cli.command()
@click.option("--all", "everything", is_flag=True, help="Also remove the cached deps stages.")
@_one_per_engine
def prune(everything):
    """Remove dangling images and stopped build containers (frees disk under Docker's root).

    Keeps the untagged deps stages (label io.gdn.stage=deps), the layer cache of the
    slowest step, unless --all.
    """
    client = docker_client()
    c = client.containers.prune()
    filters = {"dangling": True}
    if not everything:
        filters["label!"] = "io.gdn.stage=deps"
    i = client.images.prune(filters=filters)
    freed = (c.get("SpaceReclaimed") or 0) + (i.get("SpaceReclaimed") or 0)
    say(f"==> [prune] reclaimed {freed / 2**30:.1f} GiB", "cyan")


#: The make target that runs each subcommand (Makefile), for hints that name the failed command.
MAKE_TARGETS = {"build": "make image", "gate": "make gate", "measure": "make image-measure",
                "base": "make image"}


def rerun_command(argv: list[str], environ=os.environ) -> str:
    """The command to run again after a failure of ``tools/image ARGV``: the make target when make
    ran it (``MAKELEVEL`` is set in make's children), else the command line itself."""
    sub = next((a for a in argv if not a.startswith("-")), "")
    if environ.get("MAKELEVEL") and sub in MAKE_TARGETS:
        return MAKE_TARGETS[sub]
    return " ".join(["tools/image", *argv])


def retarget_hint(hint: str, argv: list[str], environ=os.environ) -> str:
    """``hint`` with its "run `make image`" / "`make gate`" advice naming the command that failed
    (a failed `make gate` is not fixed by `make image`, which builds the cuda flavour)."""
    again = rerun_command(argv, environ)
    for named in ("`make image`", "`make gate`"):
        hint = hint.replace(named, f"`{again}`")
    return hint


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cli.main(args=argv, prog_name="tools/image", standalone_mode=False)
    except click.exceptions.Abort:
        say("aborted", "bold red")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2)
    except PipelineError as exc:
        say(f"error: {exc.message}", "bold red")
        say(f"hint: {retarget_hint(exc.hint, argv)}", "yellow")
        sys.exit(exc.exit_code)
    except Exception as exc:  # noqa: BLE001 - one line and a hint (exit 1), never a traceback
        from backport.errors import describe_unexpected

        message, hint = describe_unexpected(exc, "tools/image " + " ".join(argv[:1]))
        if not isinstance(exc, OSError):
            hint = "This is a bug in gdn-backport or an unforeseen input; report it with the command you ran."
        say(f"error: {' '.join(message.split())}", "bold red")
        say(f"hint: {hint}", "yellow")
        sys.exit(1)
