"""One packed-metadata object per micro-batch, never stale (issue 43), on CPU.

``finalize_packed_seq_params`` (upstream dev's name, importable from
``megatron.core.context_parallel_layout``) builds a packed micro-batch's
``gdn_context_parallel.PackedSeqMetadata`` once; the GDN layers check that it still matches the
``PackedSeqParams`` they get and otherwise rebuild it (``packed_seq_metadata``). Tested here:

(a) the entry point: importable from upstream's module, returns its argument, resolves the CP
    group (the params' own, else ``parallel_state``'s), SBHD gets only the group, CP=1 THD gets
    host boundaries and a device tensor of its own and no route, idempotent; by default it
    prebuilds the CP state of the modes the process's GDN layers registered.
(b) every kind of buffer reuse a data loader does (:data:`KINDS`: an in-place ``copy_``, a slice
    assignment, a broadcast into a reused tensor on the receiving rank, ``.data.copy_``, a numpy
    view write, a new tensor of equal values, one ``PackedSeqParams`` across micro-batches, one
    ``cu_seqlens`` shared by two params) at CP 1/2/4 in all three modes, finalized after the
    write (the contract), not finalized, and finalized before the write only (stale): the
    output, the input gradient and every parameter gradient of the micro-batch are bit-equal to
    those of a fresh ``PackedSeqParams`` of the same values, or the run ends in a
    ``LinearCPError`` naming ``finalize_packed_seq_params``; and FLA never receives a tensor the
    caller owns (any ``cu_seqlens`` tensor reachable from the params).
(c) the counters (``PACKED_METADATA_COUNTS`` and a spy on the host copy): at finalize one host
    copy and, at CP > 1, the state of the layers' mode once (chunkwise: one route and one FLA
    context; all_gather: one index pair); in the layers nothing at all, at depth L = 2 and 8,
    forward + backward with recompute, every mode, CP 1/2/4 and dynamic CP (one CP=4 layer
    stack, micro-batches on CP 1/2/4 subgroups). Without finalize: exactly one layer build and
    one host copy per micro-batch (plus the mode's state), and one warning naming
    finalize_packed_seq_params. Finalized without the mode's state: built late in the layers,
    counted, no copy. Packed input with empty segments and distinct q/kv tensors (one copy of
    both); SBHD: nothing; a metadata that never matches: one copy per layer (the control).

The fault issue 43 fixed lived in FLA's identity-keyed caches (``fla.utils.tensor_cache``: one
entry, ``is``): the stand-ins of ``fla_emulation`` reproduce them (:class:`fla_emulation.
TensorCache`), so a tree that handed FLA the caller's rewritten tensor gets wrong numbers here
too (:func:`test_the_stand_ins_reproduce_flas_identity_cache`). On CPU every boundary tensor is
a host tensor, whose values the layers compare, so even the writes no version counter sees
must come out right unfinalized; on a GPU they are the contract's "finalize after the last
write" (not testable here). The real kernels run the in-place ``copy_`` case in the real-FLA
tier (``fla_interpret_tier``, items ``reuse/...``).

Geometry: hidden 32, 4 key / 4 value heads, K = V = 16, conv 4, float32; 64 tokens packed as
:data:`PACK_A` then :data:`PACK_B` (no empty segment: the case where the old tree handed FLA
the caller's own tensor). Two 4-rank gloo worlds (one for (b), one for (c)); CP=1 and CP=2
items are split between the two rank pairs.
"""

from __future__ import annotations

import contextlib
import warnings
from unittest import mock

import pytest

from _image_env import need_fla, need_tree
from _world import FakeGroup
from test_image_host_sync import count_host_copies

PACK_A = (0, 16, 40, 64)
PACK_B = (0, 24, 32, 64)
TOKENS = 64
GEOM = dict(hidden=32, k_heads=4, v_heads=4, dk=16, dv=16, conv=4)
MODES = ("headwise", "chunkwise", "all_gather")
CP_SIZES = (1, 2, 4)
KINDS = ("copy_", "slice", "broadcast", "data_copy", "numpy_view", "new_equal", "one_psp", "shared")
VARIANTS = ("finalized", "not_finalized", "stale")
FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
FINALIZE = "finalize_packed_seq_params"


def _make_psp(cu, **kw):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", max_seqlen_q=TOKENS, max_seqlen_kv=TOKENS,
                           **{f: cu for f in FIELDS}, **kw)


def _tensor(pack):
    import torch

    return torch.tensor(pack, dtype=torch.int32)


# --------------------------------------------------------------------------------------
# (a) the entry point
# --------------------------------------------------------------------------------------


def test_finalize_imports_from_upstreams_module_and_returns_its_argument():
    need_tree()
    from megatron.core import context_parallel_layout as layout
    from megatron.core.context_parallel_layout import finalize_packed_seq_params
    from megatron.core.ssm import gdn_context_parallel as g

    assert finalize_packed_seq_params is g.finalize_packed_seq_params
    assert layout.prebuild_thd_cp_partition_routes is g.prebuild_thd_cp_partition_routes
    psp = _make_psp(_tensor(PACK_A))
    assert finalize_packed_seq_params(psp) is psp
    assert finalize_packed_seq_params(None) is None


@contextlib.contextmanager
def _fla_context_stub():
    need_fla()
    import fla.ops.cp

    import fla_emulation

    with mock.patch.object(fla.ops.cp, "build_cp_context", fla_emulation.build_cp_context):
        yield


@contextlib.contextmanager
def _layer_modes(*modes):
    """The linear_cp_modes the GatedDeltaNet layers of this process registered, for the block
    (finalize's default prebuild; other tests of the process build layers of any mode)."""
    from megatron.core.ssm import gdn_context_parallel as g

    with mock.patch.object(g, "_LAYER_MODES", set(modes)):
        yield


def test_finalize_resolves_the_cp_group_of_the_params_first():
    need_tree()
    from megatron.core import parallel_state
    from megatron.core.context_parallel_layout import finalize_packed_seq_params

    own, static = FakeGroup(2, 1), FakeGroup(4, 0)
    psp = _make_psp(_tensor(PACK_A), cp_group=own, local_cp_size=2)
    with _fla_context_stub(), _layer_modes("chunkwise"), mock.patch.object(
            parallel_state, "get_context_parallel_group", lambda check_initialized=True: static):
        finalize_packed_seq_params(psp)
    meta = psp.gdn_packed_metadata
    assert psp.cp_group is own and meta.group is own and meta.size == 2
    assert psp.cp_partition_route is meta.route and meta.route.group is own


def test_finalize_resolves_the_cp_group_from_parallel_state_else():
    need_tree()
    from megatron.core import parallel_state
    from megatron.core.context_parallel_layout import finalize_packed_seq_params

    static = FakeGroup(2, 0)
    psp = _make_psp(_tensor(PACK_A))
    with _fla_context_stub(), mock.patch.object(
            parallel_state, "get_context_parallel_group", lambda check_initialized=True: static):
        finalize_packed_seq_params(psp)
    assert psp.cp_group is static and psp.gdn_packed_metadata.group is static
    # no CP initialised at all: CP=1 metadata, no group set
    psp = _make_psp(_tensor(PACK_A))
    finalize_packed_seq_params(psp)
    assert psp.cp_group is None and psp.gdn_packed_metadata.size == 1


def test_finalize_of_sbhd_sets_only_the_group():
    need_tree()
    from megatron.core.context_parallel_layout import finalize_packed_seq_params
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.ssm import gdn_context_parallel as g

    group = FakeGroup(2, 0)
    for psp in (PackedSeqParams(qkv_format="sbhd"), PackedSeqParams()):
        before = dict(g.PACKED_METADATA_COUNTS)
        assert finalize_packed_seq_params(psp, cp_group=group) is psp
        assert psp.cp_group is group
        assert psp.gdn_packed_metadata is None and psp.cp_partition_route is None
        assert dict(g.PACKED_METADATA_COUNTS) == before


def test_finalize_at_cp1_builds_host_boundaries_and_a_device_tensor_of_its_own_only():
    need_tree()
    from megatron.core.context_parallel_layout import finalize_packed_seq_params
    from megatron.core.ssm import gdn_context_parallel as g

    cu = _tensor(PACK_A)
    psp = _make_psp(cu)
    before = dict(g.PACKED_METADATA_COUNTS)
    finalize_packed_seq_params(psp)
    meta = psp.gdn_packed_metadata
    assert isinstance(meta, g.PackedSeqMetadata) and meta.finalized and meta.size == 1
    assert meta.host_q.tolist() == list(PACK_A) and meta.host_q.device.type == "cpu"
    assert meta.cu_seqlens.tolist() == list(PACK_A) and meta.cu_seqlens.dtype == cu.dtype
    for mine in (meta.host_q, meta.cu_seqlens_cpu, meta.cu_seqlens):
        assert mine.untyped_storage().data_ptr() != cu.untyped_storage().data_ptr()
    assert meta.route is None and psp.cp_partition_route is None
    delta = {k: g.PACKED_METADATA_COUNTS[k] - before.get(k, 0) for k in g.PACKED_METADATA_COUNTS}
    assert {k: v for k, v in delta.items() if v} == {"finalized": 1, "host_copies": 1}
    assert meta.matches(psp, None)


@pytest.mark.parametrize("cp", [1, 2])
def test_finalize_is_idempotent(cp):
    need_tree()
    from megatron.core.context_parallel_layout import finalize_packed_seq_params
    from megatron.core.ssm import gdn_context_parallel as g

    group = FakeGroup(cp, cp - 1) if cp > 1 else None
    psp = _make_psp(_tensor(PACK_A))
    with _fla_context_stub():
        finalize_packed_seq_params(psp, cp_group=group, linear_cp_modes=MODES)
        first = psp.gdn_packed_metadata
        assert finalize_packed_seq_params(psp, cp_group=group, linear_cp_modes=MODES) is psp
    second = psp.gdn_packed_metadata
    assert second.finalized and second.matches(psp, group) and first.matches(psp, group)
    assert psp.cp_partition_route is second.route
    for name in ("host_q", "host_kv", "cu_seqlens_cpu", "cu_seqlens"):
        assert getattr(first, name).tolist() == getattr(second, name).tolist()
    if cp > 1:
        for a, b in zip(first.gather_index(), second.gather_index()):
            assert a.tolist() == b.tolist()
        for a, b in zip(first.route._to_contiguous[1:], second.route._to_contiguous[1:]):
            assert (a.tolist() if hasattr(a, "tolist") else a) == (b.tolist() if hasattr(b, "tolist") else b)
        assert first.fla_cp_context(4).cu_seqlens.tolist() == second.fla_cp_context(4).cu_seqlens.tolist()
    # a layer reads the second one as it is: no build
    built = g.PACKED_METADATA_COUNTS["layer_built"]
    assert g.packed_seq_metadata(psp, TOKENS, group) is second
    assert g.PACKED_METADATA_COUNTS["layer_built"] == built


@pytest.mark.parametrize("registered,built", [
    ((), {}),
    (("headwise",), {}),
    (("chunkwise",), {"routes": 1, "fla_contexts": 1}),
    (("all_gather",), {"gather_indices": 1}),
    (("headwise", "chunkwise", "all_gather"), {"routes": 1, "fla_contexts": 1, "gather_indices": 1}),
])
def test_finalize_prebuilds_the_state_of_the_registered_layer_modes(registered, built):
    """By default finalize builds the CP state of exactly the modes the process's GatedDeltaNet
    layers were built with (each layer registers its mode at construction)."""
    need_tree()
    from megatron.core.context_parallel_layout import finalize_packed_seq_params
    from megatron.core.ssm import gdn_context_parallel as g

    before = dict(g.PACKED_METADATA_COUNTS)
    with _fla_context_stub(), _layer_modes(*registered):
        finalize_packed_seq_params(_make_psp(_tensor(PACK_A)), cp_group=FakeGroup(2, 0))
    want = {"finalized": 1, "host_copies": 1, **built}
    assert _count_delta(before) == want


def test_building_a_gdn_layer_registers_its_mode():
    need_tree()
    import gdn_harness as H
    from megatron.core.ssm import gdn_context_parallel as g

    with _layer_modes(), mock.patch("torch.cuda.current_device", lambda: "cpu"):
        for mode in ("all_gather", "chunkwise"):
            H.build_gdn(H.make_config(_geometry(), cp=1, mode=mode, cpu_init=True),
                        H.make_pg(FakeGroup(1), FakeGroup(1)))
        assert g._LAYER_MODES == {"all_gather", "chunkwise"}


def test_finalize_refuses_bad_boundaries_in_the_data_path():
    need_tree()
    from megatron.core.context_parallel_layout import finalize_packed_seq_params
    from megatron.core.ssm.gdn_context_parallel import LinearCPError

    with pytest.raises(LinearCPError, match="never decrease"):
        finalize_packed_seq_params(_make_psp(_tensor((0, 40, 16, 64))))
    with pytest.raises(LinearCPError, match="divisible by 2\\*CP=4"):
        finalize_packed_seq_params(_make_psp(_tensor((0, 10, 64))), cp_group=FakeGroup(2, 0),
                                   linear_cp_modes=("all_gather",))
    with pytest.raises(LinearCPError, match="linear_cp_mode='auto'"):
        finalize_packed_seq_params(_make_psp(_tensor(PACK_A)), linear_cp_modes=("auto",))


def test_host_copies_counter_counts_the_copies():
    """``PACKED_METADATA_COUNTS["host_copies"]`` is documented as the device->host copies of
    boundaries: it must move with every copy the metadata makes (once per build here), and not
    when the loader gives its host copy."""
    need_tree()
    import torch

    from megatron.core.context_parallel_layout import finalize_packed_seq_params
    from megatron.core.ssm import gdn_context_parallel as g

    before = g.PACKED_METADATA_COUNTS["host_copies"]
    finalize_packed_seq_params(_make_psp(_tensor(PACK_A)))
    g.packed_seq_metadata(_make_psp(_tensor(PACK_A)), TOKENS)
    assert g.PACKED_METADATA_COUNTS["host_copies"] - before == 2
    finalize_packed_seq_params(_make_psp(_tensor(PACK_A)),
                               cu_seqlens_cpu=torch.tensor(PACK_A, dtype=torch.int64))
    assert g.PACKED_METADATA_COUNTS["host_copies"] - before == 2


# --------------------------------------------------------------------------------------
# the stand-ins reproduce FLA's identity cache
# --------------------------------------------------------------------------------------


def test_the_stand_ins_reproduce_flas_identity_cache(monkeypatch):
    """The same tensor object with new values gets the old boundaries (FLA #1274); a new tensor
    gets its own; FLA_DISABLE_TENSOR_CACHE=1 turns the cache off."""
    need_tree()
    import torch

    import fla_emulation as E

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, TOKENS, 8, generator=gen)
    w = torch.randn(8, 4, generator=gen)

    def conv(cu):
        return E.causal_conv1d(x, w, None, activation="silu", cu_seqlens=cu)[0]

    want_a, want_b = conv(_tensor(PACK_A)), conv(_tensor(PACK_B))
    assert not torch.equal(want_a, want_b)
    cu = _tensor(PACK_A)
    assert torch.equal(conv(cu), want_a)
    cu.copy_(_tensor(PACK_B))
    assert torch.equal(conv(cu), want_a)  # stale, as FLA 0.4.2
    assert torch.equal(conv(_tensor(PACK_B)), want_b)
    monkeypatch.setenv("FLA_DISABLE_TENSOR_CACHE", "1")
    cu = _tensor(PACK_A)
    conv(cu)
    cu.copy_(_tensor(PACK_B))
    assert torch.equal(conv(cu), want_b)


# --------------------------------------------------------------------------------------
# worlds: groups, stacks of GDN layers
# --------------------------------------------------------------------------------------


class _Groups:
    """Every rank makes every group in the same order: singles, pairs [0,1] [2,3], the quad."""

    def __init__(self):
        import torch.distributed as dist

        rank = dist.get_rank()
        singles = [dist.new_group([r]) for r in range(4)]
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        self.quad = dist.new_group([0, 1, 2, 3])
        self.single, self.pair, self.pair_index = singles[rank], pairs[rank // 2], rank // 2

    def cp(self, size):
        return {1: self.single, 2: self.pair, 4: self.quad}[size]


def _geometry():
    import gdn_harness as H

    return H.Geometry(**GEOM)


def _build_stack(mode, cp, group, groups, layers, seed=100):
    """``layers`` GatedDeltaNet layers of ``mode`` on CP group ``group``; the process's registered
    layer modes (finalize's default prebuild) become exactly ``{mode}``."""
    import gdn_harness as H
    from megatron.core.ssm import gdn_context_parallel as g

    g._LAYER_MODES.clear()

    cfg = H.make_config(_geometry(), cp=cp, mode=mode, cpu_init=True)
    stack = []
    for i in range(layers):
        m = H.build_gdn(cfg, H.make_pg(groups.single, group))
        H.set_weights(m, seed=seed + i)
        stack.append(m)
    return stack


def _run_stack(stack, x, G, psp, recompute=False):
    """Forward (residual stack) + backward of ``sum(out * G)``: out, dx, every param grad."""
    from torch.utils.checkpoint import checkpoint

    for m in stack:
        m.zero_grad(set_to_none=True)
    h = x.detach().clone().requires_grad_(True)
    out = h
    for m in stack:
        def fwd(inp, m=m):
            y, _ = m(inp, None, packed_seq_params=psp)
            return inp + y

        out = checkpoint(fwd, out, use_reentrant=False) if recompute else fwd(out)
    (out * G).sum().backward()
    grads = [p.grad.detach().clone() for m in stack for p in m.parameters()]
    return {"out": out.detach(), "dx": h.grad.detach(), "grads": grads}


def _inputs():
    import torch

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(TOKENS, 1, GEOM["hidden"], generator=gen)
    G = torch.randn(TOKENS, 1, GEOM["hidden"], generator=gen)
    return x, G


def _shard(pack, cp, group):
    import torch
    import torch.distributed as dist

    from cp_layout_ref import zigzag_rank_indices

    lens = [b - a for a, b in zip(pack[:-1], pack[1:])]
    return torch.tensor(zigzag_rank_indices(lens, cp, dist.get_rank(group)), dtype=torch.long)


def _differences(got, ref):
    """Names of the results that are not bit-equal, with their largest difference."""
    import torch

    pairs = [("out", got["out"], ref["out"]), ("dx", got["dx"], ref["dx"])]
    pairs += [(f"grad{i}", a, b) for i, (a, b) in enumerate(zip(got["grads"], ref["grads"]))]
    out = {}
    for name, a, b in pairs:
        if a.shape != b.shape:
            out[name] = f"shape {tuple(a.shape)} != {tuple(b.shape)}"
        elif not torch.equal(a, b):
            out[name] = float((a.double() - b.double()).abs().nan_to_num(float("inf")).max())
    return out


def _caller_owned(received, *psps):
    """The (entry point, argument) pairs of tensors FLA received that the caller owns: any
    ``cu_seqlens`` tensor of the params, or memory of one."""
    owned = [getattr(p, f) for p in psps for f in FIELDS if getattr(p, f, None) is not None]
    ptrs = {t.untyped_storage().data_ptr() for t in owned}
    return [f"{entry}:{arg}" for entry, arg, t in received
            if any(t is o for o in owned) or t.untyped_storage().data_ptr() in ptrs]


def _count_delta(before):
    from megatron.core.ssm import gdn_context_parallel as g

    return {k: v - before.get(k, 0) for k, v in g.PACKED_METADATA_COUNTS.items()
            if v - before.get(k, 0)}


# --------------------------------------------------------------------------------------
# (b) every kind of reuse, CP 1/2/4, every mode, finalized / not / stale
# --------------------------------------------------------------------------------------


def _reuse_item(kind, variant, stack, group, bcast_group, x, G, refs):
    """One micro-batch of PACK_A, the loader's write for the next one, then that micro-batch.
    Returns a JSON-able record of the second micro-batch."""
    import torch.distributed as dist

    import fla_emulation
    from megatron.core.context_parallel_layout import finalize_packed_seq_params
    from megatron.core.ssm import gdn_context_parallel as g

    cp = group.size()

    def finalize(psp):
        finalize_packed_seq_params(psp, cp_group=group)

    cu = _tensor(PACK_A)
    psp_a = _make_psp(cu)
    psp_b = _make_psp(cu) if kind == "shared" else psp_a  # shared: two params, one cu_seqlens
    if variant != "not_finalized":
        finalize(psp_a)
        if kind == "shared" and variant == "stale":
            finalize(psp_b)  # finalized before the write: stale after it
    idx = _shard(PACK_A, cp, group)
    with fla_emulation.record_fla_tensor_args() as got_a:
        _run_stack(stack, x[idx], G[idx], psp_a)
    # the loader's write for the next micro-batch
    want = PACK_A if kind == "new_equal" else PACK_B
    new = _tensor(want)
    receiver = None
    if kind in ("copy_", "shared"):
        cu.copy_(new)
    elif kind == "slice":
        cu[1:] = new[1:]
    elif kind == "broadcast":
        src = dist.get_global_rank(bcast_group, 0)
        receiver = dist.get_rank() != src
        if not receiver:
            cu.copy_(new)
        version = cu._version
        dist.broadcast(cu, src=src, group=bcast_group)
        assert cu.tolist() == list(want) and (not receiver or cu._version == version)
    elif kind == "data_copy":
        cu.data.copy_(new)
    elif kind == "numpy_view":
        cu.numpy()[:] = new.numpy()
    elif kind in ("new_equal", "one_psp"):
        for f in FIELDS:
            setattr(psp_a, f, new)
    else:
        raise AssertionError(kind)
    if variant == "finalized":
        finalize(psp_b)
    idx = _shard(want, cp, group)
    before = dict(g.PACKED_METADATA_COUNTS)
    raised = None
    with fla_emulation.record_fla_tensor_args() as got_b, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res = _run_stack(stack, x[idx], G[idx], psp_b)
        except g.LinearCPError as exc:
            raised, res = str(exc), None
    return {"receiver": receiver, "raised": raised,
            "differences": None if res is None else _differences(res, refs[want]),
            "caller_owned": _caller_owned(got_a + got_b, psp_a, psp_b),
            "counts": _count_delta(before),
            "warnings": [str(w.message) for w in caught if FINALIZE in str(w.message)]}


def _reuse_worker(rank, world, _):
    import torch.distributed as dist

    from fla_emulation import emulated_fla_in_megatron

    groups = _Groups()
    x, G = _inputs()
    records = []
    with emulated_fla_in_megatron():
        for cp in CP_SIZES:
            group = groups.cp(cp)
            bcast_group = groups.quad if cp == 4 else groups.pair
            for mode in MODES:
                # CP=1 and CP=2: the pairs take alternate modes (a pair runs an item together)
                if cp < 4 and MODES.index(mode) % 2 != groups.pair_index:
                    continue
                stack = _build_stack(mode, cp, group, groups, layers=2)
                refs = {}
                for pack in (PACK_A, PACK_B):
                    idx = _shard(pack, cp, group)
                    refs[pack] = _run_stack(stack, x[idx], G[idx], _make_psp(_tensor(pack)))
                for kind in KINDS:
                    for variant in VARIANTS:
                        rec = _reuse_item(kind, variant, stack, group, bcast_group, x, G, refs)
                        rec.update(id=f"cp{cp}/{mode}/{kind}/{variant}", cp=cp, mode=mode,
                                   kind=kind, variant=variant, rank=rank)
                        records.append(rec)
            dist.barrier()
    return records


_cache = {}


def _reuse_records(gloo_world):
    if "reuse" not in _cache:
        _cache["reuse"] = [r for recs in gloo_world(_reuse_worker, 4, None, timeout=900) for r in recs]
    return _cache["reuse"]


def _reuse_problems(r):
    problems = []
    if r["caller_owned"]:
        problems.append(f"FLA received tensors the caller owns: {sorted(set(r['caller_owned']))}")
    if r["raised"] is not None:
        if FINALIZE not in r["raised"]:
            problems.append(f"LinearCPError without naming {FINALIZE}: {r['raised'][:300]}")
        return problems
    if r["differences"]:
        problems.append(f"not bit-equal to a fresh PackedSeqParams: {r['differences']}")
    built, stale = r["counts"].get("layer_built", 0), r["counts"].get("stale", 0)
    want = {"finalized": (0, 0), "not_finalized": (1, 0), "stale": (1, 1)}[r["variant"]]
    if (built, stale) != want:
        problems.append(f"layer builds / stale {built}/{stale}, expected {want[0]}/{want[1]}")
    if r["variant"] == "stale" and len(r["warnings"]) != 1:
        problems.append(f"{len(r['warnings'])} warnings naming {FINALIZE}, expected 1")
    if r["variant"] == "finalized" and r["warnings"]:
        problems.append(f"warned for a finalized micro-batch: {r['warnings']}")
    return problems


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_every_reuse_kind_equals_a_fresh_packed_seq_params(gloo_world, cp, kind):
    need_tree()
    need_fla()
    recs = [r for r in _reuse_records(gloo_world) if r["cp"] == cp and r["kind"] == kind]
    # every mode and variant ran, on every rank of its CP group
    ran = {(r["mode"], r["variant"]) for r in recs}
    assert ran == {(m, v) for m in MODES for v in VARIANTS}, ran
    assert len(recs) == len(MODES) * len(VARIANTS) * (4 if cp == 4 else 2)
    bad = {f"{r['id']}@rank{r['rank']}": p for r in recs if (p := _reuse_problems(r))}
    assert not bad, bad
    if kind == "broadcast":
        assert any(r["receiver"] for r in recs) and not all(r["receiver"] for r in recs)


# --------------------------------------------------------------------------------------
# (c) the counters
# --------------------------------------------------------------------------------------

# Padded packed THD with empty segments (middle, end) and distinct q/kv tensors; every length a
# multiple of 2*CP for CP <= 4.
STACK_PADDED = (0, 16, 16, 48, 64, 64)
STACK_VALID = (14, 0, 29, 12, 0)
STACK_SEQ_LENS_CU = (0, 16, 48, 64)  # the same layout without the empty segments: the shards'
DEPTHS = (2, 8)


def _stack_psp(**kw):
    import torch

    from megatron.core.packed_seq_params import PackedSeqParams

    pad = torch.tensor(STACK_PADDED, dtype=torch.int32)
    actual = [0]
    for n in STACK_VALID:
        actual.append(actual[-1] + n)
    act = torch.tensor(actual, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=act, cu_seqlens_kv=act.clone(),
                           cu_seqlens_q_padded=pad, cu_seqlens_kv_padded=pad.clone(),
                           max_seqlen_q=32, max_seqlen_kv=32, **kw)


def _measure(fn):
    """Run ``fn``; return (its result, counter deltas, host copies (tensors per copy),
    warnings naming finalize_packed_seq_params)."""
    from megatron.core.ssm import gdn_context_parallel as g

    before = dict(g.PACKED_METADATA_COUNTS)
    with count_host_copies() as copies, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, _count_delta(before), copies, [str(w.message) for w in caught
                                                  if FINALIZE in str(w.message)]


def _counter_item(stack, x, G, make_psp, finalize, controls):
    """Micro-batches through the stack with recompute: one finalized (``finalize``), or not
    finalized one (two with ``controls``: the warning is once per process, the numbers the
    same); with ``controls``, also finalized without the mode's state, and (unfinalized)
    recompute off and the no-reuse control."""
    from megatron.core.ssm import gdn_context_parallel as g

    rec = {"micro_batches": []}
    results = []
    g._NOT_FINALIZED_WARNED = False  # the one-time warning, per item
    for _ in range(2 if controls and not finalize else 1):
        psp = make_psp()
        at_finalize = None
        if finalize:
            _, delta, copies, warned = _measure(lambda: finalize(psp))
            at_finalize = {"counts": delta, "copies": copies, "warnings": len(warned)}
        res, delta, copies, warned = _measure(lambda: _run_stack(stack, x, G, psp, recompute=True))
        results.append(res)
        rec["micro_batches"].append({"finalize": at_finalize, "layers": {
            "counts": delta, "copies": copies, "warnings": len(warned)}})
    rec["results"] = results[0]
    if len(results) > 1:
        # the same numbers micro-batch after micro-batch
        rec["second_equal"] = not _differences(results[1], results[0])
    if controls and finalize:
        # finalized without this mode's state (linear_cp_modes=("headwise",)): the layers build
        # it late, on the host: counted, no copy, no layer build
        psp = make_psp()
        finalize(psp, linear_cp_modes=("headwise",))
        _, delta, copies, warned = _measure(lambda: _run_stack(stack, x, G, psp, recompute=True))
        rec["late"] = {"counts": delta, "copies": copies, "warnings": len(warned)}
    if controls and not finalize:
        # recompute off: one copy all the same
        _, delta, copies, _ = _measure(lambda: _run_stack(stack, x, G, make_psp()))
        rec["copies_without_recompute"] = len(copies)
        # control: a metadata that never matches costs one copy per layer (the spy sees them)
        with mock.patch.object(g.PackedSeqMetadata, "matches", lambda *a: False):
            _, _, copies, _ = _measure(lambda: _run_stack(stack, x, G, make_psp()))
        rec["copies_without_reuse"] = len(copies)
    return rec


def _counter_worker(rank, world, _):
    import torch.distributed as dist

    from fla_emulation import emulated_fla_in_megatron
    from megatron.core.context_parallel_layout import finalize_packed_seq_params

    groups = _Groups()
    x_full, G_full = _inputs()
    records = []

    def run(rid, mode, size, group, stack, dynamic):
        idx = _shard(STACK_SEQ_LENS_CU, size, group)
        kw = {"cp_group": group, "local_cp_size": size} if dynamic else {}
        x, G = x_full[idx], G_full[idx]
        # upstream's call resolves a dynamic micro-batch's group from the params; a static one
        # is given its group (parallel_state is not initialised in this world)
        finalize = (lambda psp, **k: finalize_packed_seq_params(psp, **k)) if dynamic else (
            lambda psp, **k: finalize_packed_seq_params(psp, cp_group=group, **k))
        controls = len(stack) == min(DEPTHS)  # depth-independent: run once, at the small depth
        out = {"finalized": _counter_item(stack, x, G, lambda: _stack_psp(**kw), finalize, controls),
               "not_finalized": _counter_item(stack, x, G, lambda: _stack_psp(**kw), None, controls)}
        a, b = out["finalized"].pop("results"), out["not_finalized"].pop("results")
        rec = {"id": rid, "mode": mode, "cp": size, "L": len(stack), "dynamic": dynamic,
               "rank": rank, "same_numbers_finalized_or_not": not _differences(a, b), **out}
        if controls:
            # SBHD: no copy, no build, in any layer
            sidx = _shard((0, TOKENS), size, group)
            _, delta, copies, _ = _measure(lambda: _run_stack(
                stack, x_full[sidx], G_full[sidx], _sbhd_psp(group, size) if dynamic else None,
                recompute=True))
            rec["sbhd"] = {"counts": delta, "copies": len(copies)}
        records.append(rec)

    with emulated_fla_in_megatron():
        for mode in MODES:
            for L in DEPTHS:
                for size in CP_SIZES:
                    if size < 4 and (MODES.index(mode) + L) % 2 != groups.pair_index:
                        continue
                    group = groups.cp(size)
                    stack = _build_stack(mode, size, group, groups, layers=L)
                    run(f"static/cp{size}/{mode}/L{L}", mode, size, group, stack, False)
                    dist.barrier(group=groups.pair if size < 4 else groups.quad)
                # dynamic CP: one stack built for CP=4, micro-batches on CP 1/2/4 subgroups
                stack = _build_stack(mode, 4, groups.quad, groups, layers=L)
                for size in CP_SIZES:
                    run(f"dynamic/cp{size}/{mode}/L{L}", mode, size, groups.cp(size), stack, True)
                dist.barrier()
    return records


def _sbhd_psp(group, size):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="sbhd", cp_group=group, local_cp_size=size)


