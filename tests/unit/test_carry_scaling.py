"""Carries cost O(hunks + lines) (issue 36, point 1), and a carried hunk whose context matches
more than once goes where ``git apply`` puts it (issue 36, point 4).

Linearity is tested by structure, not by timing: every Python parse goes through ``ast.parse``,
which the tests count; a file's parses must not grow with its number of hunks. Small base trees
and carries of our own, made with git itself (fixed identity, UTC); the repeated-context cases
are compared with ``git apply`` on the same files.
"""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from backport import workspace
from backport.carry import CarryRefused, carried_tree, carry_workspace, git_apply_tree, load_carry
from backport.engine import build
from backport.errors import ApplyError
from backport.manifest_md import render_markdown
from backport.verify import carry_survival
from backport.workspace import SymbolMap, _matches, enclosing_symbol, symbol_spans

from conftest import GIT_ENV, gdn_text

MODULE = "m.py"


def _git(cwd: Path, *args: str) -> bytes:
    env = {**os.environ, **GIT_ENV, "HOME": "/nonexistent"}
    return subprocess.run(["git", "-c", "core.autocrlf=false", *args], cwd=cwd, env=env, check=True,
                          capture_output=True).stdout


def _carry(tmp: Path, base: dict, after: dict, context: int = 3) -> tuple[Path, Path]:
    """(carry, base tree): ``git diff -U<context>`` taking the files ``base`` to ``after``."""
    repo = tmp / "repo"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q")
    for rel, text in base.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    for rel, text in after.items():
        (repo / rel).write_text(text)
    patch = _git(repo, "diff", f"-U{context}")
    _git(repo, "checkout", "-q", "--", ".")
    carry = tmp / "carry.patch"
    carry.write_bytes(patch)
    return carry, repo


def _module(functions: int) -> str:
    return '"""m."""\n' + "".join(f"\n\ndef f{i}(x):\n    a = x + {i}\n    b = a * 2\n    c = b - 1\n"
                                   f"    d = c + a\n    e = d * b\n    return e\n" for i in range(functions))


def _commented(text: str, functions: int) -> str:
    """``text`` with a comment line before ``b = ...`` in the first ``functions`` functions."""
    for i in range(functions):
        text = text.replace(f"    b = a * 2\n    c = b - 1\n    d = c + a\n    e = d * b\n    return e\n\n\ndef f{i + 1}(",
                            f"    # note {i}\n    b = a * 2\n    c = b - 1\n    d = c + a\n    e = d * b\n    return e\n"
                            f"\n\ndef f{i + 1}(", 1)
    return text


@pytest.fixture
def parses(monkeypatch):
    """Counts ``ast.parse`` calls (every symbol/binding map parses through it)."""
    count = [0]
    real = ast.parse

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(ast, "parse", counting)
    return count


# --- point 1: parses per file do not grow with the hunks -------------------------------------------

def _carry_and_survival_parses(tmp: Path, hunks: int, parses) -> tuple[int, int]:
    base = _module(40)
    carry, tree = _carry(tmp, {MODULE: base}, {MODULE: _commented(base, hunks)})
    assert sum(1 for line in carry.read_text().splitlines() if line.startswith("@@ ")) == hunks
    parses[0] = 0
    model, ws = carry_workspace(carry, tree)
    applied = parses[0]
    run = SimpleNamespace(carry_model=model, ws=ws, carried_text={MODULE: ws.files[MODULE].text}, origins={})
    parses[0] = 0
    check = carry_survival(run)
    assert check["ok"] and check["detail"].startswith(f"{hunks} carried hunk(s)")
    return applied, parses[0]


def test_a_carried_file_is_parsed_a_fixed_number_of_times_whatever_its_hunk_count(tmp_path, parses):
    few = _carry_and_survival_parses(tmp_path / "few", 2, parses)
    many = _carry_and_survival_parses(tmp_path / "many", 30, parses)
    # placement: the base file once (every hunk's symbol, every match's symbol through the line
    # tags), the carried file once (line symbols); survival: the output once (here the carried file)
    assert few == many == (2, 1)


