#!/usr/bin/env python3
"""Interrupt loop: `tools/backport` cut by 1-5 signals (SIGINT/SIGTERM mixed, a few ms apart) at
random points, N tries; what is left behind, the exit code and the message's step (issue 45).

    .venv/bin/python bench/interrupt_loop.py [--tries 200] [--files 1500] [--seed 45]
        [--out results/pipeline/interrupt-loop] [--work DIR] [--keep]

Each try starts one ``tools/backport`` run on throwaway fake repositories (the unit tests'
fixture, ``tests/unit/conftest.build_fake_repos``, whose Bridge tree is padded with ``--files``
small files so that copying and digesting a tree take as long as on the real tree) into one
output folder, with a new ``--date`` each time (so every run that finishes commits a new lock),
a fresh ``TMPDIR`` and, for the import check, a stand-in interpreter that takes 0.3 s. The
signals go to the tool's process (or, one try in four, to its whole process group, as a
terminal's Ctrl-C does) at a point picked by the try's mode:

* ``random``: uniformly within the length of an uninterrupted run;
* ``import``: while the import check runs (its ``gdn-verify-*`` folder holds ``import.out``);
* ``digest``: while a ``gdn-tree-digest-*`` folder exists (the lock's tree digest);
* ``commit``: just after the new ``manifests/lock.json`` is in place (after the commit point);
* ``lock``: while the run waits for a cache lock another process holds.

Every try must end with: exit 130 (the first signal SIGINT) or 143 (SIGTERM), or 0 when it
finished first (or, ended by the signal itself with nothing on stderr, when it came during
Python's own start-up, before the first line of the tool ran; signals that arrive together, before the process runs again, are handled in
signal-number order, SIGINT first: then either code of the signals sent is right; the table
counts how often the code is not the first one sent's); ``error: interrupted while <step>`` / ``error: terminated (SIGTERM) while
<step>`` naming the step (the lock wait in ``lock`` tries; the new release complete and in
place when the new lock is on disk, and never so when it is not); nothing left in the TMPDIR
given to it nor in ``<out>/build/.gdn`` (but the output lock) nor ``.gdn-stage-*`` in
``<out>``; no process of its session alive 2 s after it exits; the outputs on disk exactly the
old set or exactly the new one (``--check --offline`` at the lock's date passes).

Writes ``<out>.json`` and ``<out>.md``. Exit status 0 when every try passed, 1 otherwise. The
unit test tests/unit/test_interrupts.py runs a few of these tries in CI (:func:`one_try`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = ("random", "import", "digest", "commit", "lock")
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
GRACE_S = 2.0  # how long a process of the tool's session may outlive it (a git child finishing)


def default_signals() -> None:
    """``preexec_fn`` of every child that is sent a signal: SIGINT and SIGTERM at their default
    disposition, whatever this process inherited (``nohup``, ``&`` in a non-interactive shell
    and ``trap "" INT`` start it with SIGINT ignored, and an ignored disposition is inherited)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@dataclass
class Setup:
    """The throwaway inputs of the loop (made once by :func:`make_setup`)."""

    work: Path
    args: list  # tools/backport flags but --date, --out and --no-wait
    out: Path
    cache: Path
    run_s: float  # length of an uninterrupted run
    base_lock: Path  # the cached base tree's lock (held by another process in ``lock`` tries)
    day: list = field(default_factory=lambda: [0])


