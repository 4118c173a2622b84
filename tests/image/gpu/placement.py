"""Where the GPU suite's ranks run: GPU per rank and the process-group backend.

Any world size runs on however many GPUs the host has: local rank ``r`` uses GPU
``r % ngpu`` (round-robin). NCCL refuses two ranks on one GPU ("invalid usage"), so the
backend is gloo as soon as two ranks share a GPU and NCCL otherwise. gloo moves CUDA tensors
through host memory; it gave correct ``all_reduce``, ``all_gather_into_tensor`` (sync and
async), ``reduce_scatter_tensor``, ``all_to_all_single`` (float32, bfloat16), ``all_gather``
and ``broadcast`` with 4 ranks on one H200 (issue 13). Under gloo the harness installs the
shim of ``tests/image/fla_gloo.py`` for FLA 0.4.2's CP all-gather; under NCCL it does not.

Timings of ranks that share a GPU (or go through gloo) are not performance data: the ranks
time-slice one device and every collective crosses host memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Placement:
    """``device``: CUDA ordinal of this rank; ``backend``: "nccl" | "gloo";
    ``ranks_per_gpu``: the most ranks any GPU holds (1 = every rank has its own)."""

    device: int
    backend: str
    ranks_per_gpu: int

    @property
    def shared(self) -> bool:
        return self.ranks_per_gpu > 1


def place(local_rank: int, local_world: int, ngpu: int, backend: Optional[str] = None) -> Placement:
    """Round-robin placement of ``local_world`` ranks on ``ngpu`` GPUs.

    Args:
        local_rank: this process's rank on the host (torchrun's ``LOCAL_RANK``).
        local_world: ranks on the host (torchrun's ``LOCAL_WORLD_SIZE``).
        ngpu: CUDA devices visible to the process.
        backend: force "nccl" or "gloo" (``GDN_SUITE_BACKEND``); None chooses.

    Raises:
        ValueError: no GPU, a rank outside the world, an unknown backend, or NCCL forced
            while two ranks share a GPU (NCCL refuses that).
    """
    if ngpu < 1:
        raise ValueError("no CUDA GPU visible; hint: run on a GPU host, or set "
                         "GDN_SUITE_EMULATE=1 for the CPU dry run")
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} outside a world of {local_world}; "
                         "hint: start the job through torchrun")
    per_gpu = -(-local_world // ngpu)
    chosen = "gloo" if per_gpu > 1 else "nccl"
    if backend not in (None, "", "nccl", "gloo"):
        raise ValueError(f"unknown backend {backend!r}; hint: GDN_SUITE_BACKEND is nccl or gloo")
    if backend == "nccl" and per_gpu > 1:
        raise ValueError(f"NCCL cannot put {per_gpu} ranks on one GPU ({local_world} ranks, "
                         f"{ngpu} GPUs); hint: leave GDN_SUITE_BACKEND unset (gloo is chosen)")
    return Placement(device=local_rank % ngpu, backend=backend or chosen, ranks_per_gpu=per_gpu)