def test_the_whole_engine_parses_as_often_for_one_carried_hunk_a_file_as_for_three(tmp_path, recipe, make_options,
                                                                                   parses):
    """Through build(): carry, recipe steps on a carried file (merges, binding checks), the
    determinism run, carry_survival. Comments in GatedDeltaNet.__init__ (a file the recipe's
    steps change) and in a file no step touches."""
    gdn = gdn_text()
    config = (Path(__file__).parent / "data" / "transformer_config.py").read_text()

    def counted(name: str, n: int) -> int:
        g, c = gdn, config
        for k, anchor in enumerate(["        self.config = config\n", "        self.built = True\n",
                                    "        heads = qkv // self.cp_size\n"][:n]):
            g = g.replace(anchor, f"        # note {k}\n" + anchor, 1)
        lines = c.splitlines(True)
        for k, at in enumerate(sorted([19, 12, 5][:n], reverse=True)):
            lines.insert(at, lines[at][:len(lines[at]) - len(lines[at].lstrip())] + f"# config note {k}\n")
        c = "".join(lines)
        carry, _ = _carry(tmp_path / name, {"megatron/core/ssm/gated_delta_net.py": gdn,
                                            "megatron/core/transformer/transformer_config.py": config},
                          {"megatron/core/ssm/gated_delta_net.py": g,
                           "megatron/core/transformer/transformer_config.py": c}, context=1)
        assert carry.read_text().count("\n@@ ") == 2 * n, carry.read_text()
        parses[0] = 0
        b = build(make_options(recipe, carry=carry, cache_dir=tmp_path / "cache"))
        assert len(b.manifest["carry"]["hunks"]) == 2 * n
        assert {c["check"]: c["ok"] for c in b.manifest["verification"]}["carry_survival"]
        return parses[0]

    counted("warm", 1)  # the first build fills the cache (its own parses are not the question)
    assert counted("one", 1) == counted("three", 3)


def test_symbol_map_agrees_with_enclosing_symbol_on_every_line():
    text = ("import os\n\n\n@dec\nclass A:\n    x = 1\n\n    @property\n    def f(self):\n        def g():\n"
            "            return 1\n        return g\n\n    def f(self):\n        return 2\n\n\ndef h():\n    pass\n"
            "\n\nclass A:\n    pass\n")
    spans, fast = symbol_spans(text), SymbolMap(text)
    assert [fast.at(i) for i in range(-1, 30)] == [enclosing_symbol(spans, i) for i in range(-1, 30)]
    assert fast.at(10) == "A.f.g" and fast.at(14) == "A.f[2]" and fast.at(21) == "A[2]" and fast.at(1) == ""
    assert fast.span("A") == (3, 14) and fast.span("nope") is None
    broken = SymbolMap("def f(:\n")
    assert not broken.valid and broken.at(0) is None and enclosing_symbol(symbol_spans("def f(:\n"), 0) is None


@pytest.mark.parametrize("lines, source", [
    (["a\n", "b\n", "a\n", "b\n", "a\n"], ["a\n", "b\n"]),
    (["a\n", "b\n"], ["a\n", "b\n", "c\n"]),
    (["x\n"] * 5, ["x\n", "x\n"]),
    ([], ["x\n"]),
    (["a\n", "b\n", "c\n"], ["c\n"]),
])
def test_matches_finds_every_position_a_slice_scan_finds(lines, source):
    slow = [i for i in range(len(lines) - len(source) + 1) if lines[i:i + len(source)] == source]
    assert _matches(lines, source) == slow


# --- point 4: repeated context goes where git apply puts it -------------------------------------------

REPEATED = "def f(x):\n" + "    a = 1\n    b = 2\n    c = 3\n    d = 4\n" * 3 + "    return x\n"


def _reference(carry: Path, tree: Path) -> dict:
    ref, message = git_apply_tree(load_carry(carry), tree)
    assert ref is not None, message
    return ref