def make_setup(work: Path, files: int = 1500, measure: bool = True) -> Setup:
    """Fake repositories (Bridge tree padded with ``files`` files), a recipe, a slow stub
    interpreter, one warm run into ``work/out`` (and, with ``measure``, a second one that gives
    :attr:`Setup.run_s`, which ``random`` tries need); return the :class:`Setup`."""
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    from conftest import build_fake_repos, commit, recipe_data, write_recipe  # noqa: E402 (test fixtures)

    work.mkdir(parents=True, exist_ok=True)
    repos = build_fake_repos(work / "upstreams")
    pad = {f"src/megatron/bridge/pad/m{i // 100:02d}/f{i:04d}.py": f'"""Padding {i}."""\nX = {i}\n'
           for i in range(files)}
    bridge = commit(repos.bridge_repo, {**pad, ".dev.commit": repos.base + "\n"}, "padding")
    data = recipe_data(repos)
    data["pins"]["megatron_bridge"] = bridge
    recipe = write_recipe(work / "recipe.yaml", data)
    slow = work / "slow-python"
    slow.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(0.3)\n"
                    "print('{\"fla\": \"0.4.2\", \"torch\": \"stub\", \"triton\": \"3.6.0\"}')\n")
    slow.chmod(0o755)
    cache = work / "cache"
    args = ["--recipe", str(recipe), "--megatron-lm", str(repos.mlm), "--megatron-bridge", str(repos.bridge_repo),
            "--cache-dir", str(cache), "--python", str(slow)]
    setup = Setup(work=work, args=args, out=work / "out", cache=cache, run_s=0.0, base_lock=Path())
    t0 = time.monotonic()
    warm = _start(setup, "2000-01-01", work / "tmp-warm")
    _, err = warm.communicate(timeout=300)
    if warm.returncode != 0:
        raise SystemExit(f"the warm-up run failed ({warm.returncode}):\n{err[-2000:]}")
    setup.run_s = time.monotonic() - t0
    if measure:
        t1 = time.monotonic()
        again = _start(setup, "2000-01-02", work / "tmp-warm")
        _, err = again.communicate(timeout=300)
        if again.returncode != 0:
            raise SystemExit(f"the second warm-up run failed ({again.returncode}):\n{err[-2000:]}")
        setup.run_s = min(setup.run_s, time.monotonic() - t1)
    setup.day[0] = 2
    setup.base_lock = next((cache / "trees").glob("*.lock"))
    return setup


def _env(tmpdir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SOURCE_DATE_EPOCH", "MEGATRON_LM_REPO",
                                                          "MEGATRON_BRIDGE_REPO")}
    tmpdir.mkdir(parents=True, exist_ok=True)
    env.update({"TMPDIR": str(tmpdir), "TZ": "UTC", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
                "GDN_BACKPORT_CACHE": str(tmpdir.parent / "tool-cache")})
    return env


def _start(setup: Setup, day: str, tmpdir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "tools/backport"), *setup.args, "--date", day,
                             "--out", str(setup.out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=_env(tmpdir), start_new_session=True, preexec_fn=default_signals)


def _session(sid: int) -> list:
    """``[(pid, command)]`` of the live processes of session ``sid`` (zombies left out)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append((int(entry), cmd.strip()[:120]))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _wait_for(cond, proc: subprocess.Popen, limit_s: float = 120.0) -> bool:
    """Poll ``cond()`` every millisecond until true (True) or ``proc`` exits (False)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.001)
    return False


def _has(folder: Path, prefix: str, inner: str = "") -> bool:
    try:
        return any(name.startswith(prefix) and (not inner or (folder / name / inner).exists())
                   for name in os.listdir(folder))
    except OSError:
        return False


def _lock_date(out: Path) -> "str | None":
    try:
        return json.loads((out / "manifests/lock.json").read_text(encoding="utf-8")).get("date")
    except (OSError, ValueError):
        return None


