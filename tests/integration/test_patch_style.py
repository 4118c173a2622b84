"""The patched tree's changed files pass upstream Megatron-LM's own format and lint settings.

Settings come from the upstream commit itself (``pyproject.toml``'s ``[tool.black]`` and
``[tool.isort]``, and ``.pylintrc`` at 5139086e, read from the Megatron-LM mirror): black 24
(line length 100, no string normalisation, no magic trailing comma), isort (profile black) and
pylint 3.2.6 with upstream's enabled checks (docstrings, unused imports, line length,
possibly-used-before-assignment, print). Every ``.py`` file the patch adds or changes must be
clean where its base version is clean, and no added line may exceed 100 columns.

Needs ``build/tree/{base,patched}`` and ``patches/latest/megatron.patch`` (``make patch``) and
the mirror; skips, saying which is missing, otherwise.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from backport.cache import default_cache_dir

REPO = Path(__file__).resolve().parents[2]
TREES = REPO / "build" / "tree"
PATCH = REPO / "patches" / "latest" / "megatron.patch"
UPSTREAM = "5139086e7f1240f51ccdf97b244293dd133d6323"
TOOLS = Path(sys.executable).parent


def _mirror():
    value = os.environ.get("MEGATRON_LM_REPO")
    if value and Path(value).exists():
        return value
    cached = default_cache_dir() / "megatron-lm.git"
    return str(cached) if (cached / "HEAD").exists() else None


MLM = _mirror()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not (PATCH.is_file() and (TREES / "patched" / "megatron").is_dir()),
                       reason="no patches/latest/megatron.patch or build/tree/patched: run `make patch` first"),
    pytest.mark.skipif(MLM is None, reason="no Megatron-LM mirror (MEGATRON_LM_REPO or the tool's cache) "
                                           "to read upstream's black/isort/pylint settings from"),
    pytest.mark.skipif(not all((TOOLS / t).exists() for t in ("black", "isort", "pylint")),
                       reason="black/isort/pylint not installed: pip install -e '.[test]'"),
]


@pytest.fixture(scope="module")
def upstream_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("upstream-style")
    for name in ("pyproject.toml", ".pylintrc"):
        data = subprocess.run(["git", "--git-dir", MLM, "show", f"{UPSTREAM}:{name}"], check=True,
                              capture_output=True).stdout
        (folder / name).write_bytes(data)
    return folder


def _changed_python_files() -> list[str]:
    text = PATCH.read_text(encoding="utf-8")
    return sorted(set(re.findall(r"^\+\+\+ b/(\S+\.py)$", text, flags=re.M)))


def _clean(tool: list[str], path: Path) -> bool:
    return subprocess.run(tool + [str(path)], capture_output=True, cwd=path.parent).returncode == 0


def test_added_lines_fit_upstreams_line_length():
    long = [(f, len(ln) - 1) for f, ln in _added_lines() if len(ln) - 1 > 100]
    assert not long, f"added lines over 100 columns: {long}"


def _added_lines():
    current = None
    for line in PATCH.read_text(encoding="utf-8").splitlines():
        if line.startswith("+++ b/"):
            current = line[6:]
        elif line.startswith("+") and not line.startswith("+++") and current and current.endswith(".py"):
            yield current, line


@pytest.mark.parametrize("tool", ["black", "isort"])
def test_changed_files_are_formatted_as_upstream_formats(upstream_config, tool):
    cfg = upstream_config / "pyproject.toml"
    cmd = {"black": [str(TOOLS / "black"), "--config", str(cfg), "--check", "-q"],
           "isort": [str(TOOLS / "isort"), "--settings-path", str(cfg), "--check-only", "-q"]}[tool]
    files = _changed_python_files()
    assert files
    dirty = [f for f in files if not _clean(cmd, TREES / "patched" / f)
             and (not (TREES / "base" / f).exists() or _clean(cmd, TREES / "base" / f))]
    assert not dirty, f"{tool} with upstream's settings would reformat: {dirty}"


def test_changed_files_pass_upstreams_pylint_checks(upstream_config):
    rc = upstream_config / ".pylintrc"

    files = _changed_python_files()

    def messages(tree: Path) -> dict:
        """``{file: {"path:msg_id:obj", ...}}``: one pylint process per tree, all files at once
        (pylint's start-up dominated when run once per file and tree)."""
        present = [f for f in files if (tree / f).exists()]
        out = subprocess.run([str(TOOLS / "pylint"), "--rcfile", str(rc), "--score=n",
                              "--msg-template={path}:{msg_id}:{obj}", *present],
                             capture_output=True, text=True, cwd=tree).stdout if present else ""
        found = {f: set() for f in files}
        for ln in out.splitlines():
            path = ln.split(":", 1)[0]
            if path in found and re.match(r"^megatron/.*:[CWE]\d+:", ln):
                found[path].add(ln)
        return found

    patched, base = messages(TREES / "patched"), messages(TREES / "base")
    new = {f: sorted(patched[f] - base[f]) for f in files}
    new = {f: m for f, m in new.items() if m}
    assert not new, f"pylint (upstream's .pylintrc) finds new problems: {new}"
