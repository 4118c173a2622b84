"""Every flag of ``tools/backport``, alone and in every pair, generated from the click definition
(``cli.params``): each combination either does every action it names and lets every flag it was
given take effect, or is refused with exit 2 naming the flags that conflict. A flag added to the
command joins the matrix by itself (and fails it until ``backport/cli.py:FLAG_ACTIONS`` says where
it takes effect).

No build runs: the action entry points (``_build``, ``engine.list_hunks``, ``output.check``,
``output.write``, ``_print_summary``, the output lock) are replaced by recorders, and "a flag took
effect" means the record of the run with it differs from the record of the run without it (what
the engine is handed, the folder written or compared, the lock policy). So a flag that is parsed
and then dropped (``--check --summary`` once exited 0 having checked nothing) is caught whatever
its name.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import re
import sys
import tempfile
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from backport import cli as cli_mod
from backport import engine, locks, output

from conftest import STUB_PYTHON

#: Flags whose effect is only on how an error is shown (nothing to record), and --help (click's
#: eager help: prints the usage, runs nothing, and says so by printing it).
DISPLAY_ONLY = {"debug": "prints an error's traceback", "verbose": "alias of --debug", "help": "click's help"}
#: Flags each action must record when it runs.
ACTION_RECORD = {"summary": "summary", "list_hunks": "list-hunks", "check": "check", "dry_run": "dry-run-write"}
#: Flags a flag needs to run at all (a run without them is refused on purpose, naming both).
NEEDS = {"mcore_base": ["--allow-pin-mismatch"]}


class _Build:
    timings: dict = {}
    manifest = {"verification": [{"check": "imports", "ok": False, "skipped_by": "--no-import-check"}]}


def _fields_used(func) -> set:
    """The ``opts.<field>`` a function reads (so a field it ignores is no effect)."""
    return set(re.findall(r"\bopts\.(\w+)", inspect.getsource(func)))


@pytest.fixture
def world(tmp_path, monkeypatch):
    """Two output folders (the default --out and the sample one), each with a dated lock, and the
    recorders in place; returns ``invoke(args) -> (exit code, stderr, record)``."""
    for name in ("default-out", "other-out"):
        root = tmp_path / name
        (root / "manifests").mkdir(parents=True)
        (root / output.LOCK).write_text(json.dumps({"date": "2026-01-02"}), encoding="utf-8")
    out_param = next(p for p in cli_mod.cli.params if p.name == "out")
    monkeypatch.setattr(out_param, "default", str(tmp_path / "default-out"))
    record: list = []
    list_fields = _fields_used(engine.list_hunks)

    def build(_err, opts, _say):
        data = dataclasses.asdict(opts)
        if not opts.import_check:
            data.pop("python")  # the interpreter of a check that does not run
        record.append(("build", data))
        return _Build()

    def write(_build, root, trees=True, **_kw):
        record.append(("dry-run-write" if root.name.startswith("gdn-backport-dry-") else "write", trees,
                       None if root.name.startswith("gdn-backport-dry-") else str(root)))
        return []

    @__import__("contextlib").contextmanager
    def policy(wait):
        record.append(("policy", wait))
        yield

    @__import__("contextlib").contextmanager
    def hold(path, what):
        record.append(("hold", str(path)))
        yield

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the dry runs' scratch folders
    real_date_choice = cli_mod._date_choice
    monkeypatch.setattr(cli_mod, "_build", build)
    monkeypatch.setattr(cli_mod, "_summary", lambda *a, **k: "")
    monkeypatch.setattr(cli_mod, "_date_choice", lambda date, release, out, check: (
        record.append(("date", date, release, str(out))), real_date_choice(date, release, out, check))[1])
    monkeypatch.setattr(cli_mod, "_print_summary", lambda out: record.append(("summary", str(out))))
    monkeypatch.setattr(engine, "list_hunks", lambda opts, progress=None: (
        record.append(("list-hunks", {f: getattr(opts, f) for f in sorted(list_fields)})), [])[1])
    monkeypatch.setattr(output, "check", lambda b, root, warn=None: (record.append(("check", str(root))), {})[1])
    monkeypatch.setattr(output, "write", write)
    monkeypatch.setattr(output, "recover", lambda root: None)
    monkeypatch.setattr(locks, "policy", policy)
    monkeypatch.setattr(locks, "hold", hold)
    carry = tmp_path / "downstream.patch"
    carry.write_text("", encoding="utf-8")

    def invoke(args):
        record.clear()
        result = CliRunner().invoke(cli_mod.cli, args, catch_exceptions=False)
        return result.exit_code, result.stderr, list(record)

    invoke.samples = {"carry": str(carry), "out": str(tmp_path / "other-out"), "cache_dir": str(tmp_path / "cache"),
                      "recipe": str(tmp_path / "other.yaml"), "python": STUB_PYTHON, "date": "2026-03-04",
                      "mcore_base": "def5678", "megatron_lm": str(tmp_path / "mlm"),
                      "megatron_bridge": str(tmp_path / "bridge")}
    return invoke


def _params() -> list[click.Parameter]:
    ctx = click.Context(cli_mod.cli)
    return [p for p in cli_mod.cli.get_params(ctx) if p.name not in DISPLAY_ONLY and "--help" not in p.opts]


def _args(param: click.Parameter, samples: dict) -> list[str]:
    flag = max(param.opts, key=len)
    if param.is_flag:
        return [flag]
    return [flag, samples.get(param.name, "abc1234")] + NEEDS.get(param.name, [])


def _verdict(invoke, names: tuple, by_name: dict) -> str | None:
    """None when the combination is right, else what is wrong."""
    args = [a for n in names for a in _args(by_name[n], invoke.samples)]
    code, stderr, rec = invoke(args)
    flags = [max(by_name[n].opts, key=len) for n in names]
    if code == 2:
        first = next((line for line in stderr.splitlines() if line.startswith("error: ")), "")
        if "Traceback" in stderr or not stderr.rstrip().splitlines()[-1].startswith("hint: "):
            return f"exit 2 without the error:/hint: lines: {stderr!r}"
        if all(f in first for f in flags):
            return None
        alone = [n for n in names if invoke(_args(by_name[n], invoke.samples))[0] == 2]
        return None if alone else f"exit 2 not naming {' and '.join(flags)}: {first!r}"
    if code not in (0,):
        return f"exit {code}: {stderr!r}"
    kinds = {r[0] for r in rec}
    for n in names:
        if n in ACTION_RECORD and ACTION_RECORD[n] not in kinds:
            return f"{max(by_name[n].opts, key=len)} did not run (record {rec})"
    if "version" in names:
        return None if len(names) == 1 else "--version ran with another flag"
    for n in names:
        rest = [m for m in names if m != n]
        without = invoke([a for m in rest for a in _args(by_name[m], invoke.samples)])[2]
        if without == rec:
            return f"{max(by_name[n].opts, key=len)} was silently dropped (the run records the same without it)"
    return None


def test_every_flag_alone_takes_effect(world):
    by_name = {p.name: p for p in _params()}
    assert len(by_name) >= 20, sorted(by_name)
    wrong = {n: v for n in by_name if (v := _verdict(world, (n,), by_name))}
    assert not wrong, wrong


def test_every_pair_of_flags_runs_all_it_names_or_exits_2_naming_both(world):
    by_name = {p.name: p for p in _params()}
    wrong = {}
    for pair in itertools.combinations(by_name, 2):
        if any(max(by_name[b].opts, key=len) in NEEDS.get(a, []) for a, b in (pair, pair[::-1])):
            continue  # the pair is the one flag with what it needs
        verdict = _verdict(world, pair, by_name)
        if verdict:
            wrong[" ".join(pair)] = verdict
    assert not wrong, "\n".join(f"{k}: {v}" for k, v in wrong.items())


def test_every_flag_is_classified():
    """A new flag must say where it takes effect (FLAG_ACTIONS), or it is taken to work everywhere."""
    names = {p.name for p in cli_mod.cli.params}
    assert names - set(DISPLAY_ONLY) <= set(cli_mod.FLAG_ACTIONS), names - set(cli_mod.FLAG_ACTIONS)


@pytest.mark.parametrize("args, first", [
    (["--check", "--summary"], "error: --summary and --check exclude each other"),
    (["--list-hunks", "--summary"], "error: --summary and --list-hunks exclude each other"),
    (["--list-hunks", "--carry", "CARRY"], "error: --list-hunks and --carry exclude each other"),
    (["--check", "--no-trees"], "error: --check and --no-trees exclude each other"),
    (["--version", "--check"], "error: --version and --check exclude each other"),
])
def test_the_combinations_of_the_issue_exit_2_naming_both(world, args, first):
    args = [world.samples["carry"] if a == "CARRY" else a for a in args]
    code, stderr, rec = world(args)
    assert code == 2, stderr
    assert stderr.startswith(first), stderr
    assert rec == []