def one_try(setup: Setup, mode: str, rng: random.Random, index: int = 0) -> dict:
    """One run cut by 1-5 signals at a point picked by ``mode`` (see the module docstring);
    return its record: ``ok`` and, when not, ``problems`` (what was wrong, in words)."""
    setup.day[0] += 1
    n = setup.day[0]
    day = f"{2000 + n // 336:04d}-{n // 28 % 12 + 1:02d}-{n % 28 + 1:02d}"
    old_day = _lock_date(setup.out)
    tmpdir = setup.work / f"tmp-{index}"
    if tmpdir.exists():
        shutil.rmtree(tmpdir)
    holder = None
    if mode == "lock":  # another process holds the cached base tree's lock
        holder = subprocess.Popen([sys.executable, "-c", "import sys, filelock\n"
                                   "lock = filelock.FileLock(sys.argv[1]); lock.acquire()\n"
                                   "print('held', flush=True); sys.stdin.readline()", str(setup.base_lock)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
    kinds = [rng.choice((signal.SIGINT, signal.SIGTERM)) for _ in range(rng.randint(1, 5))]
    gaps = [rng.uniform(0.0, 0.010) for _ in kinds]
    group = rng.random() < 0.25
    t0 = time.monotonic()
    proc = _start(setup, day, tmpdir)
    lines: list = []
    reached = True
    if mode == "random":
        time.sleep(rng.uniform(0.0, setup.run_s))
    elif mode == "import":
        reached = _wait_for(lambda: _has(tmpdir, "gdn-verify-", "import.out"), proc)
        time.sleep(rng.uniform(0.0, 0.25))
    elif mode == "digest":
        reached = _wait_for(lambda: _has(tmpdir, "gdn-tree-digest-"), proc)
        time.sleep(rng.uniform(0.0, 0.03))
    elif mode == "commit":
        reached = _wait_for(lambda: _lock_date(setup.out) == day, proc)
        time.sleep(rng.uniform(0.0, 0.03))
    elif mode == "lock":
        while True:
            line = proc.stderr.readline()
            lines.append(line)
            if not line or line.startswith("waiting for the cached base tree"):
                reached = bool(line)
                break
        time.sleep(rng.uniform(0.0, 0.2))
    sent = []
    for kind, gap in zip(kinds, gaps):
        if proc.poll() is not None:
            break
        try:
            (os.killpg if group else os.kill)(proc.pid, kind)
            sent.append(kind.name)
        except ProcessLookupError:
            break
        time.sleep(gap)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        err += "\n<killed after 120 s>"
    err = "".join(lines) + err
    wall = time.monotonic() - t0
    if holder is not None:
        holder.communicate("go\n", timeout=30)
    alive = _session(proc.pid)
    if alive:
        time.sleep(GRACE_S)
        alive = _session(proc.pid)
    problems = []
    rc = proc.returncode
    error = next((ln for ln in reversed(err.splitlines()) if ln.startswith("error: ")), "")
    new_day = _lock_date(setup.out)
    committed = new_day == day
    if not sent:
        if rc != 0:
            problems.append(f"no signal was sent (it had finished) but it exited {rc}")
    elif rc == 0:
        if not committed:
            problems.append("exit 0 but the new lock is not in place")
    elif rc in (-signal.SIGINT, -signal.SIGTERM) and not err.strip():
        pass  # ended by the signal before the tool's first line ran (Python's own start-up): nothing made yet
    elif rc not in {CODES[signal.Signals[s]] for s in sent}:
        problems.append(f"exit {rc}, but the signals were {'+'.join(sent)}")
    elif rc != CODES[signal.Signals[sent[0]]] and len(set(sent)) == 1:
        problems.append(f"exit {rc}, but the one kind of signal sent was {sent[0]}")
    if rc in (130, 143):
        want = "error: interrupted while " if rc == 130 else "error: terminated (SIGTERM) while "
        if not error.startswith(want):
            problems.append(f"the message is {error!r}, not {want!r}...")
        says_done = "complete and in place" in error
        if committed and not says_done:
            problems.append(f"the new lock is in place but the message does not say so: {error!r}")
        if not committed and says_done:
            problems.append(f"the message says the new outputs are in place, but they are not: {error!r}")
        if mode == "lock" and reached and not committed and "waiting for the lock" not in error \
                and "cached base tree" in err.split("waiting for", 1)[-1] and "… got" not in err:
            problems.append(f"cut while waiting for the cache lock, the message names another step: {error!r}")
        if "Traceback" in err:
            problems.append("a traceback on stderr")
    if new_day not in (day, old_day):
        problems.append(f"the lock on disk is dated {new_day}, neither the old {old_day} nor the new {day}")
    left = sorted(os.listdir(tmpdir)) if tmpdir.exists() else []
    if left:
        problems.append(f"left in TMPDIR: {left}")
    state = setup.out / "build/.gdn"
    extra = sorted(p for p in (os.listdir(state) if state.exists() else [])
                   if p not in ("output.lock", "output.lock.owner"))
    if extra:
        problems.append(f"left in build/.gdn: {extra}")
    stage = sorted(p.name for p in setup.out.glob(".gdn-stage-*"))
    if stage:
        problems.append(f"left in --out: {stage}")
    if alive:
        problems.append(f"processes of its session alive {GRACE_S:.0f} s after it exited: {alive}")
    if problems and tmpdir.exists():
        shutil.rmtree(tmpdir, ignore_errors=True)  # the next try starts clean
    elif tmpdir.exists():
        tmpdir.rmdir()
    step = error.split(" while ", 1)[1] if " while " in error else None
    first_wins = not sent or rc not in (130, 143) or rc == CODES[signal.Signals[sent[0]]]
    at_start = rc in (-signal.SIGINT, -signal.SIGTERM) and not err.strip()
    return {"try": index, "mode": mode, "reached": reached, "signals": sent, "to": "group" if group else "process",
            "exit": rc, "first_signal_code": first_wins, "ended_at_start": at_start, "committed": committed, "step": step, "wall_s": round(wall, 3), "ok": not problems,
            "problems": problems, **({"stderr_tail": err[-800:]} if problems else {})}


def check_outputs(setup: Setup) -> "str | None":
    """``--check --offline`` of the output folder at its lock's date: None when it passes, else the tail."""
    proc = subprocess.run([sys.executable, str(REPO / "tools/backport"), *setup.args, "--check", "--offline",
                           "--out", str(setup.out)], capture_output=True, text=True,
                          env=_env(setup.work / "tmp-check"))
    shutil.rmtree(setup.work / "tmp-check", ignore_errors=True)
    return None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr[-600:]}"


def _step_kind(step: "str | None") -> str:
    if step is None:
        return "(none)"
    for word in ("waiting for the lock", "complete and in place", "import check", "writing the outputs",
                 "verifying", "starting"):
        if word in step:
            return word
    return step.split(" in ")[0].split(" of ")[0][:40]


def report(records: list, setup: Setup, seconds: float, checks: list, seed: int, files: int) -> dict:
    by_mode = {}
    for mode in MODES:
        rs = [r for r in records if r["mode"] == mode]
        by_mode[mode] = {"tries": len(rs), "failed": sum(not r["ok"] for r in rs),
                         "signalled": sum(bool(r["signals"]) for r in rs),
                         "after_commit": sum(r["committed"] and bool(r["signals"]) and r["exit"] != 0 for r in rs),
                         "code_of_a_later_signal": sum(not r["first_signal_code"] for r in rs),
                         "ended_by_the_signal_at_start": sum(r["ended_at_start"] for r in rs),
                         "exits": {str(k): sum(r["exit"] == k for r in rs) for k in sorted({r["exit"] for r in rs})}}
    steps: dict = {}
    for r in records:
        if r["signals"] and r["exit"] in (130, 143):
            k = _step_kind(r["step"])
            steps[k] = steps.get(k, 0) + 1
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "backport", "tools"],
                                capture_output=True, text=True).stdout.strip())
    return {"tool_commit": head, "tool_tree_dirty": dirty, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
            "python": platform.python_version(), "seed": seed, "padding_files": files,
            "uninterrupted_run_s": round(setup.run_s, 2), "tries": len(records),
            "failed": sum(not r["ok"] for r in records), "check_failures": checks,
            "seconds": round(seconds, 1), "by_mode": by_mode, "cut_steps": dict(sorted(steps.items())),
            "failures": [r for r in records if not r["ok"]][:40]}


