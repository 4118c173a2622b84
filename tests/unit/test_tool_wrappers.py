"""tools/backport and tools/image work as the README writes them, outside an activated venv.

Run with the base interpreter (no project packages): they re-execute with the repo's
``.venv`` when it exists; without one they stop with ``error:`` + a ``hint:`` naming
``make venv`` (exit 1), never a traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASE_PYTHON = getattr(sys, "_base_executable", None)


def _bare_python_lacks_packages() -> bool:
    if not BASE_PYTHON or not Path(BASE_PYTHON).exists():
        return False
    probe = subprocess.run([BASE_PYTHON, "-c", "import rich, click, git"], capture_output=True)
    return probe.returncode != 0


needs_bare = pytest.mark.skipif(not _bare_python_lacks_packages(),
                                reason="the base interpreter already has the project's packages")


@needs_bare
@pytest.mark.parametrize("tool", ["backport", "image"])
def test_without_a_venv_the_wrapper_says_make_venv(tmp_path, tool):
    (tmp_path / "tools" / "lib").mkdir(parents=True)
    shutil.copy(REPO / "tools" / tool, tmp_path / "tools" / tool)
    shutil.copy(REPO / "tools" / "lib" / "venv_entry.py", tmp_path / "tools" / "lib" / "venv_entry.py")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "GDN_VENV_REEXEC", "PYTHONPATH")}
    res = subprocess.run([BASE_PYTHON, str(tmp_path / "tools" / tool), "--help"], capture_output=True, text=True,
                         env=env)
    assert res.returncode == 1
    assert res.stdout == ""
    assert res.stderr.startswith(f"error: tools/{tool}: ")
    assert "Traceback" not in res.stderr
    assert "hint: run `make venv`" in res.stderr


@needs_bare
@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").exists(), reason="no .venv in this checkout")
@pytest.mark.parametrize("tool, needle", [("backport", "Usage: tools/backport"), ("image", "Usage: tools/image")])
def test_with_the_venv_the_wrapper_uses_it(tool, needle):
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "GDN_VENV_REEXEC", "PYTHONPATH")}
    res = subprocess.run([BASE_PYTHON, str(REPO / "tools" / tool), "--help"], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert needle in res.stdout


def test_the_readmes_training_example_builds_a_config_on_the_patched_tree():
    """README "Training with the image": its TransformerConfig example runs on build/tree/patched,
    and the mode it documents as absent ('auto') fails fast with LinearCPError."""
    import re

    tree = REPO / "build" / "tree" / "patched"
    if not (tree / "megatron" / "core").is_dir():
        pytest.skip("needs build/tree/patched (run `make patch`)")
    section = (REPO / "README.md").read_text().split("## Training with the image", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"\n((?:    .*\n|\n)+)", section.split("| `all_gather` |", 1)[1]).group(1)
    code = "\n".join(line[4:] for line in block.splitlines())
    probe = code + (
        "\nassert config.linear_cp_mode == 'chunkwise' and config.context_parallel_size == 2\n"
        "import dataclasses\n"
        "from megatron.core.ssm.gdn_context_parallel import LinearCPError\n"
        "try:\n"
        "    TransformerConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)\n"
        "                         if f.init and f.name not in ('linear_cp_mode',)}, linear_cp_mode='auto')\n"
        "except LinearCPError:\n"
        "    print('auto refused')\n")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "auto refused" in proc.stdout
