"""CPU tests of the GPU suite's placement and of module_extra's pure helpers (no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from placement import place  # noqa: E402


@pytest.mark.parametrize("world,ngpu,devices,backend,per_gpu", [
    (4, 1, [0, 0, 0, 0], "gloo", 4),
    (4, 2, [0, 1, 0, 1], "gloo", 2),
    (4, 4, [0, 1, 2, 3], "nccl", 1),
    (4, 8, [0, 1, 2, 3], "nccl", 1),
    (2, 1, [0, 0], "gloo", 2),
    (3, 2, [0, 1, 0], "gloo", 2),
])
def test_ranks_share_gpus_round_robin_and_gloo_only_when_shared(world, ngpu, devices, backend, per_gpu):
    got = [place(r, world, ngpu) for r in range(world)]
    assert [p.device for p in got] == devices
    assert {p.backend for p in got} == {backend}
    assert {p.ranks_per_gpu for p in got} == {per_gpu}
    assert all(p.shared == (per_gpu > 1) for p in got)


def test_forced_backend_is_kept_but_nccl_refused_on_a_shared_gpu():
    assert place(0, 2, 2, "gloo").backend == "gloo"
    with pytest.raises(ValueError, match="hint:"):
        place(0, 4, 1, "nccl")
    with pytest.raises(ValueError, match="hint:"):
        place(0, 4, 1, "mpi")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        place(0, 4, 0)


def test_empty_segment_positions():
    torch = pytest.importorskip("torch")  # noqa: F841 - module_extra imports torch
    import module_extra as X

    cu = [0, 64, 200, 256]
    assert X.with_empty_segment(cu, "start") == [0, 0, 64, 200, 256]
    assert X.with_empty_segment(cu, "middle") == [0, 64, 64, 200, 256]
    assert X.with_empty_segment(cu, "end") == [0, 64, 200, 256, 256]


def test_tp_slices_reassemble_every_section():
    """Each TP rank's slice takes its part of every section (q, k, v, z, beta, alpha), and the
    two slices together hold every row once."""
    torch = pytest.importorskip("torch")
    import module_extra as X

    g = X.GQA  # qk = 128, v = 512, nv = 8 -> in_proj rows 128+128+512+512+8+8
    rows = torch.arange(2 * 128 + 2 * 512 + 2 * 8, dtype=torch.float64)[:, None]
    s0, s1 = (X.tp_slice("in_proj.weight", rows, g, 2, t)[:, 0].long().tolist() for t in (0, 1))
    assert s0[:64] == list(range(0, 64)) and s1[:64] == list(range(64, 128))
    assert s0[64:128] == list(range(128, 192))  # k section, first half
    assert s1[-4:] == list(range(1292, 1296))  # alpha section (rows 1288-1295), second half
    assert sorted(s0 + s1) == list(range(rows.shape[0]))
    cols = torch.zeros(128, 512)
    assert X.tp_slice("out_proj.weight", cols, g, 2, 1).shape == (128, 256)
    assert X.tp_slice("out_norm.weight", torch.zeros(64), g, 2, 0) is None
