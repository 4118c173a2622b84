"""Every fail-fast case of the contract raises ``LinearCPError`` before any collective.

Each case runs in a real gloo world (CP = 2 or 4) with a *collective bomb* armed: every
collective entry point of ``torch.distributed`` (and ``distributed_c10d``) is replaced by a
function that records its name and raises ``CollectiveCalled``. A case passes only if the
layer raises ``LinearCPError`` and the bomb recorded nothing. FLA is replaced by the CPU
stand-ins (``fla_emulation``) so that a missing check would run on instead of crashing
in a Triton kernel. Inputs: hidden ``[s_local, b, 128]`` float32.
"""

from __future__ import annotations

import pytest

from _image_env import need_fla, need_tree
from _world import FakeGroup

_TP_GROUP = []  # this rank's size-1 tensor-parallel group, created once per worker


def _build(mode, cp_group, *, cp, **extra):
    import gdn_harness as H

    geom = H.GEOMETRIES["gqa_dk32_dv64"]
    cfg = H.make_config(geom, cp=cp, mode=mode, cpu_init=True, **extra)
    m = H.build_gdn(cfg, H.make_pg(_TP_GROUP[0], cp_group))
    H.set_weights(m)
    return m, geom


def _attempt(fn):
    """Run ``fn`` with the bomb armed (``gdn_harness.attempt``)."""
    from gdn_harness import attempt

    return attempt(fn)