def markdown(data: dict) -> str:
    lines = [
        "# Interrupt loop: tools/backport cut by 1-5 signals",
        "",
        f"Tool at commit `{data['tool_commit'][:12]}`{' (with uncommitted changes)' if data['tool_tree_dirty'] else ''}, "
        f"{data['date']}, on {data['machine']} (Python {data['python']}); fake repositories with a Bridge tree "
        f"padded with {data['padding_files']} files (an uninterrupted run: {data['uninterrupted_run_s']} s), "
        f"seed {data['seed']}. Made by `bench/interrupt_loop.py --tries {data['tries']}`; what each try asserts is "
        "in that script's docstring.",
        "",
        f"**{data['tries'] - data['failed']} of {data['tries']} tries passed**"
        f" ({data['seconds']:.0f} s); `--check --offline` of the output folder after every 20 tries: "
        + ("passed every time." if not data["check_failures"] else f"{len(data['check_failures'])} failures."),
        "",
        "| mode | tries | signalled | cut after the commit point | exit codes | code of a later signal (sent together) "
        "| ended by the signal in Python's start-up | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, m in data["by_mode"].items():
        exits = ", ".join(f"{k}: {v}" for k, v in m["exits"].items())
        lines.append(f"| {mode} | {m['tries']} | {m['signalled']} | {m['after_commit']} | {exits} | "
                     f"{m['code_of_a_later_signal']} | {m['ended_by_the_signal_at_start']} | {m['failed']} |")
    lines += ["", "Exit -2 / -15 (the shell's 130 / 143) is a process ended by the signal before any line of "
              "`tools/backport` ran (Python's own start-up, before a handler can exist): accepted only with "
              "nothing on stderr and nothing left behind."]
    lines += ["", "Steps named by the messages of the interrupted tries:", "",
              "| step (kind) | tries |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in data["cut_steps"].items()]
    if data["failures"]:
        lines += ["", "First failures:", ""]
        lines += [f"- try {r['try']} ({r['mode']}, {'+'.join(r['signals'])} to the {r['to']}): exit {r['exit']}; "
                  + "; ".join(r["problems"]) for r in data["failures"][:15]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tries", type=int, default=200)
    ap.add_argument("--files", type=int, default=1500, help="padding files in the fake Bridge tree")
    ap.add_argument("--seed", type=int, default=45)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--out", default=str(REPO / "results/pipeline/interrupt-loop"),
                    help="writes OUT.json and OUT.md ('-': print the JSON only)")
    ap.add_argument("--work", help="scratch folder (default: a temporary one, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = ap.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="interrupt-loop-"))
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    try:
        setup = make_setup(work, args.files)
        records, checks = [], []
        for i in range(args.tries):
            mode = args.modes[i % len(args.modes)]
            rec = one_try(setup, mode, rng, i)
            records.append(rec)
            print(f"{i + 1:4d}/{args.tries} {mode:7s} {'+'.join(rec['signals']) or '-':40s} exit {rec['exit']:4} "
                  f"{'ok' if rec['ok'] else 'FAILED: ' + '; '.join(rec['problems'])}", flush=True)
            if (i + 1) % 20 == 0 or i + 1 == args.tries:
                problem = check_outputs(setup)
                if problem:
                    checks.append({"after_try": i, "problem": problem})
                    print(f"     --check after try {i}: {problem}", flush=True)
        data = report(records, setup, time.monotonic() - t0, checks, args.seed, args.files)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.out == "-":
        print(json.dumps(data, indent=2))
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        Path(args.out + ".md").write_text(markdown(data), encoding="utf-8")
        print(f"wrote {args.out}.json and {args.out}.md: {data['tries'] - data['failed']} of {data['tries']} passed")
    return 0 if data["failed"] == 0 and not data["check_failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
