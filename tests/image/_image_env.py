"""Environment probing for the image suite: which tree is used, and what is missing.

Imported by ``conftest.py`` (which first puts ``$GDN_TREE`` on ``sys.path``) and by the
tests. ``need_*`` skip with the precise reason when a prerequisite is absent.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GDN_TREE = Path(os.environ.get("GDN_TREE", REPO / "build" / "tree" / "patched")).resolve()
BASE_TREE = Path(os.environ.get("GDN_BASE_TREE", REPO / "build" / "tree" / "base")).resolve()


def setup_paths() -> None:
    """``tests/image`` and ``$GDN_TREE`` first on ``sys.path`` (idempotent)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    if (GDN_TREE / "megatron").is_dir():
        if str(GDN_TREE) in sys.path:
            sys.path.remove(str(GDN_TREE))
        sys.path.insert(0, str(GDN_TREE))
        os.environ["GDN_TREE"] = str(GDN_TREE)


setup_paths()

# Collective tests must use the loopback interface on every machine.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
# CPU runs exercise the CP plumbing, not Inductor: keep torch.compile'd helpers eager.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _has(mod: str) -> bool:
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


HAVE_TORCH = _has("torch")
HAVE_TREE = (GDN_TREE / "megatron" / "core").is_dir()
HAVE_BASE_TREE = (BASE_TREE / "megatron" / "core").is_dir()


def _fla_reason() -> str | None:
    if not HAVE_TORCH:
        return "torch is not installed"
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FLA warns about optional packages on import
            import fla  # noqa: F401
            from fla.ops.cp import build_cp_context  # noqa: F401
    except Exception as exc:  # ImportError, or triton refusing to import
        return f"FLA 0.4.2 (with fla.ops.cp) is not importable: {exc!r}"
    return None


_FLA_REASON = None if not HAVE_TORCH else _fla_reason()
HAVE_FLA = HAVE_TORCH and _FLA_REASON is None


def need_torch():
    if not HAVE_TORCH:
        pytest.skip("torch is not installed; the image suite needs torch (CPU is enough)")


def need_tree():
    need_torch()
    if not HAVE_TREE:
        pytest.skip(
            f"patched tree not found at {GDN_TREE} (set GDN_TREE, or run "
            "`tools/backport --upstream 5139086e` to build build/tree/patched)"
        )


def need_fla():
    need_torch()
    if not HAVE_FLA:
        pytest.skip(_FLA_REASON or "FLA is not importable")


def need_base_tree():
    need_tree()
    if not HAVE_BASE_TREE:
        pytest.skip(f"base tree not found at {BASE_TREE} (built by tools/backport)")


