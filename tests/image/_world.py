"""Multi-process gloo worlds on CPU for the image suite.

``run_world(fn, world_size, *args)`` starts ``world_size`` processes with
``torch.multiprocessing.start_processes``, initialises a gloo process group in each
(``GLOO_SOCKET_IFNAME=lo``, ``MASTER_ADDR=127.0.0.1``, a free port), calls
``fn(rank, world_size, *args)`` and returns the per-rank return values (anything
``torch.save`` can write), rank order. A rank that raises makes ``run_world`` raise
with that rank's traceback; a world that outlives ``timeout`` seconds is killed.

CPU shim: MCore allocates some collective outputs with
``device=torch.cuda.current_device()`` (e.g. the unequal-split all-to-all used by the layout
conversion). On a host without CUDA, each worker makes ``torch.cuda.current_device()``
return ``"cpu"`` so that those allocations land on the CPU next to their gloo
collectives; nothing else is replaced.

The start method defaults to ``fork`` (the parent has already imported torch and
Megatron, so children start at once); ``GDN_TEST_START_METHOD=spawn`` selects spawn,
in which case ``fn`` must be importable by name.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from typing import Any, Callable, List

LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_cpu_device_shim() -> None:
    """Make ``torch.cuda.current_device()`` answer ``"cpu"`` (CPU-only hosts only)."""
    import torch

    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"


def _entry(rank, fn, world_size, port, outdir, args):
    import warnings

    import torch
    import torch.distributed as dist

    # pytest's "warnings are errors" filter must not turn library warnings inside a
    # worker (optional packages missing, deprecations) into failures of the product.
    warnings.resetwarnings()
    warnings.simplefilter("ignore")
    os.environ.update(LOOPBACK_ENV)
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        install_cpu_device_shim()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    start_method: str | None = None,
) -> List[Any]:
    import torch
    import torch.multiprocessing as mp

    start_method = start_method or os.environ.get("GDN_TEST_START_METHOD", "fork")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gdn-world-") as outdir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, port, outdir, args),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(
                    f"gloo world of {world_size} running {getattr(fn, '__name__', fn)} "
                    f"did not finish within {timeout:.0f} s (killed)"
                )
        return [
            torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]


class FakeGroup:
    """A process group of ``size`` ranks seen from ``rank``, with only ``size()`` and
    ``rank()``: for code that reads the group's shape without running a collective."""

    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank
