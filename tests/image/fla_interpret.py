"""Test-side shims that let FLA 0.4.2's real Triton kernels run on CPU under Triton's interpreter.

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

Pinned to the versions the shims were written for: flash-linear-attention / fla-core
0.4.2, triton 3.6.0, numpy 2.4.x. :func:`install` raises ``RuntimeError`` on any other
version, naming what to re-check, so a version bump fails loudly instead of silently
running different code.
"""

from __future__ import annotations

import ast
import contextlib
import os

FLA_VERSION = "0.4.2"
TRITON_VERSION = "3.6.0"
NUMPY_MINOR = "2.4"

_installed = []


def check_versions() -> dict:
    """Return the versions found; raise ``RuntimeError`` when any differs from the pins."""
    import fla
    import numpy
    import triton

    found = {"fla": fla.__version__, "triton": triton.__version__, "numpy": numpy.__version__}
    drift = []
    if found["fla"] != FLA_VERSION:
        drift.append(f"FLA {found['fla']} (written for {FLA_VERSION}: re-check (a) fla.utils.input_guard)")
    if found["triton"] != TRITON_VERSION:
        drift.append(f"triton {found['triton']} (written for {TRITON_VERSION}: re-check (b) "
                     "Autotuner._bench and (c) interpreter.ASTTransformer / _patch_lang_tensor)")
    if not found["numpy"].startswith(NUMPY_MINOR + "."):
        drift.append(f"numpy {found['numpy']} (written for {NUMPY_MINOR}.x: re-check (c1))")
    if drift:
        raise RuntimeError("tests/image/fla_interpret.py: version drift: " + "; ".join(drift)
                           + ". Update the shims and their pins together.")
    return found


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


def install() -> dict:
    """Install shims (a)-(c) once per process; return the versions found.

    Raises:
        RuntimeError: ``TRITON_INTERPRET`` is not ``1`` (the kernels would need a GPU), or a
            version differs from the pins.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("fla_interpret.install() needs TRITON_INTERPRET=1 set before triton is "
                           "imported (run the tier through fla_interpret_tier.py).")
    found = check_versions()
    if _installed:
        return found
    import fla.utils
    from triton.runtime import autotuner, interpreter

    missing = [n for n, ok in (
        ("fla.utils.custom_device_ctx", hasattr(fla.utils, "custom_device_ctx")),
        ("Autotuner._bench", hasattr(autotuner.Autotuner, "_bench")),
        ("interpreter._patch_lang_tensor", hasattr(interpreter, "_patch_lang_tensor")),
        ("interpreter.ASTTransformer", hasattr(interpreter, "ASTTransformer")),
        ("interpreter.interpreter_semantic", hasattr(interpreter, "interpreter_semantic")),
    ) if not ok]
    if missing:
        raise RuntimeError(f"tests/image/fla_interpret.py: {', '.join(missing)} not found; the shims "
                           "no longer match this FLA/triton.")
    # (a)
    fla.utils.custom_device_ctx = lambda index: contextlib.nullcontext()
    # (b)
    autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0, 0.0, 0.0]
    # (c1)
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    interpreter._patch_lang_tensor = patch_lang_tensor
    # (c2)
    interpreter.ASTTransformer.visit_For = _visit_for
    _installed.append(True)
    return found
