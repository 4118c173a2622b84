"""Signals: the first SIGINT/SIGTERM stops a run with 130/143 naming the step; later ones never
cut its clean-up; every temporary folder goes; no child is left (backport/interrupts.py).

Two layers: the module's rules in this process (a signal inside a shielded region is held; a
burst of signals acts as one; a lock wait is named), and a few tries of the interrupt loop
(bench/interrupt_loop.py, whose 200-try result is results/pipeline/interrupt-loop.md): a real
``tools/backport`` process cut by 1-5 signals during the import check, during the tree digest,
after the commit point and while it waits for a cache lock.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import sys
from pathlib import Path

import pytest

from backport import interrupts, tree_digest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def handlers():
    """The tool's handlers in this process for the test, pytest's put back after."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as if not inherited ignored
    interrupts.install()
    yield
    for s, h in before.items():
        signal.signal(s, h)
    interrupts._state.update(held=None, raised_at=None, closing=False, depth=0)  # nothing carried to other tests


def _kill_self(signum=signal.SIGTERM):
    os.kill(os.getpid(), signum)


def test_a_signal_in_a_shielded_region_is_raised_when_it_ends(handlers):
    done = []
    with pytest.raises(interrupts.Terminated):
        with interrupts.shielded():
            _kill_self()
            _kill_self(signal.SIGINT)
            done.append("the region ran to its end")
    assert done


def test_a_burst_of_signals_is_one_interrupt_and_the_clean_up_runs_to_its_end(handlers):
    cleaned = []
    with pytest.raises(KeyboardInterrupt) as exc:
        try:
            _kill_self(signal.SIGINT)
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
                _kill_self(signum)  # ignored: the run is already stopping
            cleaned.append(True)
    assert cleaned and not isinstance(exc.value, interrupts.Terminated)  # the first one counts: 130
    assert interrupts.exit_code(exc.value) == 130


def test_the_tree_digest_folder_goes_whole_when_a_signal_cuts_its_removal(handlers, tmp_path, monkeypatch):
    """The 1-in-10 case of issue 45, made certain: SIGTERM arrives while the digest's temporary
    copy is being removed (after its first file went)."""
    base = tmp_path / "base"
    (base / "megatron" / "core").mkdir(parents=True)
    for i in range(30):
        (base / "megatron" / "core" / f"m{i}.py").write_text(f"X = {i}\n")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", None)
    real = interrupts.shutil.rmtree

    def cut(path, *a, **k):
        files = sorted(Path(path).rglob("*.py"))
        if files:
            files[0].unlink()
            _kill_self()
        return real(path, *a, **k)

    monkeypatch.setattr(interrupts.shutil, "rmtree", cut)
    with pytest.raises(interrupts.Terminated):
        tree_digest.lock_fields(base, b"--- a/megatron/core/m0.py\n+++ b/megatron/core/m0.py\n@@ -1 +1 @@\n-X = 0\n"
                                      b"+X = 100\n")
    assert os.listdir(tmp_path / "tmp") == []


def test_a_lock_wait_is_the_step_an_interrupt_names(handlers):
    interrupts.step("opening sources")
    with pytest.raises(KeyboardInterrupt):
        with interrupts.during("waiting for the lock of the cache x"):
            _kill_self(signal.SIGINT)
    code, text = interrupts.message(KeyboardInterrupt())
    assert code == 130 and text.startswith("error: interrupted while waiting for the lock of the cache x\nhint: ")


def test_after_the_commit_point_the_message_says_the_new_outputs_are_in_place(handlers):
    interrupts.step("writing the outputs to /o")
    interrupts.committed("/o (dated 2026-01-02)")
    code, text = interrupts.message(interrupts.Terminated())
    assert code == 143
    assert "after the commit point: the new outputs in /o (dated 2026-01-02) are complete and in place" in text
    assert "Nothing to run again" in text


def test_finish_removes_every_registered_folder_and_reports_a_late_signal(handlers, tmp_path):
    made = interrupts.make_folder("gdn-test-", dir=tmp_path)
    (made / "f").write_text("x")
    with interrupts.shielded():
        interrupts._state["closing"] = True  # as finish() sets it: a signal now is only recorded
        _kill_self()
    late = interrupts.finish()
    assert late == signal.SIGTERM and not made.exists()
    _kill_self()  # after finish: recorded only, never raised (and no "ignored due to race condition")
    interrupts.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers found at install


# --- a real tools/backport cut by signals: a few tries of the loop ------------------------------

def _loop():
    spec = importlib.util.spec_from_file_location("bench_interrupt_loop", REPO / "bench" / "interrupt_loop.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    mod = _loop()
    return mod, mod.make_setup(tmp_path_factory.mktemp("interrupt-loop"), files=300, measure=False)


@pytest.mark.parametrize("mode,seed", [("import", 3), ("digest", 1), ("commit", 2), ("lock", 5)])
def test_a_run_cut_by_signals_leaves_nothing_and_names_its_step(loop, mode, seed):
    mod, setup = loop
    rec = mod.one_try(setup, mode, random.Random(seed))
    assert rec["signals"], rec  # the point was reached while the run went on
    assert rec["ok"], rec
    assert rec["exit"] in (0, 130, 143)
