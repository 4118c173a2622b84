"""At most one host copy of the packed boundaries per micro-batch, none in the layers once it is
finalized (issue 24 items 1 and 2, issue 43).

``gdn_context_parallel.PackedSeqMetadata`` holds a micro-batch's checked host boundaries, a
device tensor of its own for FLA and its CP state, on ``PackedSeqParams.gdn_packed_metadata``:
built by the data path (``finalize_packed_seq_params``) or else by the first GDN layer
(``packed_seq_metadata``), read by later layers and by activation recompute, and rebuilt
whenever it no longer matches its tensors (new tensor, in-place write, view change; for host
tensors also a write torch did not count) or the CP group, size or rank. Tested here on CPU,
one test per rule:

* reuse and rebuild rules, and that checking them reads no value of a device tensor (it would
  sync on a GPU);
* distinct q/kv tensors cost one copy; the normalised boundaries (an empty segment dropped)
  are copied to the device once, without a blocking copy;
* finalize makes the only copy (none with ``cu_seqlens_cpu=``), a stale finalized metadata is
  rebuilt, counted and warned.

The stack of GDN layers (copies per micro-batch whatever the depth, none in the layers after
finalize, the same numbers, none for SBHD) is in ``test_image_packed_metadata.py``.

Counting spies on ``_copy_cu_seqlens_to_host``, the only place the patched GDN code copies
boundaries to the host (on CPU the copy costs nothing, so the count is what is asserted;
``bench/gdn_model.py`` counts the real syncs on a GPU).
"""

from __future__ import annotations

import contextlib
import warnings
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


@contextlib.contextmanager
def fla_context_stub():
    """``fla.ops.cp.build_cp_context`` (what the metadata calls for chunkwise) replaced by the
    CPU stand-in, which needs no real process group; yields the list of its calls."""
    need_fla()
    import fla.ops.cp

    import fla_emulation

    calls = []

    def stub(*a, **k):
        calls.append(k)
        return fla_emulation.build_cp_context(*a, **k)

    with mock.patch.object(fla.ops.cp, "build_cp_context", stub):
        yield calls


def _psp(cu=(0, 64, 200, 256), distinct_kv=False, **kw):
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    t = torch.tensor(cu, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=t,
                           cu_seqlens_kv=t.clone() if distinct_kv else t, **kw)


def test_packed_seq_params_has_the_metadata_fields_and_te_skips_them():
    need_tree()
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    names = {f.name for f in dataclasses.fields(PackedSeqParams)}
    assert {"cp_partition_route", "gdn_packed_metadata"} <= names
    assert "cu_seqlens_cpu_cache" not in names  # the issue-24 field is gone
    assert PackedSeqParams().cp_partition_route is None
    assert PackedSeqParams().gdn_packed_metadata is None
    from _image_env import GDN_TREE

    te = (GDN_TREE / "megatron/core/extensions/transformer_engine.py").read_text()
    assert 'self.kept_packed_seq_params.discard("cp_partition_route")' in te
    assert 'self.kept_packed_seq_params.discard("gdn_packed_metadata")' in te


def test_reused_while_nothing_changed():
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import PackedSeqMetadata, packed_seq_metadata

    psp = _psp()
    with count_host_copies() as calls:
        first = packed_seq_metadata(psp, 256)
        second = packed_seq_metadata(psp, 256)
    assert calls == [1]
    assert isinstance(first, PackedSeqMetadata) and second is first
    assert psp.gdn_packed_metadata is first and not first.finalized
    assert first.cu_seqlens is not psp.cu_seqlens_q  # FLA gets a tensor of the metadata's own
    assert first.cu_seqlens.tolist() == first.cu_seqlens_cpu.tolist() == [0, 64, 200, 256]


def test_finalize_makes_the_only_copy():
    need_tree()
    from megatron.core.ssm import gdn_context_parallel as g

    group = FakeGroup(2, 1)
    psp = _psp(cp_group=group, local_cp_size=2)
    with fla_context_stub(), count_host_copies() as calls:
        assert g.finalize_packed_seq_params(psp, linear_cp_modes=("chunkwise",)) is psp
        meta = psp.gdn_packed_metadata
        for _ in range(4):
            assert g.packed_seq_metadata(psp, 256, group) is meta
    assert calls == [1] and meta.finalized
    assert psp.cp_partition_route is meta.route is not None


