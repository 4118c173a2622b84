"""Test-side shims that let FLA's real Triton kernels (0.4.2, 0.5.2, 0.6.0) run on CPU under Triton's interpreter.

Used only by the real-kernel CPU tier (``test_image_fla_interpret.py`` and its driver
``fla_interpret_tier.py``), in a fresh process started with ``TRITON_INTERPRET=1`` (the
variable must be set before ``triton`` is imported: ``@triton.jit`` reads it when the FLA
modules are imported). Nothing of the product is replaced: the kernels, FLA's Python code
and Megatron run as shipped. What is shimmed, and why:

(a) ``fla.utils.custom_device_ctx``: FLA's ``input_guard`` enters ``torch.<device>.device(i)``
    around every op; with no GPU FLA picks ``torch.cpu``, which has no ``device`` context
    manager. The shim returns a null context (CPU tensors need no device switch).
(b) ``triton.runtime.autotuner.Autotuner._bench``: the autotuner benchmarks every config
    through the active driver's benchmarker, and the interpreter has no active driver
    ("0 active drivers"). The stub reports equal timings, so the first config is chosen
    (``min`` keeps the first of equal keys); the kernel then runs once, with that config.
(c) interpreter scalars: (c1) the interpreter's ``tensor.__index__`` is
    ``int(handle.data)``, and numpy 2.x refuses ``int()`` of a one-element array of shape
    ``(1,)`` ("only 0-dimensional arrays can be converted to Python scalars"), which FLA's
    ``for i_t in range(NT)`` hits when ``NT`` comes from a loaded ``cu_seqlens`` entry; the
    shim converts through ``.item()``. (c2) compiled Triton gives a ``for`` loop's counter the
    type of a Triton scalar, the interpreter gives a plain Python ``int``, on which FLA's
    ``i_t.to(tl.int64)`` fails; the shim extends the interpreter's AST rewrite (which already
    wraps every assignment in ``interpreter_semantic.to_tensor``) to rebind each ``for``
    target the same way at the top of the loop body.
(d) gloo's all-gather shape: ``fla_gloo.install()`` (its own module; installed by the
    tier's gloo workers, not here).
(e) FLA 0.6.0 only: ``fla.ops.cp.context._check_cp_device`` raises for any tensor that is not on
    an NVIDIA GPU of compute capability >= 8 (or Ascend) before every CP kernel ("CP affine chains
    require NVIDIA Ampere or newer"), because its CP merge dots run in ``tf32x3``. The shim lets
    CPU tensors through (the interpreter ignores a dot's input precision) and keeps the
    check for every other device; it replaces the function in each ``fla.ops.cp`` module that
    imported it by name (``chunk_fwd``, ``chunk_bwd``, ``chunk_delta_h``, ``chunk_merge``).

Each FLA release the tier runs on has its own entry in :data:`RELEASES`: the triton and numpy it
was checked with and the shims it needs. FLA 0.5.2 and 0.6.0 (triton 3.7.1) need (b) and (c2),
0.6.0 also (e): their ``custom_device_ctx`` already returns a null context for a CPU tensor
(device index ``None``), triton 3.7.1's ``__index__`` converts through ``squeeze()`` (the fix of
(c1)), and its interpreter still has no ``visit_For`` (read in ``triton/runtime/interpreter.py``).
:func:`install` raises ``RuntimeError`` on a release or version outside that table, naming what
to re-check, so a version bump fails loudly instead of silently running different code.
"""

from __future__ import annotations

import ast
import contextlib
import os
from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class Release:
    """What one FLA release's tier was checked with: ``triton`` (exact), ``numpy`` (minor), and
    the shims it needs, of ``device_ctx`` (a), ``bench`` (b), ``index`` (c1), ``for_target`` (c2),
    ``cp_device`` (e)."""

    triton: str
    numpy: str
    shims: Tuple[str, ...]


#: FLA release -> what its tier runs with (the sets of docs/fla-versions.md).
RELEASES = {
    "0.4.2": Release("3.6.0", "2.4", ("device_ctx", "bench", "index", "for_target")),
    "0.5.2": Release("3.7.1", "2.4", ("bench", "for_target")),
    "0.6.0": Release("3.7.1", "2.4", ("bench", "for_target", "cp_device")),
}
# The default set's pins (kept for callers that name them).
FLA_VERSION = "0.4.2"
TRITON_VERSION = RELEASES[FLA_VERSION].triton
NUMPY_MINOR = RELEASES[FLA_VERSION].numpy

_installed = []


