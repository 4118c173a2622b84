"""The eager GDN oracle (``gdn_reference``) checked against itself in float64 on CPU.

Recurrent form vs chunked form with per-rank state summaries composed in rank order
(``H_out = M H_in + S``): outputs ``[B, T, H, V]``, final states ``[N, H, K, V]`` and the
gradients of ``q, k, v, g, beta`` must agree to 1e-10 (float64).
"""

from __future__ import annotations

import pytest

from _image_env import need_torch

CASES = {
    # name: (B, T, cu_seqlens or None, num_ranks, chunk_size)
    "T1": (1, 1, None, 1, 64),
    "T63_one_rank": (1, 63, None, 1, 64),
    "T64_two_ranks": (1, 64, None, 2, 16),
    "T128_four_ranks_chunk_edges": (1, 128, None, 4, 16),
    "batch2_eight_ranks": (2, 64, None, 8, 8),
    # packed: sequences start mid-rank and span several ranks
    "packed_spanning_ranks": (1, 96, [0, 5, 50, 51, 96], 4, 16),
    "packed_chunk_edges": (1, 192, [0, 63, 127, 192], 2, 64),
}


@pytest.mark.parametrize("name", list(CASES))
def test_recurrent_and_chunked_with_rank_summaries_agree(name):
    need_torch()
    import torch

    from gdn_reference import gdn_chunked, gdn_recurrent, random_gdn_inputs

    B, T, cu, P, C = CASES[name]
    H, K, V = 2, 8, 6
    inputs = [t.requires_grad_(True) for t in random_gdn_inputs(B, T, H, K, V, seed=len(name))]
    cu_t = None if cu is None else torch.tensor(cu)
    n_states = B if cu is None else len(cu) - 1
    h0 = torch.randn(n_states, H, K, V, dtype=torch.float64) * 0.1
    o_r, h_r = gdn_recurrent(*inputs, initial_state=h0, cu_seqlens=cu_t)
    gen = torch.Generator().manual_seed(7)
    G = torch.randn(o_r.shape, generator=gen, dtype=torch.float64)
    GH = torch.randn(h_r.shape, generator=gen, dtype=torch.float64)
    grads_r = torch.autograd.grad((o_r * G).sum() + (h_r * GH).sum(), inputs)
    o_c, h_c = gdn_chunked(*inputs, initial_state=h0, cu_seqlens=cu_t, chunk_size=C, num_ranks=P)
    grads_c = torch.autograd.grad((o_c * G).sum() + (h_c * GH).sum(), inputs)
    assert o_c.shape == (B, T, H, V) and h_c.shape == (n_states, H, K, V)
    assert (o_r - o_c).abs().max() < 1e-10
    assert (h_r - h_c).abs().max() < 1e-10
    for name_, a, b in zip("q k v g beta".split(), grads_r, grads_c):
        assert (a - b).abs().max() < 1e-10, name_


def test_rank_summaries_compose_in_order_only():
    """compose((M1,S1),(M2,S2)) applied to H equals running piece 1 then piece 2, not 2 then 1."""
    need_torch()
    import torch

    from gdn_reference import compose_summaries, random_gdn_inputs, segment_summary

    q, k, v, g, beta = random_gdn_inputs(1, 40, 2, 4, 3, seed=3)
    hm = [x[0].transpose(0, 1) for x in (q, k, v, g, beta)]
    first = segment_summary(*[x[:, :20] for x in hm], 0.5, chunk_size=8)
    second = segment_summary(*[x[:, 20:] for x in hm], 0.5, chunk_size=8)
    whole = segment_summary(*hm, 0.5, chunk_size=8)
    M, S = compose_summaries(first, second)
    assert (M - whole[0]).abs().max() < 1e-12 and (S - whole[1]).abs().max() < 1e-12
    M_wrong, S_wrong = compose_summaries(second, first)
    assert (S_wrong - whole[1]).abs().max() > 1e-6


def test_conv_reference_matches_explicit_sum():
    """``causal_conv1d_ref`` == sum_i w[d,i] x[t-(W-1)+i, d] with per-sequence zero history."""
    need_torch()
    import torch
    import torch.nn.functional as F

    from gdn_reference import causal_conv1d_ref

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 11, 3, generator=gen, dtype=torch.float64)
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    b = torch.randn(3, generator=gen, dtype=torch.float64)
    cu = [0, 2, 11]
    y = causal_conv1d_ref(x, w, b, activation="silu", cu_seqlens=torch.tensor(cu))
    ref = torch.zeros_like(x)
    for s, e in zip(cu[:-1], cu[1:]):
        for t in range(s, e):
            acc = b.clone()
            for i in range(4):
                src = t - 3 + i
                if src >= s:
                    acc = acc + w[:, i] * x[0, src]
            ref[0, t] = F.silu(acc)
    assert (y - ref).abs().max() < 1e-12
