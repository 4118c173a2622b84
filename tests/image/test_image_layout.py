"""CP token layouts of the patched tree, over real gloo worlds (CP = 1, 2, 4, 8).

Checks ``megatron.core.context_parallel_layout`` (zigzag <-> contiguous, THD and SBHD) and
``megatron.core.ssm.gdn_context_parallel.gather_zigzag_sequence`` /
``scatter_zigzag_sequence`` (incl. gradients) against the independent layout definitions in
``cp_layout_ref``. Token payloads are float64 ``[T, 4]`` rows ``(t, 1000 + t, -t, valid)``
so that any misplaced, duplicated or dropped token is visible.
"""

from __future__ import annotations

import re

import pytest

from _image_env import need_tree
from _world import FakeGroup
from cp_layout_ref import contiguous_rank_indices, seq_lens_from_cu, zigzag_rank_indices

CP_SIZES = (1, 2, 4, 8)


def thd_cases(P: int):
    """name -> (cu_seqlens used for the layout, valid length of each sequence)."""
    u = 2 * P
    return {
        "one_sample": ([0, 3 * u], [3 * u]),
        "unequal_samples": ([0, u, 4 * u, 6 * u], [u, 3 * u, 2 * u]),
        # per-sample padding: each sequence padded up to a multiple of 2*CP
        "per_sample_padding": ([0, 2 * u, 5 * u, 6 * u], [2 * u - 1, 2 * u + 1, u]),
        # padding tail: end padding carried as a dummy last sequence (no valid tokens)
        "padding_tail": ([0, 2 * u, 3 * u, 5 * u], [2 * u, u, 0]),
        # an empty sequence (duplicate boundary) in the middle of the pack
        "empty_sequence": ([0, 2 * u, 2 * u, 3 * u], [2 * u, 0, u]),
    }


def payload(cu, valid):
    """``[T, 4]`` float64 rows (t, 1000+t, -t, valid-mask)."""
    import torch

    T = cu[-1]
    t = torch.arange(T, dtype=torch.float64)
    mask = torch.zeros(T, dtype=torch.float64)
    for (a, _b), n in zip(zip(cu[:-1], cu[1:]), valid):
        mask[a : a + n] = 1.0
    return torch.stack([t, 1000 + t, -t, mask], dim=1)


def _layout_worker(rank, world, _):
    import torch
    import torch.distributed as dist

    from megatron.core.context_parallel_layout import (
        contiguous_to_zigzag_chunks,
        get_thd_context_parallel_rank_indices,
        zigzag_to_contiguous_chunks,
    )

    group = dist.group.WORLD
    out = {}
    for name, (cu, valid) in thd_cases(world).items():
        cu_t = torch.tensor(cu, dtype=torch.int32)
        X = payload(cu, valid)
        lens = seq_lens_from_cu(cu)
        zz = zigzag_rank_indices(lens, world, rank)
        local = X[zz].clone()
        to_contig = zigzag_to_contiguous_chunks(local, group, seq_dim=0, cu_seqlens=cu_t)
        back = contiguous_to_zigzag_chunks(to_contig, group, seq_dim=0, cu_seqlens=cu_t)
        # THD with the sequence on dim 1 ([1, T, F]).
        to_contig_d1 = zigzag_to_contiguous_chunks(
            local.unsqueeze(0), group, seq_dim=1, cu_seqlens=cu_t
        )
        valid_local = torch.tensor([float(to_contig[:, 3].sum())])
        dist.all_reduce(valid_local)
        out[name] = {
            "mcore_zigzag": get_thd_context_parallel_rank_indices(cu_t, world, rank, "zigzag").tolist(),
            "mcore_contiguous": get_thd_context_parallel_rank_indices(
                cu_t, world, rank, "contiguous"
            ).tolist(),
            "local": local,
            "to_contig": to_contig,
            "to_contig_dim1": to_contig_d1,
            "back": back,
            "valid_total_after": float(valid_local),
        }
    # SBHD: global sequence of 8*P tokens, batch 2, features; seq_dim 0 and 1.
    S = 8 * world
    X = payload([0, S], [S])  # [S, 4]
    sbhd = torch.stack([X, X + 0.5], dim=1)  # [S, B=2, 4]
    zz = zigzag_rank_indices([S], world, rank)
    local = sbhd[zz].clone()
    c0 = zigzag_to_contiguous_chunks(local, group, seq_dim=0)
    b0 = contiguous_to_zigzag_chunks(c0, group, seq_dim=0)
    local1 = local.transpose(0, 1).contiguous()  # [B, S_local, 4]
    c1 = zigzag_to_contiguous_chunks(local1, group, seq_dim=1)
    b1 = contiguous_to_zigzag_chunks(c1, group, seq_dim=1)
    out["sbhd"] = {"global": sbhd, "local": local, "c0": c0, "b0": b0, "c1": c1, "b1": b1}
    return out


