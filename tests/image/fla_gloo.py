"""The gloo shim for FLA's CP all-gather (test harness only; never used under NCCL).

FLA's ``fla/ops/cp/comm.py::all_gather_into_tensor`` (the same function in 0.4.2, 0.5.2 and
0.6.0) allocates the output as ``[world, *inp.shape]`` and hands it to
``torch.distributed.all_gather_into_tensor``. NCCL accepts that shape; gloo rejects it
(``expected (8, 128, 256), got (1, 8, 128, 256)``). A flat view of the same memory is accepted by
both, so the shim gathers into ``out.view(-1)`` and returns ``out`` with FLA's shape.

:func:`check` proves the shim still matches the installed release's ``fla.ops.cp.comm`` before
anything is replaced: the FLA version is one of :data:`FLA_VERSIONS`, the function's parameters
are ``(inp, out, group, async_op)``, and the shim patches every loaded ``fla`` module that binds FLA's function
by name (``fla.ops.cp`` and its ``comm`` and ``chunk_delta_h`` in each release; in 0.6.0 also the
causal conv's CP module ``fla.modules.causal_conv1d.cp`` and its old-path aliases, which the
first version of this shim, written for 0.4.2, did not patch). ``tools/gpu-suite``
runs it against the FLA set it installed.
"""

from __future__ import annotations

import inspect
import sys

import torch.distributed as dist

#: FLA releases whose ``fla.ops.cp.comm.all_gather_into_tensor`` the shim was checked against.
FLA_VERSIONS = ("0.4.2", "0.5.2", "0.6.0")
#: The parameters of that function in each of them.
PARAMETERS = ("inp", "out", "group", "async_op")


def _gather(inp, out=None, group=None, async_op=False):
    world = dist.get_world_size(group=group)
    if out is None:
        out = inp.new_empty((world, *inp.shape))
    handle = dist.all_gather_into_tensor(out.view(-1), inp.contiguous().view(-1), group=group, async_op=async_op)
    return out, handle


def check() -> dict:
    """Check the shim against the installed FLA; return ``{"fla", "parameters", "bound_in"}``
    (``bound_in``: the loaded ``fla`` modules that bind FLA's function, which :func:`install`
    replaces). Needs no process group.

    Raises:
        RuntimeError: the FLA release is not in :data:`FLA_VERSIONS`, the function's parameters
            differ from :data:`PARAMETERS`, or no module but ``comm`` binds it (the shim would
            replace nothing).
    """
    import fla
    import fla.modules  # noqa: F401  (0.6.0's conv CP, fla.modules.causal_conv1d.cp, gathers too)
    import fla.ops.cp  # noqa: F401  (loads the package's modules)
    import fla.ops.cp.chunk_delta_h  # noqa: F401
    import fla.ops.cp.comm as comm

    if fla.__version__ not in FLA_VERSIONS:
        raise RuntimeError(f"tests/image/fla_gloo.py was checked against FLA {', '.join(FLA_VERSIONS)}, found "
                           f"{fla.__version__}; re-check FLA's fla/ops/cp/comm.py all_gather_into_tensor and add "
                           "the release to FLA_VERSIONS.")
    original = getattr(comm, "_gdn_gloo_original", comm.all_gather_into_tensor)
    params = tuple(inspect.signature(original).parameters)
    if params != PARAMETERS:
        raise RuntimeError(f"FLA {fla.__version__}'s fla.ops.cp.comm.all_gather_into_tensor takes {params}, the gloo "
                           f"shim (tests/image/fla_gloo.py) {PARAMETERS}; update the shim for this release.")
    bound = sorted(name for name, mod in list(sys.modules.items())
                   if name.startswith("fla.") and getattr(mod, "all_gather_into_tensor", None) in (original, _gather))
    if "fla.ops.cp.comm" not in bound or "fla.ops.cp.chunk_delta_h" not in bound:
        raise RuntimeError(f"FLA {fla.__version__}: only {bound or 'no module'} binds "
                           "all_gather_into_tensor; re-check where its CP code gathers (tests/image/fla_gloo.py).")
    return {"fla": fla.__version__, "parameters": list(params), "bound_in": bound}


def install() -> bool:
    """Route FLA's CP all-gather through :func:`_gather` when the default group is gloo.

    Returns:
        True when the shim was installed (backend gloo), False otherwise (NCCL: FLA as is).

    Raises:
        RuntimeError: :func:`check` refuses the installed FLA.
    """
    import fla.ops.cp.comm as comm

    found = check()
    if dist.get_backend() != "gloo":
        return False
    original = getattr(comm, "_gdn_gloo_original", comm.all_gather_into_tensor)
    comm._gdn_gloo_original = original
    for name in found["bound_in"]:
        sys.modules[name].all_gather_into_tensor = _gather
    return True