def _failfast_worker(rank, world, _):
    import torch
    import torch.distributed as dist

    import gdn_harness as H
    from fla_emulation import emulated_fla_in_megatron

    group = dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    _TP_GROUP[:] = [singles[rank]]
    out = {}
    with emulated_fla_in_megatron():
        hidden = H.GEOMETRIES["gqa_dk32_dv64"].hidden
        x = torch.randn(16, 1, hidden)

        # chunkwise + deterministic mode: at construction or at forward
        def det():
            m, _ = _build("chunkwise", group, cp=world, deterministic_mode=True)
            m(x, None)

        out["chunkwise_deterministic"] = _attempt(det)

        # chunkwise + inference context
        from megatron.core.inference.contexts import StaticInferenceContext

        m_chunk, _ = _build("chunkwise", group, cp=world)
        ctx = StaticInferenceContext(max_batch_size=1, max_sequence_length=64)
        out["chunkwise_inference_context"] = _attempt(lambda: m_chunk(x, None, inference_context=ctx))

        # chunkwise + SBHD batch > 1
        xb = torch.randn(16, 2, hidden)
        out["chunkwise_sbhd_batch2"] = _attempt(lambda: m_chunk(xb, None))

        # sequence length not divisible by 2*CP (SBHD global length; THD per sequence)
        x_odd = torch.randn(2 * world + 1, 1, hidden)  # global = world * (2*world+1)
        u = 2 * world
        bad_thd = H.Case("bad_thd", 4 * u, [0, u + world, 4 * u], [u + world, 3 * u - world])
        x_thd = torch.randn(bad_thd.length // world, 1, hidden)
        for mode in ("headwise", "chunkwise", "all_gather"):
            m, _ = _build(mode, group, cp=world)
            out[f"{mode}_sbhd_len_not_div_2cp"] = _attempt(lambda m=m: m(x_odd, None))
        for mode in ("headwise", "chunkwise", "all_gather"):
            m, _ = _build(mode, group, cp=world)
            psp = H.packed_seq_params(bad_thd, "cpu")
            out[f"{mode}_thd_len_not_div_2cp"] = _attempt(
                lambda m=m, psp=psp: m(x_thd, None, packed_seq_params=psp))

        # chunkwise: a rank's contiguous share (2 tokens) shorter than the conv halo (kernel - 1)
        tiny = H.Case("tiny_thd", 2 * world, [0, 2 * world], [2 * world])
        assert H.GEOMETRIES["gqa_dk32_dv64"].conv - 1 > 2
        out["chunkwise_share_below_conv_halo"] = _attempt(
            lambda: m_chunk(torch.randn(2, 1, hidden), None, packed_seq_params=H.packed_seq_params(tiny, "cpu")))

        # dynamic CP: local_cp_size must equal cp_group.size(), in every mode
        ok = H.CASES["thd_unequal"]
        x_ok = torch.randn(ok.length // world, 1, hidden)
        for mode in ("headwise", "chunkwise", "all_gather"):
            m, _ = _build(mode, group, cp=world)
            for wrong in (1, 2 * world):
                psp = H.packed_seq_params(ok, "cpu", cp_group=group, local_cp_size=wrong)
                out[f"{mode}_local_cp_size_{wrong}_vs_group_{world}"] = _attempt(
                    lambda m=m, psp=psp: m(x_ok, None, packed_seq_params=psp))

        # degenerate inputs, in every mode, at CP=1 and at this CP size (issue 12)
        from megatron.core.packed_seq_params import PackedSeqParams

        def psp_of(q, kv=None):
            kv = q if kv is None else kv
            return PackedSeqParams(qkv_format="thd", cu_seqlens_q=q, cu_seqlens_kv=kv,
                                   cu_seqlens_q_padded=q, cu_seqlens_kv_padded=kv)

        def i32(*v):
            return torch.tensor(v, dtype=torch.int32)

        n = 8 * world  # global tokens of the THD cases, local n // world per rank
        x_n = torch.randn(n // world, 1, hidden)
        big = 1 << 24  # 2**24 tokens x 2048+ channels: tensors of >= 2**31 elements (a view)
        degenerate = {
            "sbhd_zero_tokens": (torch.randn(0, 1, hidden), None),
            "thd_zero_tokens": (torch.randn(0, 1, hidden), psp_of(i32(0, 0))),
            "sbhd_tokens_fewer_than_2cp": (torch.randn(1, 1, hidden), None),
            "thd_cu_float": (x_n, psp_of(torch.tensor([0.0, n]))),
            "thd_cu_2d": (x_n, psp_of(i32(0, n)[None])),
            "thd_cu_not_from_zero": (x_n, psp_of(i32(4, n))),
            "thd_cu_decreasing": (x_n, psp_of(i32(0, n - 4, n - 8, n))),
            "thd_cu_last_mismatch": (x_n, psp_of(i32(0, n - 4))),
            "thd_cu_q_ne_kv": (x_n, psp_of(i32(0, 4 * world, n), i32(0, n))),
            "thd_cu_meta": (x_n, psp_of(torch.tensor([0, n], device="meta"))),
            "sbhd_2pow31_elements": (torch.zeros(1, 1, hidden).expand(big, 1, hidden), None),
            "thd_2pow31_elements": (torch.zeros(1, 1, hidden).expand(big, 1, hidden),
                                    psp_of(torch.tensor([0, big * world]))),
        }
        for mode in ("headwise", "chunkwise", "all_gather"):
            for cp, grp in ((1, singles[rank]), (world, group)):
                m, _ = _build(mode, grp, cp=cp)
                for name, (xi, psp) in degenerate.items():
                    if cp == 1 and name == "sbhd_tokens_fewer_than_2cp":
                        continue  # fine at CP=1
                    if cp == 1 and name == "thd_2pow31_elements":
                        psp = psp_of(torch.tensor([0, big]))
                    out[f"{mode}_cp{cp}_{name}"] = H.attempt(
                        lambda m=m, xi=xi, psp=psp: m(xi, None, packed_seq_params=psp), module=m)

        # control: valid input in each mode does reach a collective, so the bomb can see one
        for mode in ("headwise", "chunkwise", "all_gather"):
            m, _ = _build(mode, group, cp=world)
            psp = H.packed_seq_params(ok, "cpu")
            out[f"control_{mode}"] = _attempt(lambda m=m, psp=psp: m(x_ok, None, packed_seq_params=psp))

        # GatedDeltaNet.__init__ validates mode and geometry itself (config bypassed)
        def init_with(mode_after, cp_cfg, k_heads=None):
            import dataclasses

            geom = H.GEOMETRIES["gqa_dk32_dv64"]
            if k_heads:
                geom = dataclasses.replace(geom, k_heads=k_heads[0], v_heads=k_heads[1])
            cfg = H.make_config(geom, cp=cp_cfg, mode="chunkwise", cpu_init=True)
            object.__setattr__(cfg, "linear_cp_mode", mode_after)
            H.build_gdn(cfg, H.make_pg(_TP_GROUP[0], group))

        out["init_auto_mode"] = _attempt(lambda: init_with("auto", world))
        out["init_headwise_illegal_geometry"] = _attempt(
            lambda: init_with("headwise", 1, k_heads=(2 * world - 1, 2 * (2 * world - 1))))
    return out


_cache = {}


def results(world_fn, P):
    if P not in _cache:
        _cache[P] = world_fn(_failfast_worker, P, None)
    return _cache[P]


DEGENERATE = [
    "sbhd_zero_tokens", "thd_zero_tokens", "sbhd_tokens_fewer_than_2cp", "thd_cu_float",
    "thd_cu_2d", "thd_cu_not_from_zero", "thd_cu_decreasing", "thd_cu_last_mismatch",
    "thd_cu_q_ne_kv", "thd_cu_meta", "sbhd_2pow31_elements", "thd_2pow31_elements",
]


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("mode", ["headwise", "chunkwise", "all_gather"])
@pytest.mark.parametrize("case", DEGENERATE)
def test_degenerate_input_raises_before_any_collective_or_compute(gloo_world, P, mode, case):
    """Zero tokens, too few tokens, malformed cu_seqlens and tensors FLA would index past int32
    raise LinearCPError at CP=1 and CP=P, before any collective and before the projection."""
    need_tree()
    need_fla()
    for rank, res in enumerate(results(gloo_world, P)):
        for cp in (1, P):
            key = f"{mode}_cp{cp}_{case}"
            if key not in res:
                assert cp == 1 and case == "sbhd_tokens_fewer_than_2cp"
                continue
            r = res[key]
            assert r["raised"] == "LinearCPError", (rank, key, r)
            assert r["collectives"] == [], (rank, key, r)
            assert r["message"].strip(), r


CASE_NAMES = [
    "chunkwise_deterministic",
    "chunkwise_inference_context",
    "chunkwise_sbhd_batch2",
    "chunkwise_share_below_conv_halo",
    "chunkwise_sbhd_len_not_div_2cp",
    "chunkwise_thd_len_not_div_2cp",
    "all_gather_sbhd_len_not_div_2cp",
    "all_gather_thd_len_not_div_2cp",
    "headwise_sbhd_len_not_div_2cp",
    "headwise_thd_len_not_div_2cp",
    "init_auto_mode",
    "init_headwise_illegal_geometry",
]


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("case", CASE_NAMES)
def test_fail_fast_raises_linear_cp_error_before_any_collective(gloo_world, P, case):
    need_tree()
    need_fla()
    for rank, res in enumerate(results(gloo_world, P)):
        r = res[case]
        assert r["raised"] == "LinearCPError", (rank, r)
        assert r["collectives"] == [], (rank, r)
        assert r["message"].strip(), "the error must say what to change"


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("mode", ["headwise", "chunkwise", "all_gather"])
def test_local_cp_size_mismatch_raises_before_any_collective(gloo_world, P, mode):
    need_tree()
    need_fla()
    for rank, res in enumerate(results(gloo_world, P)):
        for wrong in (1, 2 * P):
            r = res[f"{mode}_local_cp_size_{wrong}_vs_group_{P}"]
            assert r["raised"] == "LinearCPError", (rank, wrong, r)
            assert r["collectives"] == [], (rank, wrong, r)


@pytest.mark.parametrize("mode", ["headwise", "chunkwise", "all_gather"])
def test_bomb_control_valid_input_reaches_a_collective(gloo_world, mode):
    """The detector works: the same layer on valid input trips the bomb, not LinearCPError."""
    need_tree()
    need_fla()
    for rank, res in enumerate(results(gloo_world, 2)):
        r = res[f"control_{mode}"]
        assert r["raised"] == "CollectiveCalled" and r["collectives"], (rank, r)


def test_init_error_messages_name_the_modes(gloo_world):
    need_tree()
    need_fla()
    res = results(gloo_world, 2)[0]
    for m in ("headwise", "chunkwise", "all_gather"):
        assert m in res["init_auto_mode"]["message"]
    msg = res["init_headwise_illegal_geometry"]["message"]
    assert "chunkwise" in msg and "all_gather" in msg


def test_headwise_dynamic_group_that_cannot_split_heads_fails_fast():
    """A dynamic CP group larger than the static one must still split the heads (headwise)."""
    import pytest as _pytest
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.ssm import gdn_context_parallel as g

    psp = PackedSeqParams(qkv_format="thd", cp_group=FakeGroup(4), local_cp_size=4)
    kwargs = dict(packed_seq_params=psp, local_seq_len=8, batch=1, sp_size=1,
                  deterministic_mode=False, has_inference_context=False,
                  num_key_heads=2, num_value_heads=6, tp_size=1)
    with _pytest.raises(g.LinearCPError, match="chunkwise"):
        g.plan_linear_cp("headwise", FakeGroup(2), **kwargs)
    # the same dynamic group is fine for the modes that keep all heads on each rank
    assert g.plan_linear_cp("chunkwise", FakeGroup(2), **kwargs).size == 4


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("cu", [
    [0, 0, 64, 200, 256], [0, 64, 64, 200, 256], [0, 64, 200, 256, 256],
    [0, 0, 0, 64, 64, 200, 200, 256, 256],
])
def test_packed_seq_metadata_drops_empty_segments(cu, dtype):
    """Repeated boundaries anywhere are dropped; dtype and device are kept; the host copy
    matches (FLA and the layout helpers take it as cu_seqlens_cpu)."""
    need_tree()
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.ssm.gdn_context_parallel import PackedSeqMetadata, packed_seq_metadata

    t = torch.tensor(cu, dtype=getattr(torch, dtype))
    actual = torch.tensor([0] + [max(0, c - 3) for c in cu[1:]], dtype=t.dtype).cummax(0).values
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=actual, cu_seqlens_kv=actual,
                          cu_seqlens_q_padded=t, cu_seqlens_kv_padded=t.clone())
    meta = packed_seq_metadata(psp, 256)
    assert isinstance(meta, PackedSeqMetadata) and psp.gdn_packed_metadata is meta
    assert meta.cu_seqlens.tolist() == [0, 64, 200, 256]
    assert meta.cu_seqlens_cpu.tolist() == [0, 64, 200, 256]
    assert meta.cu_seqlens.dtype == t.dtype and meta.cu_seqlens_cpu.device.type == "cpu"


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_packed_seq_metadata_never_hands_out_the_callers_tensor(dtype):
    """Without empty segments the values are the caller's, but never its tensor or memory:
    FLA caches on tensor identity (FLA #1274), so a loader that rewrites its cu_seqlens in place
    would otherwise get the previous micro-batch's chunk indices."""
    need_tree()
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.ssm.gdn_context_parallel import packed_seq_metadata

    t = torch.tensor([0, 64, 200, 256], dtype=getattr(torch, dtype))
    meta = packed_seq_metadata(PackedSeqParams(qkv_format="thd", cu_seqlens_q=t, cu_seqlens_kv=t), 256)
    for mine in (meta.cu_seqlens, meta.cu_seqlens_cpu):
        assert mine is not t and mine.tolist() == t.tolist() and mine.dtype == t.dtype
        assert mine.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert meta.cu_seqlens is not meta.cu_seqlens_cpu  # FLA's device tensor is the metadata's own
    t[1] = 128  # the caller's rewrite reaches none of them
    assert meta.cu_seqlens.tolist() == [0, 64, 200, 256] == meta.cu_seqlens_cpu.tolist()


@pytest.mark.parametrize("mode", ["headwise", "chunkwise", "all_gather"])
def test_kernel_extent_limit_is_2_pow_31_elements(mode):
    """The bound sits at 2**31 elements: 2**31 raise, just below passes (FLA 0.4.2 int32 offsets)."""
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import LinearCPError, LinearCPPlan, check_kernel_extent

    kernel_tokens = 2**21  # the tokens one rank hands to FLA; chunkwise holds 1/CP of them
    plan = LinearCPPlan(mode=mode, group=None, size=2,
                        global_seq_len=kernel_tokens * (2 if mode == "chunkwise" else 1))
    kw = dict(scan_heads=1, key_head_dim=8, value_head_dim=8)  # scan width 64 < conv width
    with pytest.raises(LinearCPError, match="2\\*\\*31"):
        check_kernel_extent(plan, 1, conv_channels=1024, **kw)  # 2**21 * 1024 == 2**31
    check_kernel_extent(plan, 1, conv_channels=1023, **kw)