def test_finalize_with_the_loaders_host_copy_makes_none():
    need_tree()
    import torch

    from megatron.core.ssm import gdn_context_parallel as g

    psp = _psp()
    host = torch.tensor([0, 64, 200, 256], dtype=torch.int64)
    with count_host_copies() as calls:
        g.finalize_packed_seq_params(psp, cu_seqlens_cpu=host)
        meta = g.packed_seq_metadata(psp, 256)
    assert calls == [] and meta is psp.gdn_packed_metadata
    assert meta.host_q.dtype == torch.int32  # in the dtype of the device tensor it stands for
    assert meta.host_q.data_ptr() != host.data_ptr()  # copied, never kept
    with pytest.raises(g.LinearCPError, match="cu_seqlens_cpu= must be the host copy"):
        g.finalize_packed_seq_params(_psp(), cu_seqlens_cpu=host[:3])


def test_host_copy_never_aliases_a_host_tensor():
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import PackedSeqMetadata

    psp = _psp()
    meta = PackedSeqMetadata(psp)
    for mine in (meta.host_q, meta.cu_seqlens_cpu, meta.cu_seqlens):
        assert mine.untyped_storage().data_ptr() != psp.cu_seqlens_q.untyped_storage().data_ptr()


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


def _numpy_view(psp):
    before = psp.cu_seqlens_q._version
    psp.cu_seqlens_q.numpy()[1] = 128
    assert psp.cu_seqlens_q._version == before  # torch did not count it: only the values show it


def _data_copy(psp):
    import torch

    before, ptr = psp.cu_seqlens_q._version, psp.cu_seqlens_q.data_ptr()
    psp.cu_seqlens_q.data.copy_(torch.tensor([0, 128, 200, 256], dtype=torch.int32))
    assert psp.cu_seqlens_q._version == before and psp.cu_seqlens_q.data_ptr() == ptr


CHANGES = [_new_tensor, _in_place, _view_change, _strided_view, _padded_given, _numpy_view, _data_copy]


@pytest.mark.parametrize("change", CHANGES)
def test_rebuilt_when_the_boundaries_change(change):
    """A new tensor, an in-place write, a view change (data pointer, storage offset), another
    field read, or (host tensors) a write torch did not count: the metadata is rebuilt, once,
    with the new values."""
    need_tree()
    from megatron.core.ssm import gdn_context_parallel as g

    psp = _psp()
    with count_host_copies() as calls:
        first = g.packed_seq_metadata(psp, 256)
        change(psp)
        meta = g.packed_seq_metadata(psp, 256)
        assert g.packed_seq_metadata(psp, 256) is meta
    assert calls == [1, 1] and meta is not first
    assert meta.cu_seqlens_cpu.tolist() == [0, 128, 200, 256] == meta.cu_seqlens.tolist()


@pytest.mark.parametrize("change", CHANGES)
def test_a_stale_finalized_metadata_is_rebuilt_counted_and_warned(change):
    """Finalized, then changed without finalizing again: the layer rebuilds (one copy),
    counts it as ``stale`` and warns naming finalize_packed_seq_params."""
    need_tree()
    from megatron.core.ssm import gdn_context_parallel as g

    psp = _psp()
    g.finalize_packed_seq_params(psp)
    change(psp)
    before = dict(g.PACKED_METADATA_COUNTS)
    with count_host_copies() as calls, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = g.packed_seq_metadata(psp, 256)
        assert g.packed_seq_metadata(psp, 256) is meta
    after = g.PACKED_METADATA_COUNTS
    assert calls == [1] and meta.cu_seqlens_cpu.tolist() == [0, 128, 200, 256]
    assert after["stale"] - before.get("stale", 0) == 1
    assert after["layer_built"] - before.get("layer_built", 0) == 1
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and "finalize_packed_seq_params" in msgs[0], msgs