_cache = {}


def layout_results(world, P):
    if P not in _cache:
        _cache[P] = world(_layout_worker, P, None)
    return _cache[P]


@pytest.mark.parametrize("P", CP_SIZES)
@pytest.mark.parametrize("case", list(thd_cases(1)))
def test_mcore_zigzag_indices_match_independent_definition(gloo_world, P, case):
    need_tree()
    cu, _ = thd_cases(P)[case]
    for rank, res in enumerate(layout_results(gloo_world, P)):
        r = res[case]
        assert r["mcore_zigzag"] == zigzag_rank_indices(seq_lens_from_cu(cu), P, rank)
        assert r["mcore_contiguous"] == contiguous_rank_indices(cu[-1], P, rank)


@pytest.mark.parametrize("P", CP_SIZES)
@pytest.mark.parametrize("case", list(thd_cases(1)))
def test_thd_zigzag_contiguous_zigzag_round_trip(gloo_world, P, case):
    need_tree()
    cu, valid = thd_cases(P)[case]
    X = payload(cu, valid)
    import torch

    for rank, res in enumerate(layout_results(gloo_world, P)):
        r = res[case]
        contig = contiguous_rank_indices(cu[-1], P, rank)
        # zigzag -> contiguous puts exactly the rank's contiguous span there, token by token
        assert torch.equal(r["to_contig"], X[contig])
        assert torch.equal(r["to_contig_dim1"], X[contig].unsqueeze(0))
        # ... and back is the identity per token (valid mask included)
        assert torch.equal(r["back"], r["local"])
        # valid-token count is preserved exactly
        assert r["valid_total_after"] == float(sum(valid))


@pytest.mark.parametrize("P", CP_SIZES)
def test_sbhd_round_trip_seq_dim_0_and_1(gloo_world, P):
    need_tree()
    import torch

    for rank, res in enumerate(layout_results(gloo_world, P)):
        r = res["sbhd"]
        contig = contiguous_rank_indices(r["global"].shape[0], P, rank)
        assert torch.equal(r["c0"], r["global"][contig])
        assert torch.equal(r["b0"], r["local"])
        assert torch.equal(r["c1"], r["global"][contig].transpose(0, 1))
        assert torch.equal(r["b1"], r["local"].transpose(0, 1))


# --------------------------------------------------------------------------------------
# gather_zigzag_sequence / scatter_zigzag_sequence (the all_gather mode's primitives)
# --------------------------------------------------------------------------------------