def check_versions() -> dict:
    """Return the versions found (``fla``, ``triton``, ``numpy``, and ``shims``: the shims that
    release needs); raise ``RuntimeError`` when FLA is not in :data:`RELEASES` or triton / numpy
    differ from that release's entry."""
    import fla
    import numpy
    import triton

    found = {"fla": fla.__version__, "triton": triton.__version__, "numpy": numpy.__version__}
    release = RELEASES.get(found["fla"])
    if release is None:
        raise RuntimeError(f"tests/image/fla_interpret.py: FLA {found['fla']} has no entry in RELEASES "
                           f"(written for {', '.join(RELEASES)}): re-check every shim (a)-(c) against it "
                           "and add it to RELEASES.")
    drift = []
    if found["triton"] != release.triton:
        drift.append(f"triton {found['triton']} (FLA {found['fla']}'s tier was written for triton {release.triton}: "
                     "re-check (b) Autotuner._bench and (c) interpreter.ASTTransformer / _patch_lang_tensor)")
    if not found["numpy"].startswith(release.numpy + "."):
        drift.append(f"numpy {found['numpy']} (written for {release.numpy}.x: re-check (c1))")
    if drift:
        raise RuntimeError("tests/image/fla_interpret.py: version drift: " + "; ".join(drift)
                           + ". Update the shims and RELEASES together.")
    return {**found, "shims": list(release.shims)}


def _index(self):
    data = self.handle.data
    return int(data.item() if getattr(data, "size", 1) == 1 else data)


def _visit_for(self, node):
    """``for t in ...: body`` -> ``for t in ...: t = t; body`` (the assign becomes to_tensor)."""
    self.generic_visit(node)
    if isinstance(node.target, ast.Name):
        name = node.target.id
        rebind = ast.Assign(
            targets=[ast.Name(id=name, ctx=ast.Store())],
            value=ast.Call(
                func=ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                   attr="to_tensor", ctx=ast.Load()),
                args=[ast.Name(id=name, ctx=ast.Load()), ast.Constant(value=False)],
                keywords=[],
            ),
        )
        node.body.insert(0, ast.copy_location(rebind, node))
    return node


def _patch_cp_device() -> None:
    import importlib
    import sys

    import fla.ops.cp.context as cp_context

    original = cp_context._check_cp_device

    def check_cp_device(device):
        if device.type == "cpu":
            return None
        return original(device)

    for name in ("chunk_fwd", "chunk_bwd", "chunk_delta_h", "chunk_merge"):
        importlib.import_module(f"fla.ops.cp.{name}")
    for name, mod in list(sys.modules.items()):
        if name.startswith("fla.") and getattr(mod, "_check_cp_device", None) is original:
            mod._check_cp_device = check_cp_device


def install() -> dict:
    """Install the shims the installed FLA release needs (:data:`RELEASES`), once per process;
    return the versions found (with ``shims``).

    Raises:
        RuntimeError: ``TRITON_INTERPRET`` is not ``1`` (the kernels would need a GPU), a
            version differs from :data:`RELEASES`, or a patch point of a needed shim is gone.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("fla_interpret.install() needs TRITON_INTERPRET=1 set before triton is "
                           "imported (run the tier through fla_interpret_tier.py).")
    found = check_versions()
    if _installed:
        return found
    import fla.utils
    from triton.runtime import autotuner, interpreter

    shims = set(found["shims"])
    points = {
        "device_ctx": [("fla.utils.custom_device_ctx", hasattr(fla.utils, "custom_device_ctx"))],
        "bench": [("Autotuner._bench", hasattr(autotuner.Autotuner, "_bench"))],
        "index": [("interpreter._patch_lang_tensor", hasattr(interpreter, "_patch_lang_tensor"))],
        "for_target": [("interpreter.ASTTransformer", hasattr(interpreter, "ASTTransformer")),
                       ("interpreter.interpreter_semantic", hasattr(interpreter, "interpreter_semantic"))],
    }
    if "cp_device" in shims:
        import fla.ops.cp.context as cp_context

        points["cp_device"] = [("fla.ops.cp.context._check_cp_device", hasattr(cp_context, "_check_cp_device"))]
    missing = [n for shim in sorted(shims) for n, ok in points[shim] if not ok]
    if missing:
        raise RuntimeError(f"tests/image/fla_interpret.py: {', '.join(missing)} not found; the shims "
                           f"no longer match FLA {found['fla']} / triton {found['triton']}.")
    if "device_ctx" in shims:  # (a)
        fla.utils.custom_device_ctx = lambda index: contextlib.nullcontext()
    if "bench" in shims:  # (b)
        autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0, 0.0, 0.0]
    if "index" in shims:  # (c1)
        original = interpreter._patch_lang_tensor

        def patch_lang_tensor(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", _index)

        interpreter._patch_lang_tensor = patch_lang_tensor
    if "for_target" in shims:  # (c2)
        interpreter.ASTTransformer.visit_For = _visit_for
    if "cp_device" in shims:  # (e)
        _patch_cp_device()
    _installed.append(True)
    return found