def test_refinalized_after_the_change_the_layers_only_read():
    need_tree()
    from megatron.core.ssm import gdn_context_parallel as g

    psp = _psp()
    g.finalize_packed_seq_params(psp)
    _in_place(psp)
    g.finalize_packed_seq_params(psp)
    with count_host_copies() as calls:
        meta = g.packed_seq_metadata(psp, 256)
    assert calls == [] and meta.finalized and meta.cu_seqlens_cpu.tolist() == [0, 128, 200, 256]


@pytest.mark.parametrize("before,after", [
    (FakeGroup(2, 0), FakeGroup(2, 0)),  # another group object of the same shape
    (None, FakeGroup(2, 0)),
    (FakeGroup(2, 0), None),
])
def test_rebuilt_for_another_cp_group(before, after):
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import packed_seq_metadata

    psp = _psp()
    with count_host_copies() as calls:
        packed_seq_metadata(psp, 256, before)
        packed_seq_metadata(psp, 256, after)
        packed_seq_metadata(psp, 256, after)
    assert calls == [1, 1]


@pytest.mark.parametrize("what", ["size", "rank"])
def test_rebuilt_for_another_cp_size_or_rank(what):
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import packed_seq_metadata

    group = FakeGroup(2, 0)
    psp = _psp()
    with count_host_copies() as calls:
        packed_seq_metadata(psp, 256, group)
        setattr(group, f"_{what}", 1 if what == "rank" else 4)
        packed_seq_metadata(psp, 256, group)
    assert calls == [1, 1]


def test_inference_tensors_are_never_reused():
    """Inference tensors keep no version counter: an in-place change could not be seen."""
    need_tree()
    import torch

    from megatron.core.ssm.gdn_context_parallel import packed_seq_metadata

    with torch.inference_mode():
        psp = _psp()
    with count_host_copies() as calls:
        packed_seq_metadata(psp, 256)
        packed_seq_metadata(psp, 256)
    assert calls == [1, 1]


def test_finalized_inference_tensors_are_read_not_rebuilt():
    """A finalized micro-batch of inference tensors (no version counter) is matched by identity
    and view: the layers make no copy and give no stale warning (finalize after the last write)."""
    need_tree()
    import warnings

    import torch

    from megatron.core.ssm.gdn_context_parallel import finalize_packed_seq_params, packed_seq_metadata

    with torch.inference_mode():
        psp = _psp()
    finalize_packed_seq_params(psp)
    with count_host_copies() as calls, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            assert packed_seq_metadata(psp, 256) is psp.gdn_packed_metadata
    assert calls == [] and not caught


def test_cu_seqlens_cpu_that_is_not_the_host_copy_is_refused():
    """cu_seqlens_cpu= is compared where that is free (host tensors, and every shape): values
    other than q's, or a kv of another shape or values, are refused naming cu_seqlens_cpu."""
    need_tree()
    import torch

    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.ssm.gdn_context_parallel import LinearCPError, finalize_packed_seq_params

    t = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(LinearCPError, match="cu_seqlens_cpu=.*not the host copy of PackedSeqParams.cu_seqlens_q"):
        finalize_packed_seq_params(_psp((0, 16, 40, 64)), cu_seqlens_cpu=t(0, 32, 48, 64))
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=t(0, 16, 64), cu_seqlens_kv=t(0, 8, 16, 64))
    with pytest.raises(LinearCPError, match="cu_seqlens_kv"):
        finalize_packed_seq_params(psp, cu_seqlens_cpu=t(0, 16, 64))
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=t(0, 16, 64), cu_seqlens_kv=t(0, 8, 64))
    with pytest.raises(LinearCPError, match="cu_seqlens_kv"):
        finalize_packed_seq_params(psp, cu_seqlens_cpu=t(0, 16, 64))
    finalize_packed_seq_params(_psp((0, 16, 40, 64)), cu_seqlens_cpu=t(0, 16, 40, 64))


@pytest.mark.parametrize("cu", [(0, 0), (0, 0, 0)])
def test_a_micro_batch_of_empty_segments_only_is_refused_as_such(cu):
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import LinearCPError, finalize_packed_seq_params

    with pytest.raises(LinearCPError, match="without tokens"):
        finalize_packed_seq_params(_psp(cu))


