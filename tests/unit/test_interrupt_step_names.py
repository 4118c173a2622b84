"""The step an interrupt names is the step the run was at, never a warning it printed on the way
(``error: terminated (SIGTERM) while warning: upstream hunk ... placed at offset -95 lines``)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from backport import cli as cli_mod
from backport import engine, interrupts, output


def test_an_interrupt_after_a_warning_names_the_step_not_the_warning(tmp_path, monkeypatch):
    out = tmp_path / "out"
    (out / "manifests").mkdir(parents=True)
    (out / output.LOCK).write_text(json.dumps({"date": "2026-01-02"}), encoding="utf-8")

    def build(opts, progress=None):
        progress("applying the recipe")
        progress("warning: upstream hunk megatron/x.py#2 placed at offset -95 lines")
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "build", build)
    monkeypatch.setitem(interrupts.STEP, "now", "starting")
    result = CliRunner().invoke(cli_mod.cli, ["--out", str(out), "--no-import-check", "--no-trees"])
    assert result.exit_code == 130, result.output
    assert "error: interrupted while applying the recipe\n" in result.stderr, result.stderr
    assert "while warning" not in result.stderr