def _gather_scatter_worker(rank, world, _):
    import torch
    import torch.distributed as dist

    from megatron.core.ssm.gdn_context_parallel import (
        gather_zigzag_sequence,
        scatter_zigzag_sequence,
    )

    group = dist.group.WORLD
    out = {}
    cases = {k: v for k, v in thd_cases(world).items()}
    cases["sbhd"] = ([0, 8 * world], [8 * world])
    for name, (cu, valid) in cases.items():
        X = payload(cu, valid)  # [T, 4]
        zz = zigzag_rank_indices(seq_lens_from_cu(cu), world, rank)
        cu_t = None if name == "sbhd" else torch.tensor(cu, dtype=torch.int32)
        if name == "sbhd":
            X = torch.stack([X, 2 * X], dim=1)  # [S, B=2, 4]
        local = X[zz].clone().requires_grad_(True)
        full = gather_zigzag_sequence(local, group, seq_dim=0, cu_seqlens=cu_t)
        # rank-dependent upstream gradient: backward must sum over the group
        gen = torch.Generator().manual_seed(100 + rank)
        G = torch.randn(full.shape, generator=gen, dtype=full.dtype)
        (full * G).sum().backward()
        gather_grad = local.grad.clone()
        all_G = [torch.empty_like(G) for _ in range(world)]
        dist.all_gather(all_G, G)

        # scatter of the full sequence -> the rank's zigzag shard
        Xf = X.clone().requires_grad_(True)
        shard = scatter_zigzag_sequence(Xf, group, seq_dim=0, cu_seqlens=cu_t)
        # scatter(gather(x)) is the identity, gradient included
        local2 = X[zz].clone().requires_grad_(True)
        round_trip = scatter_zigzag_sequence(
            gather_zigzag_sequence(local2, group, seq_dim=0, cu_seqlens=cu_t),
            group,
            seq_dim=0,
            cu_seqlens=cu_t,
        )
        Gl = torch.randn(round_trip.shape, generator=gen, dtype=round_trip.dtype)
        (round_trip * Gl).sum().backward()
        out[name] = {
            "X": X,
            "zz": zz,
            "full": full.detach(),
            "gather_grad": gather_grad,
            "all_G": all_G,
            "shard": shard.detach(),
            "round_trip": round_trip.detach(),
            "round_trip_grad": local2.grad,
            "Gl": Gl,
        }
    return out


_gs_cache = {}


def gather_scatter_results(world, P):
    if P not in _gs_cache:
        _gs_cache[P] = world(_gather_scatter_worker, P, None)
    return _gs_cache[P]


GS_CASES = list(thd_cases(1)) + ["sbhd"]


@pytest.mark.parametrize("P", CP_SIZES)
@pytest.mark.parametrize("case", GS_CASES)
def test_gather_zigzag_sequence_forward_and_grad(gloo_world, P, case):
    """Gather gives the natural-order sequence on every rank; its backward sums over ranks."""
    need_tree()
    for res in gather_scatter_results(gloo_world, P):
        r = res[case]
        assert r["full"].shape == r["X"].shape
        assert (r["full"] == r["X"]).all()
        expected = sum(G[r["zz"]] for G in r["all_G"])
        assert (r["gather_grad"] - expected).abs().max() <= 1e-12


@pytest.mark.parametrize("P", CP_SIZES)
@pytest.mark.parametrize("case", GS_CASES)
def test_scatter_zigzag_sequence_and_round_trip_grad(gloo_world, P, case):
    """Scatter keeps the rank's zigzag shard; scatter(gather(x)) == x and d/dx is identity."""
    need_tree()
    for res in gather_scatter_results(gloo_world, P):
        r = res[case]
        assert (r["shard"] == r["X"][r["zz"]]).all()
        assert (r["round_trip"] == r["X"][r["zz"]]).all()
        assert (r["round_trip_grad"] - r["Gl"]).abs().max() <= 1e-12


