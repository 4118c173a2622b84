"""The GPU kernel harness (``kernel_matrix``) judged on CPU: right kernels pass, wrong ones fail.

FLA's Triton kernels cannot run on CPU, so the harness is driven with stand-ins in a 4-rank
gloo world: the faithful stand-ins of ``fla_emulation`` must pass every gate, and two
deliberately broken CP kernels, a conv that ignores the previous rank's halo and a scan
that restarts every rank from a zero state, must fail them. This checks the sharding,
gathering and gating logic that the GPU run relies on, not FLA.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from _image_env import need_torch

SELECT = r"lens_63_64_65_64/cp4|single_T256_shard64/cp4|oracle"


def _broken_conv(x, weight=None, bias=None, activation=None, cu_seqlens=None,
                 cp_context=None, **kw):
    import torch

    import fla_emulation as E
    import gdn_reference as ref

    if cp_context is None:
        return E.causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens)
    local = torch.tensor([0, x.shape[1]])  # BUG on purpose: no halo from the previous rank
    return ref.causal_conv1d_ref(x, weight, bias, activation, local), None


def _broken_gdn(q, k, v, g, beta, cu_seqlens=None, cp_context=None, **kw):
    import torch

    import gdn_reference as ref

    cu = torch.tensor([0, q.shape[1]]) if cp_context is not None else cu_seqlens
    o, _ = ref.gdn_chunked(q.float(), k.float(), v.float(), g.float(), beta.float(),
                           cu_seqlens=cu)  # BUG on purpose: zero state on every rank
    return o.to(v.dtype), None


def _worker(rank, world, broken):
    import fla_emulation as E
    import kernel_matrix as KM

    K = SimpleNamespace(build_cp_context=E.build_cp_context,
                        causal_conv1d=_broken_conv if broken else E.causal_conv1d,
                        chunk_gated_delta_rule=_broken_gdn if broken else E.chunk_gated_delta_rule)
    import re

    return KM.run_kernels(rank, world, "cpu", kernels=K,
                          select=lambda rid: re.search(SELECT, rid) is not None)


@pytest.mark.parametrize("broken", [False, True], ids=["faithful", "broken"])
def test_kernel_gates_separate_right_from_wrong(gloo_world, broken):
    need_torch()
    records = [r for recs in gloo_world(_worker, 4, broken) for r in recs]
    gated = [r for r in records if r["kind"] in ("kernel_conv", "kernel_gdn")]
    assert {r["id"] for r in gated} == {
        f"kernel/{op}/{c}/cp4" for op in ("conv", "gdn")
        for c in ("lens_63_64_65_64", "single_T256_shard64")}
    if not broken:
        assert all(r["passed"] for r in records), [r["id"] for r in records if not r["passed"]]
    else:
        assert not any(r["passed"] for r in gated), [r["id"] for r in gated if r["passed"]]


@pytest.mark.parametrize("case,passed,upstream", [
    ("equal", True, True),
    ("one_element_past_bound_high_cosine", False, True),  # upstream's cosine fallback only
    ("high_cosine_but_relative_l2_over_limit", False, False),
    ("low_cosine", False, False),
    ("non_finite_where_ref_is_zero", False, False),
])
def test_compare_gate_is_strict_and_upstream_rule_is_reported(case, passed, upstream):
    """``gdn_harness.compare`` gates with the frozen rule (allclose AND cosine, all finite);
    upstream's rule (allclose, else cosine and relative L2 <= 0.1) is reported beside it."""
    need_torch()
    import torch

    import gdn_harness as H

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4096, generator=g, dtype=torch.float64) * 10
    got = ref.clone()
    rel_l2_max = 0.1
    if case == "one_element_past_bound_high_cosine":
        got[7] = ref[7] + 0.05 + 0.02 * ref[7].abs()  # past 2e-3 + 1e-2*|ref| at one element
    elif case == "high_cosine_but_relative_l2_over_limit":
        got = ref * 1.5  # cosine 1.0, relative L2 0.5
    elif case == "low_cosine":
        got = ref + torch.randn(4096, generator=g, dtype=torch.float64) * 3
    elif case == "non_finite_where_ref_is_zero":
        ref[0] = 0.0
        got = ref.clone()
        got[0] = float("inf")
    rec = H.compare(got, ref, atol=2e-3, rtol=1e-2, cos_min=0.9999, rel_l2_max=rel_l2_max)
    assert rec["passed"] is passed and rec["upstream_rule_passed"] is upstream
    if case == "one_element_past_bound_high_cosine":
        assert rec["worst_bound_ratio"] > 1 and rec["cosine"] >= 0.9999
    if case == "high_cosine_but_relative_l2_over_limit":
        assert rec["cosine"] >= 0.9999 and rec["nrms"] > rel_l2_max
    if case == "non_finite_where_ref_is_zero":
        assert rec["finite"] is False


def _dk_halved(q, k, v, g, beta, **kw):
    """The scan of fla_emulation with dk halved in the backward: the kind of fault
    fla-org/flash-linear-attention#640 reports (wrong dk, forward right)."""
    import torch

    import fla_emulation as E

    class HalveGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad * 0.5

    return E.chunk_gated_delta_rule(q, HalveGrad.apply(k), v, g, beta, **kw)


@pytest.mark.parametrize("kernel", ["faithful", "dk_halved"])
@pytest.mark.parametrize("gating", ["gate", "probe"])
def test_scan_oracle_check_catches_a_wrong_gradient_the_forward_hides(kernel, gating):
    """kernel_oracle (GPU job ``oracle``): every case (bf16 and float32, single and packed,
    K = V = 128) passes with the faithful stand-in; with dk halved only in the backward
    every gated case fails on dk (and on nothing the fault does not touch: out, dv); as a
    probe (the old tree's FLA) the records pass but say they did not match."""
    need_torch()
    import fla_emulation as E
    import kernel_oracle as KO

    rule = E.chunk_gated_delta_rule if kernel == "faithful" else _dk_halved
    records = KO.run_oracle(0, 1, "cpu", chunk_gated_delta_rule=rule, gating=gating)
    assert [r["id"] for r in records] == KO.case_ids()
    assert all(set(r["checks"]) == {"out", "dq", "dk", "dv", "dg", "dbeta"} for r in records)
    for r in records:
        assert r["error"] is None, r["error"]
        assert r["passed"] == (gating == "probe" or kernel == "faithful"), r["id"]
        assert r["checks"]["out"]["passed"] and r["checks"]["dv"]["passed"], r["id"]
        assert r["matched"] == (kernel == "faithful"), r["id"]
        assert r["checks"]["dk"]["passed"] == (kernel == "faithful"), r["id"]
        if gating == "probe":
            assert ("did NOT match" in r["note"]) == (kernel != "faithful"), r["note"]