def test_a_hunk_whose_context_matches_three_times_goes_at_its_header_line_as_git_apply(tmp_path):
    # -U1 around the middle copy: its context "    a = 1"/"    c = 3" occurs three times in f
    after = REPEATED.replace("    b = 2\n", "    b = 20\n", 2).replace("    b = 20\n", "    b = 2\n", 1)
    carry, tree = _carry(tmp_path, {MODULE: REPEATED}, {MODULE: after}, context=1)
    assert "@@ -6,3 +6,3 @@" in carry.read_text()
    model, ws = carry_workspace(carry, tree)
    assert ws.files[MODULE].text == after
    assert carried_tree(carry, tree) == _reference(carry, tree)


def test_the_manifest_records_a_hunk_placed_by_its_header(tmp_path, recipe, make_options):
    """Through build(): a comment between the two blank lines before ``def helper_2`` of utils.py,
    ``-U1``: its context (two blank lines) matches before every def of the module."""
    from conftest import _utils

    base = _utils()
    after = base.replace("\n\ndef helper_2", "\n# between the helpers\n\ndef helper_2")
    carry, _ = _carry(tmp_path, {"megatron/core/utils.py": base}, {"megatron/core/utils.py": after}, context=1)
    messages: list = []
    b = build(make_options(recipe, carry=carry), progress=messages.append)
    oid = "carry:megatron/core/utils.py#1"
    record = b.manifest["origins"][oid]
    starts = [i + 1 for i, line in enumerate(base.splitlines(True)[:-1]) if line == "\n" == base.splitlines(True)[i + 1]]
    assert record["placed"] == "header" and record["matches"] == starts and record["offset"] == 0, record
    assert "+# between the helpers" in b.patch.decode()
    assert sum(f"warning: carried hunk {oid}: its context matches at lines" in m for m in messages) == 1, messages
    md = render_markdown(b.manifest)
    assert (f"Its context matches at lines {', '.join(map(str, starts))} of the base: placed at the line its header "
            "names, as `git apply` does.") in md


def _moved_header(carry: Path, old: str, new: str) -> Path:
    text = carry.read_text()
    assert old in text
    carry.write_text(text.replace(old, new))
    return carry


def test_a_hunk_whose_header_names_no_match_goes_to_the_nearest_one_as_git_apply(tmp_path):
    after = REPEATED.replace("    c = 3\n", "    c = 30\n", 1)  # the first copy
    carry, tree = _carry(tmp_path, {MODULE: REPEATED}, {MODULE: after}, context=1)
    _moved_header(carry, "@@ -3,3 +3,3 @@", "@@ -4,3 +4,3 @@")  # one line below the first copy
    ws = carry_workspace(carry, tree)[1]
    assert ws.files[MODULE].text == after
    assert carried_tree(carry, tree) == _reference(carry, tree)


def test_two_matches_equally_near_the_header_are_refused_naming_every_candidate(tmp_path):
    after = REPEATED.replace("    c = 3\n", "    c = 30\n", 1)
    carry, tree = _carry(tmp_path, {MODULE: REPEATED}, {MODULE: after}, context=1)
    _moved_header(carry, "@@ -3,3 +3,3 @@", "@@ -5,3 +5,3 @@")  # two lines from the first and the second copy
    with pytest.raises(ApplyError) as exc:
        carried_tree(carry, tree)
    msg = exc.value.message
    assert exc.value.exit_code == 6 and not isinstance(exc.value, CarryRefused)
    assert "matches 3 times inside f (lines 3, 7, 11 of the base)" in msg, msg
    assert "none is at line 5, the line its header names, and lines 3 and 7 are equally near it" in msg, msg
    assert "-U5" not in exc.value.hint and "@@ line" in exc.value.hint


def test_upstream_hunks_with_repeated_context_are_still_refused():
    """Only carried hunks are placed by their header (an upstream hunk's header counts lines of
    another file: upstream's)."""
    from unidiff import PatchSet

    diff = "--- a/m.py\n+++ b/m.py\n@@ -6,3 +6,3 @@\n     a = 1\n-    b = 2\n+    b = 20\n     c = 3\n"
    (hunk,) = [h for f in PatchSet(diff) for h in f]
    with pytest.raises(ApplyError) as exc:
        workspace.FileState.from_base(MODULE, REPEATED).apply_hunk(hunk, "m.py#1", source_symbol="f")
    assert exc.value.reason == "twice" and "the tool does not guess which" in exc.value.message