def _counter_records(gloo_world):
    if "counters" not in _cache:
        _cache["counters"] = [r for recs in gloo_world(_counter_worker, 4, None, timeout=900)
                              for r in recs]
    return _cache["counters"]


def _mode_state(mode, cp):
    """The CP state a layer of ``mode`` reads: the route and FLA context (chunkwise), the
    all_gather index pair; none at CP=1 or headwise."""
    if cp == 1 or mode == "headwise":
        return {}
    return {"routes": 1, "fla_contexts": 1} if mode == "chunkwise" else {"gather_indices": 1}


def _counter_problems(r):
    problems = []
    state = _mode_state(r["mode"], r["cp"])
    for i, mb in enumerate(r["finalized"]["micro_batches"]):
        # one host copy (of both distinct q/kv tensors) and the layers' mode's state, once
        want = {"finalized": 1, "host_copies": 1, **state}
        fin = mb["finalize"]
        if fin["counts"] != want or fin["copies"] != [2]:
            problems.append(f"micro-batch {i} at finalize: {fin}, expected {want} and copies [2]")
        layers = mb["layers"]
        if layers["counts"] or layers["copies"]:
            problems.append(f"micro-batch {i} finalized, in the layers: {layers}, expected nothing")
        if layers["warnings"] or fin["warnings"]:
            problems.append(f"micro-batch {i} finalized: warned")
    warned = 0
    for i, mb in enumerate(r["not_finalized"]["micro_batches"]):
        layers, want = mb["layers"], {"layer_built": 1, "host_copies": 1, **state}
        if layers["counts"] != want or layers["copies"] != [2]:
            problems.append(f"micro-batch {i} not finalized, in the layers: {layers}, expected {want} "
                            "and one copy of both tensors")
        warned += layers["warnings"]
    if warned != 1:
        problems.append(f"{warned} warnings naming {FINALIZE} over the unfinalized micro-batches, expected 1")
    v = r["not_finalized"]
    if not r["same_numbers_finalized_or_not"]:
        problems.append("finalized and not finalized give different numbers")
    if r["L"] != min(DEPTHS):
        return problems
    if len(v["micro_batches"]) != 2 or not v["second_equal"]:
        problems.append("not finalized: the second micro-batch differs from the first (or did not run)")
    late = r["finalized"]["late"]
    want = {**state, "late_builds": sum(state.values())} if state else {}
    if late["counts"] != want or late["copies"] or late["warnings"]:
        problems.append(f"finalized without the mode's state, in the layers: {late}, expected {want}, "
                        "no copy, no warning")
    if v["copies_without_recompute"] != 1:
        problems.append(f"{v['copies_without_recompute']} copies without recompute, expected 1")
    if v["copies_without_reuse"] != r["L"]:
        problems.append(f"control without reuse made {v['copies_without_reuse']} copies, "
                        f"expected one per layer ({r['L']})")
    if r["sbhd"]["copies"] or r["sbhd"]["counts"]:
        problems.append(f"SBHD: {r['sbhd']}, expected nothing")
    return problems


@pytest.mark.parametrize("L", DEPTHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cp_kind", ["static", "dynamic"])
def test_counters_one_build_per_micro_batch_none_in_the_layers(gloo_world, cp_kind, mode, L):
    need_tree()
    need_fla()
    recs = [r for r in _counter_records(gloo_world)
            if r["dynamic"] == (cp_kind == "dynamic") and r["mode"] == mode and r["L"] == L]
    assert sorted({r["cp"] for r in recs}) == list(CP_SIZES)
    assert len(recs) == {"static": 2 + 2 + 4, "dynamic": 4 * 3}[cp_kind]
    bad = {f"{r['id']}@rank{r['rank']}": p for r in recs if (p := _counter_problems(r))}
    assert not bad, bad