def _routes_worker(rank, world, _):
    import torch
    import torch.distributed as dist

    from megatron.core.context_parallel_layout import (
        contiguous_to_zigzag_chunks,
        zigzag_to_contiguous_chunks,
    )
    from megatron.core.ssm.gdn_context_parallel import LinearCPError, ThdLayoutRoutes

    group = dist.group.WORLD
    out = {}
    for name, (cu, valid) in thd_cases(world).items():
        cu_t = torch.tensor(cu, dtype=torch.int32)
        X = payload(cu, valid)
        local = X[zigzag_rank_indices(seq_lens_from_cu(cu), world, rank)].clone()
        g = torch.randn(local.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        results = {}
        for impl in ("routes", "upstream"):
            x = local.clone().requires_grad_(True)
            if impl == "routes":
                routes = ThdLayoutRoutes(cu_t, group, "cpu")
                contig = routes.to_contiguous(x)
                back = routes.to_zigzag(contig * 2.0)
            else:
                contig = zigzag_to_contiguous_chunks(x, group, seq_dim=0, cu_seqlens=cu_t)
                back = contiguous_to_zigzag_chunks(contig * 2.0, group, seq_dim=0, cu_seqlens=cu_t)
            back.backward(g)
            results[impl] = (contig.detach(), back.detach(), x.grad)
        try:
            ThdLayoutRoutes(cu_t, group, "cpu").to_contiguous(local[:-1] if local.shape[0] else local)
            refused = local.shape[0] == 0
        except LinearCPError as e:
            refused = "zigzag shard" in str(e)
        out[name] = {"local": local, "results": results, "refused_short_input": refused}
    return out


@pytest.mark.parametrize("P", (2, 4, 8))
def test_host_routed_thd_layout_matches_upstream_conversion_bit_for_bit(gloo_world, P):
    """ThdLayoutRoutes (route from the host copy of cu_seqlens, no device sync) sends the same
    tokens in the same order as upstream's zigzag_to_contiguous_chunks / contiguous_to_zigzag_chunks
    with cu_seqlens: outputs and input gradients equal, every THD case, every rank."""
    need_tree()
    import torch

    for rank, res in enumerate(gloo_world(_routes_worker, P, None)):
        for case, r in res.items():
            cu, valid = thd_cases(P)[case]
            mine, theirs = r["results"]["routes"], r["results"]["upstream"]
            assert torch.equal(mine[0], payload(cu, valid)[contiguous_rank_indices(cu[-1], P, rank)]), (rank, case)
            for got, want, what in zip(mine, theirs, ("contiguous", "back to zigzag", "input gradient")):
                assert torch.equal(got, want), (rank, case, what)
            assert torch.equal(mine[1], 2.0 * r["local"]), (rank, case)
            assert r["refused_short_input"], (rank, case)


@pytest.mark.parametrize("P", (1, 2, 3, 4, 8))
def test_zigzag_tokens_match_upstream_rank_indices_on_random_packs(P):
    """The route's own O(tokens) zigzag shard (no sort) lists the same tokens in the same order
    as upstream's get_thd_context_parallel_rank_indices, for random packs with empty segments."""
    need_tree()
    import random

    import torch

    from megatron.core.context_parallel_layout import get_thd_context_parallel_rank_indices
    from megatron.core.ssm.gdn_context_parallel import _zigzag_tokens

    rng = random.Random(1000 + P)
    for _ in range(40):
        lens = [2 * P * rng.choice((0, 1, 2, 3, 7)) for _ in range(rng.randint(1, 9))]
        cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.long)
        if int(cu[-1]) == 0:
            continue
        for rank in range(P):
            want = get_thd_context_parallel_rank_indices(cu, P, rank, "zigzag")
            got = _zigzag_tokens(cu, P, rank)
            assert torch.equal(got, want), (lens, rank)
            assert bool((got[1:] > got[:-1]).all()), "a zigzag shard is listed in ascending order"


@pytest.mark.parametrize("P", (2, 3, 4))
def test_host_routes_refuse_bad_cu_seqlens_on_every_rank_like_upstream(P):
    """cu_seqlens that upstream's THD conversion refuses (a length not divisible by 2*CP, not
    starting at 0, decreasing, not 1-D, not integer, on the meta device) make ThdLayoutRoutes
    raise LinearCPError on EVERY rank while building the route, naming the cause. A rank that
    built its route would enter the all-to-all while another refused (a hang), and a route
    built for [0, 5] at CP=2 silently dropped token 4 on both ranks."""
    need_tree()
    import torch

    from megatron.core.context_parallel_layout import get_thd_context_parallel_rank_indices
    from megatron.core.ssm.gdn_context_parallel import LinearCPError, ThdLayoutRoutes

    u = 2 * P
    bad = {
        "not_divisible": ([0, u + 1], "divisible by 2*CP"),
        "tail_not_divisible": ([0, u, 2 * u + P], "divisible by 2*CP"),
        "short": ([0, P], "divisible by 2*CP"),
        "odd_total": ([0, 5], "divisible by 2*CP"),
        "not_from_0": ([u, 2 * u], "start at 0"),
        "decreasing": ([0, 2 * u, u, 2 * u], "never decrease"),
    }
    for name, (cu, why) in bad.items():
        cu_t = torch.tensor(cu, dtype=torch.int64)
        with pytest.raises(ValueError):
            get_thd_context_parallel_rank_indices(cu_t, P, 0, "zigzag")
        for rank in range(P):
            with pytest.raises(LinearCPError, match=re.escape(why)):
                ThdLayoutRoutes(cu_t, FakeGroup(P, rank), "cpu")
    for cu_t, why in (
        (torch.tensor([[0, u]]), "1-D"),
        (torch.tensor([0.0, u]), "int32 or int64"),
        (torch.tensor([0, u], device="meta"), "meta"),
    ):
        for rank in range(P):
            with pytest.raises(LinearCPError, match=re.escape(why)):
                ThdLayoutRoutes(cu_t, FakeGroup(P, rank), "cpu")


