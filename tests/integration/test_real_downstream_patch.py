"""A real-sized downstream patch carries (issue 23, "done when"; skips, saying why, without mirrors).

The carry is made at run time from the pinned base tree (never committed), the way a
downstream image's ``megatron.patch`` looks after years of hand edits:

* 24 files: 20 modules the recipe does not touch (a comment line after the module docstring
  or first import, and in every fourth file a changed line of code), two executable (755)
  modules, the GDN config and ``gated_delta_net.py`` itself;
* in ``gated_delta_net.py`` Dynamo disabled at the call site
  (``with torch._dynamo.config.patch(disable=True):`` around the helper call, the helper keeping
  ``@jit_fuser``), the downstream form of decision 7a;
* two file sections hand-edited down to ``---``/``+++`` with a date after a tab and no
  ``diff --git`` or ``index`` line.

The run must exit 0 and every carried file the recipe leaves alone must equal what
``git apply`` makes of the carry, file for file, mode included.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from backport import engine, options

from test_real_mirrors import BRIDGE, MLM, RECIPE  # noqa: F401  (same mirror discovery and skip)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(MLM is None or BRIDGE is None,
                       reason="no Megatron-LM/Megatron-Bridge mirror: set MEGATRON_LM_REPO and MEGATRON_BRIDGE_REPO "
                              "(or run tools/backport once to fill the cache)"),
]
ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": "/nonexistent", "TZ": "UTC",
       "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}
GDN = "megatron/core/ssm/gated_delta_net.py"
CONFIG = "megatron/core/transformer/transformer_config.py"
CALL = ("        query, key, value, gate, beta, alpha = self._prepare_qkv_for_gated_delta_rule(\n"
        "            qkv, gate, beta, alpha, batch, seq_len\n        )\n")
GUARDED = ("        with torch._dynamo.config.patch(disable=True):\n"
           "            query, key, value, gate, beta, alpha = self._prepare_qkv_for_gated_delta_rule(\n"
           "                qkv, gate, beta, alpha, batch, seq_len\n            )\n")


def _git(cwd: Path, *args: str, data: bytes | None = None) -> bytes:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@localhost", *args], cwd=cwd, check=True,
                          capture_output=True, input=data, env={**os.environ, **ENV}).stdout


def _recipe_paths() -> set:
    import yaml

    steps = yaml.safe_load(RECIPE.read_text())["steps"]
    return {s["path"] for s in steps if "path" in s} | {"megatron/core/ssm/gated_delta_net.py",
                                                        "megatron/core/transformer/transformer_config.py"}


def _pick(base: Path) -> tuple[list, list]:
    """20 plain modules and 2 executable ones the recipe leaves alone, deterministically."""
    skip = _recipe_paths()
    files = sorted(p.relative_to(base).as_posix() for p in (base / "megatron" / "core").rglob("*.py")
                   if p.stat().st_size > 400)
    files = [f for f in files if f not in skip]
    execs = [f for f in files if os.stat(base / f).st_mode & stat.S_IXUSR][:2]
    plain = [f for f in files if f not in execs][::max(1, len(files) // 20)][:20]
    assert len(plain) == 20 and len(execs) == 2, (len(plain), execs)
    return plain, execs


def _edit(text: str, n: int, path: str) -> str:
    lines = text.splitlines(keepends=True)
    at = next((i for i, line in enumerate(lines) if line.startswith(("import ", "from ", "class ", "def "))), 1)
    lines.insert(at, f"# downstream {n}: carried in our image ({path})\n")
    if n % 4 == 0:  # a changed line of code, not only a comment
        code = next((i for i, line in enumerate(lines) if line.startswith("    return ") and i > at), None)
        if code is not None:
            lines[code] = lines[code].rstrip("\n") + "  # downstream: checked\n"
    return "".join(lines)


def _hand_edit(carry: str, paths: list) -> str:
    """Turn the sections of ``paths`` into hand-edited ones: no diff --git/index lines, dates after
    a tab on ---/+++ (as `diff -u` writes them)."""
    out, keep = [], True
    for line in carry.splitlines(keepends=True):
        if line.startswith("diff --git "):
            keep = not any(line.startswith(f"diff --git a/{p} b/{p}") for p in paths)
            if not keep:
                continue
        if not keep and line.startswith("index "):
            continue
        if not keep and line.startswith(("--- a/", "+++ b/")):
            line = line.rstrip("\n") + "\t2024-05-01 10:00:00.000000000 +0200\n"
        out.append(line)
    return "".join(out)


def _copy(base: Path, dest: Path, paths) -> None:
    for rel in paths:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(base / rel, dest / rel)


def test_a_real_sized_hand_edited_downstream_patch_carries_like_git_apply(tmp_path, real_cache):
    cache = real_cache
    plain_build = engine.build(options.Options(recipe=RECIPE, megatron_lm=MLM, megatron_bridge=BRIDGE,
                                               cache_dir=cache, date="20261130", import_check=False))
    base = plain_build.base_tree
    plain, execs = _pick(base)
    carried = plain + execs + [CONFIG, GDN]
    src = tmp_path / "src"
    _copy(base, src, carried)
    _git(src, "init", "-q")
    _git(src, "-c", "core.filemode=true", "add", "-A")
    _git(src, "commit", "-qm", "base")
    for n, rel in enumerate(plain + execs):
        (src / rel).write_text(_edit((src / rel).read_text(), n, rel))
    gdn = (src / GDN).read_text()
    assert CALL in gdn and "    @jit_fuser\n    def _prepare_qkv_for_gated_delta_rule(" in gdn, "the base changed"
    (src / GDN).write_text(gdn.replace(CALL, GUARDED, 1))
    cfg = (src / CONFIG).read_text()
    (src / CONFIG).write_text(cfg.replace("@dataclass\n@experimental_api\nclass TransformerConfig(",
                                          "# downstream: our config\n@dataclass\n@experimental_api\n"
                                          "class TransformerConfig(", 1))
    assert (src / CONFIG).read_text() != cfg, "the base config changed"
    text = _git(src, "-c", "core.filemode=true", "diff", "--full-index").decode()
    sections = text.count("diff --git")
    text = _hand_edit(text, [plain[3], plain[11]])
    assert text.count("diff --git") == sections - 2
    carry = tmp_path / "downstream.patch"
    carry.write_text(text)

    # what git apply makes of it, on the pristine files
    expected = tmp_path / "expected"
    _copy(base, expected, carried)
    _git(expected, "init", "-q")
    _git(expected, "apply", "--whitespace=nowarn", str(carry))

    b = engine.build(options.Options(recipe=RECIPE, megatron_lm=MLM, megatron_bridge=BRIDGE, cache_dir=cache,
                                     date="20261130", carry=carry, import_check=False))
    checks = {c["check"]: c for c in b.manifest["verification"]}
    assert checks["carry_survival"]["ok"], checks["carry_survival"]["detail"]
    assert b.manifest["origins"]["fix-prepare-qkv-no-dynamo"]["status"] == "already-present"

    # the output patch on the pristine tree, as the image applies it
    patched = tmp_path / "patched"
    shutil.copytree(base, patched, symlinks=True)
    subprocess.run(["patch", "-p1", "--fuzz=0", "--batch", "--no-backup-if-mismatch"], cwd=patched,
                   input=b.patch, check=True, capture_output=True)
    for rel in plain + execs:
        assert (patched / rel).read_bytes() == (expected / rel).read_bytes(), rel
        assert os.stat(patched / rel).st_mode & 0o777 == os.stat(expected / rel).st_mode & 0o777, rel
    for rel in execs:
        assert os.stat(patched / rel).st_mode & stat.S_IXUSR, f"{rel} lost its executable bit"
    new_gdn = (patched / GDN).read_text()
    assert "with torch._dynamo.config.patch(disable=True):" in new_gdn
    assert "    @jit_fuser\n    def _prepare_qkv_for_gated_delta_rule(" in new_gdn
    assert "# downstream: our config\n" in (patched / CONFIG).read_text()
    # git apply --check of our own output is silent (modes and names as git writes them)
    check = tmp_path / "check"
    shutil.copytree(base, check, symlinks=True)
    _git(check, "init", "-q")
    proc = subprocess.run(["git", "apply", "--check", "-"], cwd=check, input=b.patch, capture_output=True,
                          env={**os.environ, **ENV})
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr.decode()[-2000:]