@contextlib.contextmanager
def _as_if_on_a_gpu():
    """Every tensor reports ``cuda:0`` as its device (its memory stays on the host), and the
    host->device copy is a clone: the metadata's device-tensor paths on a CPU-only host."""
    import torch

    from megatron.core.ssm import gdn_context_parallel as g

    copies = []

    def to_device(tensor, device):
        copies.append(tensor.tolist())
        return tensor.clone()

    cuda = torch.device("cuda", 0)
    with mock.patch.object(torch.Tensor, "device", property(lambda self: cuda)), \
            mock.patch.object(g, "host_to_device", to_device):
        yield copies


def test_the_match_check_reads_no_device_tensor_value():
    """Reading a value (item, tolist, bool, comparison, a copy) of a device tensor would sync."""
    need_tree()
    import torch

    from megatron.core.ssm.gdn_context_parallel import PackedSeqMetadata

    psp = _psp(distinct_kv=True)
    group = FakeGroup(2, 1)
    with _as_if_on_a_gpu():
        meta = PackedSeqMetadata(psp, group, linear_cp_modes=())

        def boom(*a, **k):
            raise AssertionError("the match check read a tensor value")

        with contextlib.ExitStack() as stack:
            for name in ("item", "tolist", "__bool__", "__eq__", "__ne__", "cpu", "to", "numpy",
                         "equal", "clone"):
                stack.enter_context(mock.patch.object(torch.Tensor, name, boom))
            stack.enter_context(mock.patch.object(torch, "equal", boom))
            assert meta.matches(psp, group)


def test_distinct_equal_q_kv_cost_one_copy_and_are_still_compared():
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import LinearCPError, packed_seq_metadata

    psp = _psp(distinct_kv=True)
    with count_host_copies() as calls:
        packed_seq_metadata(psp, 256)
        packed_seq_metadata(psp, 256)
    assert calls == [2]  # one call copying both tensors
    psp = _psp(distinct_kv=True)
    psp.cu_seqlens_kv = psp.cu_seqlens_kv.clone()
    psp.cu_seqlens_kv[1] = 32
    with pytest.raises(LinearCPError, match="equal to cu_seqlens_kv"):
        packed_seq_metadata(psp, 256)


def test_checks_run_on_the_metadata_at_every_call():
    """The metadata is checked again by each layer (against its token count), without a copy;
    bad boundaries are refused at every call (never kept)."""
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import LinearCPError, packed_seq_metadata

    psp = _psp()
    packed_seq_metadata(psp, 256)
    with count_host_copies() as calls:
        with pytest.raises(LinearCPError, match="holds 512 tokens"):
            packed_seq_metadata(psp, 512)
    assert calls == []
    bad = _psp(cu=(0, 64, 32, 256))
    for _ in range(2):
        with pytest.raises(LinearCPError, match="never decrease"):
            packed_seq_metadata(bad, 256)


def test_normalised_boundaries_are_copied_to_the_device_once_without_blocking():
    """An empty segment: the normalised boundaries go to the device once per micro-batch,
    through host_to_device (non_blocking), and are then reused."""
    need_tree()
    import torch

    from megatron.core.ssm import gdn_context_parallel as g

    psp = _psp(cu=(0, 64, 64, 200, 256, 256), distinct_kv=True)
    with _as_if_on_a_gpu() as to_device, count_host_copies() as calls:
        first = g.packed_seq_metadata(psp, 256)
        second = g.packed_seq_metadata(psp, 256)
    assert calls == [2] and to_device == [[0, 64, 200, 256]]
    assert first is second and first.cu_seqlens.tolist() == [0, 64, 200, 256]
    assert first.cu_seqlens.dtype == torch.int32


def test_host_to_device_does_not_block():
    """The one host->device copy of the metadata is ``.to(device, non_blocking=True)``."""
    need_tree()
    import torch

    from megatron.core.ssm import gdn_context_parallel as g

    seen = []
    t = torch.tensor([0, 8], dtype=torch.int32)
    with mock.patch.object(torch.Tensor, "to", lambda self, *a, **k: seen.append((a, k)) or self):
        g.host_to_device(t, "cuda")
    assert seen == [(("cuda",), {"non_blocking": True})]