@pytest.mark.parametrize("P", (2, 3, 4))
def test_all_gather_primitives_refuse_bad_cu_seqlens_before_any_collective(P):
    """gather_zigzag_sequence / scatter_zigzag_sequence (all_gather mode) build their token
    order with the same host route and checks as ThdLayoutRoutes: cu_seqlens with a length not
    divisible by 2*CP, not starting at 0 or decreasing raise LinearCPError naming the cause on
    every rank, before the gather's collective (a FakeGroup has none, so reaching it fails
    differently), where a silent route would drop or duplicate tail tokens."""
    need_tree()
    import torch

    from megatron.core.ssm.gdn_context_parallel import (
        LinearCPError,
        gather_zigzag_sequence,
        scatter_zigzag_sequence,
    )

    u = 2 * P
    for cu, why in (
        ([0, u + 1], "divisible by 2*CP"),
        ([0, u, 2 * u + P], "divisible by 2*CP"),
        ([u, 2 * u], "start at 0"),
        ([0, 2 * u, u, 2 * u], "never decrease"),
    ):
        cu_t = torch.tensor(cu, dtype=torch.int64)
        total = cu[-1]  # the buffer cu_seqlens describe, so only the named cause is wrong
        for rank in range(P):
            group = FakeGroup(P, rank)
            if total % P == 0:
                with pytest.raises(LinearCPError, match=re.escape(why)):
                    gather_zigzag_sequence(torch.zeros(total // P, 3), group, cu_seqlens=cu_t)
            with pytest.raises(LinearCPError, match=re.escape(why)):
                scatter_zigzag_sequence(torch.zeros(total, 3), group, cu_seqlens=cu_t)
    # cu_seqlens whose total is not the gathered / scattered length: refused, never a route
    # that drops or repeats tokens
    for rank in range(P):
        cu_t = torch.tensor([0, 2 * u], dtype=torch.int64)
        with pytest.raises(LinearCPError, match=re.escape("micro-batch holds")):
            gather_zigzag_sequence(torch.zeros(4 * u // P, 3), FakeGroup(P, rank), cu_seqlens=cu_t)
        with pytest.raises(LinearCPError, match=re.escape("micro-batch holds")):
            scatter_zigzag_sequence(torch.zeros(4 * u, 3), FakeGroup(P, rank), cu_seqlens=cu_t)
    # SBHD: one sequence whose global length does not split into 2*CP chunks
    for rank in range(P):
        with pytest.raises(LinearCPError, match=re.escape("divisible by 2*CP")):
            scatter_zigzag_sequence(torch.zeros(u + P, 2, 3), FakeGroup(P, rank))


def test_host_routes_on_a_cp1_group_are_the_identity_like_upstream():
    """At CP=1 upstream's conversion returns its input whatever the lengths (no zigzag split);
    ThdLayoutRoutes must too, not refuse odd lengths with a route error."""
    need_tree()
    import torch

    from megatron.core.ssm.gdn_context_parallel import ThdLayoutRoutes

    for cu in ([0, 5], [0, 3, 8], [0, 0, 7], [0, 6]):
        x = torch.arange(cu[-1] * 2, dtype=torch.float32).view(cu[-1], 2)
        routes = ThdLayoutRoutes(torch.tensor(cu, dtype=torch.int32), FakeGroup(1, 0), "cpu")
        assert torch.equal(routes.to_contiguous(x), x), cu
        assert torch.equal(routes.to_zigzag(x), x), cu
