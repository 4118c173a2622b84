"""One host copy of the packed boundaries per micro-batch (issue 24 items 1 and 2).

``gdn_context_parallel.PackedCuSeqlens`` holds the host copy of a micro-batch's final
``cu_seqlens`` on its ``PackedSeqParams`` (``cu_seqlens_cpu_cache``): attached by the data
pipeline (``attach_cu_seqlens_cpu``) or made by the first GDN layer, reused by later layers
and by activation recompute, and rebuilt whenever it no longer matches its tensors (new
tensor, in-place write, view change) or the CP group, size or rank. Tested here on CPU:

* the record's reuse and rebuild rules, one test per rule, and that checking them reads no
  tensor value (it would sync on a GPU);
* distinct q/kv tensors cost one copy; the normalised boundaries (an empty segment dropped)
  are copied back to the device once, without a blocking copy;
* a stack of L GDN layers (L = 2 and 4) forward + backward with recompute, packed THD with an
  empty segment and distinct q/kv tensors, every mode at CP 1 and 2 (gloo, FLA stand-ins):
  one device->host copy per micro-batch whatever L, none in the layers after an attach, the
  same numbers with and without the attach, none for SBHD.

Counting spies on ``_copy_cu_seqlens_to_host``, the only place the patched GDN code copies
boundaries to the host (on CPU the copy costs nothing, so the count is what is asserted;
``bench/gdn_model.py`` counts the real syncs on a GPU).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest

from _image_env import need_fla, need_tree
from _world import FakeGroup




@contextlib.contextmanager
def count_host_copies():
    """Count calls of ``gdn_context_parallel._copy_cu_seqlens_to_host``; yields the list of
    the tensor counts each call copied."""
    from megatron.core.ssm import gdn_context_parallel as g

    calls = []
    orig = g._copy_cu_seqlens_to_host

    def spy(tensors):
        calls.append(len(tensors))
        return orig(tensors)

    with mock.patch.object(g, "_copy_cu_seqlens_to_host", spy):
        yield calls


def _psp(cu=(0, 64, 200, 256), distinct_kv=False, **kw):
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    t = torch.tensor(cu, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=t,
                           cu_seqlens_kv=t.clone() if distinct_kv else t, **kw)


def test_packed_seq_params_has_the_cache_field_and_te_skips_it():
    need_tree()
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    assert "cu_seqlens_cpu_cache" in {f.name for f in dataclasses.fields(PackedSeqParams)}
    assert PackedSeqParams().cu_seqlens_cpu_cache is None
    from _image_env import GDN_TREE

    te = (GDN_TREE / "megatron/core/extensions/transformer_engine.py").read_text()
    assert 'self.kept_packed_seq_params.discard("cu_seqlens_cpu_cache")' in te


def test_reused_while_nothing_changed():
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import PackedCuSeqlens, packed_cu_seqlens

    psp = _psp()
    with count_host_copies() as calls:
        first = packed_cu_seqlens(psp, 256)
        second = packed_cu_seqlens(psp, 256)
    assert calls == [1]
    assert isinstance(psp.cu_seqlens_cpu_cache, PackedCuSeqlens)
    assert first[0] is second[0] and first[1] is second[1]
    assert first[0] is psp.cu_seqlens_q and first[1].tolist() == [0, 64, 200, 256]


def test_attach_makes_the_only_copy():
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import attach_cu_seqlens_cpu, packed_cu_seqlens

    group = FakeGroup(2, 1)
    psp = _psp(cp_group=group, local_cp_size=2)
    with count_host_copies() as calls:
        rec = attach_cu_seqlens_cpu(psp)
        for _ in range(4):
            dev, host = packed_cu_seqlens(psp, 256, group)
    assert calls == [1] and psp.cu_seqlens_cpu_cache is rec
    assert dev is rec.cu_seqlens and host is rec.cu_seqlens_cpu


def test_host_copy_never_aliases_a_host_tensor():
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import PackedCuSeqlens

    psp = _psp()
    rec = PackedCuSeqlens(psp)
    assert rec.host_q.data_ptr() != psp.cu_seqlens_q.data_ptr()


def _new_tensor(psp):
    psp.cu_seqlens_q = psp.cu_seqlens_q.clone()
    psp.cu_seqlens_q[1] = 128
    psp.cu_seqlens_kv = psp.cu_seqlens_q


def _in_place(psp):
    psp.cu_seqlens_q[1] = 128  # also kv: the same tensor


def _view_change(psp):
    import torch

    before = psp.cu_seqlens_q._version
    psp.cu_seqlens_q.data = torch.tensor([0, 128, 200, 256], dtype=torch.int32)
    assert psp.cu_seqlens_q._version == before  # only the view check can see this one


def _strided_view(psp):
    import torch

    base = torch.tensor([7, 0, 128, 200, 256], dtype=torch.int32)
    psp.cu_seqlens_q.set_(base.untyped_storage(), 1, (4,), (1,))


def _padded_given(psp):
    import torch

    psp.cu_seqlens_q_padded = torch.tensor([0, 128, 200, 256], dtype=torch.int32)
    psp.cu_seqlens_kv_padded = psp.cu_seqlens_q_padded


@pytest.mark.parametrize("change", [_new_tensor, _in_place, _view_change, _strided_view,
                                    _padded_given])
def test_rebuilt_when_the_boundaries_change(change):
    """A new tensor, an in-place write, a view change (data pointer, storage offset) or
    another field read: the cached copy is not reused, and the new values are used."""
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import packed_cu_seqlens

    psp = _psp()
    with count_host_copies() as calls:
        packed_cu_seqlens(psp, 256)
        change(psp)
        dev, host = packed_cu_seqlens(psp, 256)
    assert calls == [1, 1]
    assert host.tolist() == [0, 128, 200, 256] and dev.tolist() == [0, 128, 200, 256]


@pytest.mark.parametrize("before,after", [
    (FakeGroup(2, 0), FakeGroup(2, 0)),  # another group object of the same shape
    (None, FakeGroup(2, 0)),
    (FakeGroup(2, 0), None),
])
def test_rebuilt_for_another_cp_group(before, after):
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import packed_cu_seqlens

    psp = _psp()
    with count_host_copies() as calls:
        packed_cu_seqlens(psp, 256, before)
        packed_cu_seqlens(psp, 256, after)
        packed_cu_seqlens(psp, 256, after)
    assert calls == [1, 1]


@pytest.mark.parametrize("what", ["size", "rank"])
def test_rebuilt_for_another_cp_size_or_rank(what):
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import packed_cu_seqlens

    group = FakeGroup(2, 0)
    psp = _psp()
    with count_host_copies() as calls:
        packed_cu_seqlens(psp, 256, group)
        setattr(group, f"_{what}", 1 if what == "rank" else 4)
        packed_cu_seqlens(psp, 256, group)
    assert calls == [1, 1]


def test_inference_tensors_are_never_reused():
    """Inference tensors keep no version counter: an in-place change could not be seen."""
    need_tree()
    import torch

    from megatron.core.ssm.gdn_context_parallel import packed_cu_seqlens

    with torch.inference_mode():
        psp = _psp()
    with count_host_copies() as calls:
        packed_cu_seqlens(psp, 256)
        packed_cu_seqlens(psp, 256)
    assert calls == [1, 1]


def test_the_match_check_reads_no_tensor_value():
    """Reading a value (item, tolist, bool, comparison, a copy) would sync on a GPU."""
    need_tree()
    import torch

    from megatron.core.ssm.gdn_context_parallel import PackedCuSeqlens

    psp = _psp(distinct_kv=True)
    rec = PackedCuSeqlens(psp, FakeGroup(2, 1))

    def boom(*a, **k):
        raise AssertionError("the match check read a tensor value")

    with contextlib.ExitStack() as stack:
        for name in ("item", "tolist", "__bool__", "__eq__", "__ne__", "cpu", "to", "numpy",
                     "equal", "clone"):
            stack.enter_context(mock.patch.object(torch.Tensor, name, boom))
        stack.enter_context(mock.patch.object(torch, "equal", boom))
        assert rec.matches(psp, rec._cp[0])


def test_distinct_equal_q_kv_cost_one_copy_and_are_still_compared():
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import LinearCPError, packed_cu_seqlens

    psp = _psp(distinct_kv=True)
    with count_host_copies() as calls:
        packed_cu_seqlens(psp, 256)
        packed_cu_seqlens(psp, 256)
    assert calls == [2]  # one call copying both tensors
    psp = _psp(distinct_kv=True)
    psp.cu_seqlens_kv = psp.cu_seqlens_kv.clone()
    psp.cu_seqlens_kv[1] = 32
    with pytest.raises(LinearCPError, match="equal to cu_seqlens_kv"):
        packed_cu_seqlens(psp, 256)


def test_checks_run_on_the_cached_copy_at_every_call():
    """The cached copy is checked again by each layer (e.g. against its token count)."""
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import LinearCPError, packed_cu_seqlens

    psp = _psp()
    packed_cu_seqlens(psp, 256)
    with count_host_copies() as calls:
        with pytest.raises(LinearCPError, match="holds 512 tokens"):
            packed_cu_seqlens(psp, 512)
    assert calls == []
    bad = _psp(cu=(0, 64, 32, 256))
    for _ in range(2):
        with pytest.raises(LinearCPError, match="never decrease"):
            packed_cu_seqlens(bad, 256)


def test_normalised_boundaries_are_copied_back_once_without_blocking():
    """An empty segment: the normalised boundaries go back to the device once per
    micro-batch, through host_to_device (non_blocking), and are then reused."""
    need_tree()
    import torch

    from megatron.core.ssm import gdn_context_parallel as g

    psp = _psp(cu=(0, 64, 64, 200, 256, 256), distinct_kv=True)
    to_device = []
    orig = g.host_to_device

    def spy(tensor, device):
        to_device.append(tensor.tolist())
        return orig(tensor, device)

    with mock.patch.object(g, "host_to_device", spy), count_host_copies() as calls:
        first = g.packed_cu_seqlens(psp, 256)
        second = g.packed_cu_seqlens(psp, 256)
    assert calls == [2] and to_device == [[0, 64, 200, 256]]
    assert first[0] is second[0] and first[0].tolist() == [0, 64, 200, 256]
    assert first[0].dtype == torch.int32


# --------------------------------------------------------------------------------------
# a stack of GDN layers
# --------------------------------------------------------------------------------------

# Padded packed THD with an empty segment in the middle and at the end; every length a
# multiple of 2*CP for CP <= 2.
CU_PADDED = [0, 32, 32, 96, 128, 128]
VALID = [30, 0, 61, 28, 0]
SEQ_LENS = [32, 64, 32]  # the same layout without the empty segments
TOKENS = CU_PADDED[-1]


def _stack_psp(device, distinct_kv=True):
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    pad = torch.tensor(CU_PADDED, dtype=torch.int32, device=device)
    actual = [0]
    for n in VALID:
        actual.append(actual[-1] + n)
    act = torch.tensor(actual, dtype=torch.int32, device=device)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=act, cu_seqlens_kv=act.clone() if distinct_kv else act,
        cu_seqlens_q_padded=pad, cu_seqlens_kv_padded=pad.clone() if distinct_kv else pad,
        max_seqlen_q=64, max_seqlen_kv=64)


def _run_stack(layers, x, psp, recompute):
    import torch
    from torch.utils.checkpoint import checkpoint

    for m in layers:
        m.zero_grad(set_to_none=True)
    h = x.detach().clone().requires_grad_(True)
    out = h
    for m in layers:
        def fwd(inp, m=m):
            y, _ = m(inp, None, packed_seq_params=psp)
            return inp + y

        out = checkpoint(fwd, out, use_reentrant=False) if recompute else fwd(out)
    (out.float() ** 2).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for m in layers for p in m.parameters()])
    return out.detach(), h.grad.detach(), grads


def _stack_worker(rank, world, _):
    import torch
    import torch.distributed as dist

    import gdn_harness as H
    from cp_layout_ref import zigzag_rank_indices
    from fla_emulation import emulated_fla_in_megatron
    from megatron.core.ssm import gdn_context_parallel as g

    singles = [dist.new_group([r]) for r in range(world)]
    pair = dist.new_group(list(range(world)))
    geom = H.GEOMETRIES["gqa_dk32_dv64"]
    gen = torch.Generator().manual_seed(5)
    x_full = torch.randn(TOKENS, 1, geom.hidden, generator=gen)
    records = []
    with emulated_fla_in_megatron():
        for cp in (1, 2):
            group = pair if cp == 2 else singles[rank]
            idx = torch.tensor(zigzag_rank_indices(SEQ_LENS, cp, dist.get_rank(group)))
            # CP=1 takes no CP path in any mode: one mode is enough there
            for mode in H.MODES if cp > 1 else ("chunkwise",):
                for L in (2, 4):
                    cfg = H.make_config(geom, cp=cp, mode=mode, cpu_init=True)
                    layers = []
                    for i in range(L):
                        m = H.build_gdn(cfg, H.make_pg(singles[rank], group))
                        H.set_weights(m, seed=100 + i)
                        layers.append(m)
                    rec = {"mode": mode, "cp": cp, "L": L}
                    # two micro-batches, no attach: the first layer of each makes the copy
                    with count_host_copies() as calls:
                        for _ in range(2):
                            plain = _run_stack(layers, x_full[idx], _stack_psp("cpu"), True)
                    rec["copies_two_micro_batches"] = len(calls)
                    rec["tensors_per_copy"] = calls[:1]
                    # attached by the pipeline: no copy in any layer, same numbers
                    psp = _stack_psp("cpu")
                    g.attach_cu_seqlens_cpu(psp, group)
                    with count_host_copies() as calls:
                        attached = _run_stack(layers, x_full[idx], psp, True)
                    rec["copies_in_layers_after_attach"] = len(calls)
                    # recompute off
                    with count_host_copies() as calls:
                        _run_stack(layers, x_full[idx], _stack_psp("cpu"), False)
                    rec["copies_without_recompute"] = len(calls)
                    # control: without reuse the counter sees one copy per layer
                    with mock.patch.object(g.PackedCuSeqlens, "matches", lambda *a: False), \
                            count_host_copies() as calls:
                        _run_stack(layers, x_full[idx], _stack_psp("cpu"), False)
                    rec["copies_without_reuse"] = len(calls)
                    rec["same_numbers"] = all(torch.equal(a, b) for a, b in zip(plain, attached))
                    with count_host_copies() as calls:
                        sbhd_idx = torch.tensor(zigzag_rank_indices([TOKENS], cp, dist.get_rank(group)))
                        _run_stack(layers, x_full[sbhd_idx], None, True)
                    rec["copies_sbhd"] = len(calls)
                    records.append(rec)
    return records


def test_stack_makes_one_host_copy_per_micro_batch(gloo_world):
    need_tree()
    need_fla()
    records = [r for recs in gloo_world(_stack_worker, 2, None, timeout=600) for r in recs]
    assert len(records) == 2 * 2 * (1 + 3)
    for r in records:
        assert r["copies_two_micro_batches"] == 2, r  # one per micro-batch, not per layer
        assert r["tensors_per_copy"] == [2], r  # distinct q/kv tensors: one copy of both
        assert r["copies_in_layers_after_attach"] == 0, r
        assert r["copies_without_recompute"] == 1, r
        assert r["copies_without_reuse"] == r["L"], r
        assert r["same_numbers"], r
        assert r["copies_sbhd"] == 0, r
