"""The gloo shim for FLA 0.4.2's CP all-gather (test harness only; never used under NCCL).

FLA 0.4.2 (``fla/ops/cp/comm.py::all_gather_into_tensor``) allocates the output as
``[world, *inp.shape]`` and hands it to ``torch.distributed.all_gather_into_tensor``.
NCCL accepts that shape; gloo rejects it (``expected (8, 128, 256), got (1, 8, 128, 256)``).
A flat view of the same memory is accepted by both, so the shim gathers into
``out.view(-1)`` and returns ``out`` with FLA's shape. Written for
flash-linear-attention / fla-core 0.4.2; :func:`install` refuses any other version.
"""

from __future__ import annotations

import torch.distributed as dist

FLA_VERSION = "0.4.2"


def _gather(inp, out=None, group=None, async_op=False):
    world = dist.get_world_size(group=group)
    if out is None:
        out = inp.new_empty((world, *inp.shape))
    handle = dist.all_gather_into_tensor(out.view(-1), inp.contiguous().view(-1), group=group, async_op=async_op)
    return out, handle


def install() -> bool:
    """Route FLA's CP all-gather through :func:`_gather` when the default group is gloo.

    Returns:
        True when the shim was installed (backend gloo), False otherwise (NCCL: FLA as is).

    Raises:
        RuntimeError: FLA is not version 0.4.2 (the shim was written for that release).
    """
    import fla
    import fla.ops.cp.chunk_delta_h as chunk_delta_h
    import fla.ops.cp.comm as comm

    if fla.__version__ != FLA_VERSION:
        raise RuntimeError(f"tests/image/fla_gloo.py was written for FLA {FLA_VERSION}, found {fla.__version__}; "
                           "re-check FLA's all_gather_into_tensor and update the shim.")
    if dist.get_backend() != "gloo":
        return False
    comm.all_gather_into_tensor = _gather
    chunk_delta_h.all_gather_into_tensor = _gather
    return True
