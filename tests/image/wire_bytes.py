"""Bytes on the wire of one GatedDeltaNet step (forward + backward), per mode and CP size.

A spy wraps ``torch.distributed``'s collectives and counts what this rank SENDS over each
group of more than one rank (bytes, the tensor's dtype size):

* ``all_to_all_single`` / ``all_to_all``: the input minus the part that stays on this rank;
* ``all_gather_into_tensor`` / ``all_gather``: the input times (group size - 1);
* ``all_reduce``: ``2 (P-1)/P`` times the tensor (ring algorithm);
* ``reduce_scatter_tensor``: ``(P-1)/P`` times the input;
* ``broadcast``: the tensor on the source rank, else 0; ``send``/``isend``: the tensor.

Calls made by the CPU stand-ins of FLA (``fla_emulation``) are counted apart, as
``fla_emulated``: the stand-ins gather whole sequences, which is not what FLA's CP kernels
send, so those bytes are not reported as the layer's. What is measured is the layer's own
traffic: headwise's all-to-alls, chunkwise's layout conversions, all_gather's gathers.
FLA 0.4.2's own chunkwise exchange (conv halo of ``W-1`` tokens per sequence edge and the
``[H, K, V]`` float32 state all-gathers of ``fla/ops/cp/chunk_delta_h.py``) comes on top of
chunkwise's figure and does not grow with the sequence length.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from unittest import mock

import torch
import torch.distributed as dist

# name -> (hidden, key heads, value heads, key dim, value dim); bf16 as in the benchmark.
SHAPES = {
    "bench": (4096, 16, 32, 128, 128),  # bench/gdn_layer.py's default shape
    "qwen3_next": (2048, 16, 32, 128, 128),  # Qwen3-Next-80B-A3B's GDN layer
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(group) -> int:
    return dist.get_world_size(group)


def _from_emulation() -> bool:
    return any(f.filename.endswith("fla_emulation.py") for f in inspect.stack(context=0)[2:8])


@contextlib.contextmanager
def count_sent_bytes():
    """Yield a ``dict`` (kind -> bytes sent by this rank) filled while the block runs."""
    sent = defaultdict(int)
    real = {name: getattr(dist, name) for name in (
        "all_to_all_single", "all_to_all", "all_gather_into_tensor", "all_gather", "all_reduce",
        "reduce_scatter_tensor", "broadcast", "send", "isend")}

    def record(name, group, nbytes):
        if _size(group) > 1:
            sent[("fla_emulated:" if _from_emulation() else "") + name] += int(nbytes)

    def a2a_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        p, r = _size(group), dist.get_rank(group)
        if input_split_sizes:
            row = _nbytes(input) // max(1, input.shape[0])
            stay = input_split_sizes[r] * row
        else:
            stay = _nbytes(input) // p
        record("all_to_all_single", group, _nbytes(input) - stay)
        return real["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    def a2a(output_list, input_list, group=None, **kw):
        r = dist.get_rank(group)
        record("all_to_all", group, sum(_nbytes(t) for i, t in enumerate(input_list) if i != r))
        return real["all_to_all"](output_list, input_list, group=group, **kw)

    def ag_tensor(output, input, group=None, **kw):
        record("all_gather_into_tensor", group, _nbytes(input) * (_size(group) - 1))
        return real["all_gather_into_tensor"](output, input, group=group, **kw)

    def ag(tensor_list, tensor, group=None, **kw):
        record("all_gather", group, _nbytes(tensor) * (_size(group) - 1))
        return real["all_gather"](tensor_list, tensor, group=group, **kw)

    def ar(tensor, op=dist.ReduceOp.SUM, group=None, **kw):
        p = _size(group)
        record("all_reduce", group, 2 * (p - 1) * _nbytes(tensor) // p)
        return real["all_reduce"](tensor, op=op, group=group, **kw)

    def rs(output, input, op=dist.ReduceOp.SUM, group=None, **kw):
        p = _size(group)
        record("reduce_scatter_tensor", group, (p - 1) * _nbytes(input) // p)
        return real["reduce_scatter_tensor"](output, input, op=op, group=group, **kw)

    def bc(tensor, src=None, group=None, **kw):
        if dist.get_rank() == src:
            record("broadcast", group, _nbytes(tensor))
        return real["broadcast"](tensor, src=src, group=group, **kw)

    def snd(tensor, dst=None, group=None, **kw):
        sent["send"] += _nbytes(tensor)
        return real["send"](tensor, dst=dst, group=group, **kw)

    def isnd(tensor, dst=None, group=None, **kw):
        sent["isend"] += _nbytes(tensor)
        return real["isend"](tensor, dst=dst, group=group, **kw)

    spies = {"all_to_all_single": a2a_single, "all_to_all": a2a, "all_gather_into_tensor": ag_tensor,
             "all_gather": ag, "all_reduce": ar, "reduce_scatter_tensor": rs, "broadcast": bc,
             "send": snd, "isend": isnd}
    with contextlib.ExitStack() as stack:
        for name, fn in spies.items():
            stack.enter_context(mock.patch.object(dist, name, fn))
        yield sent


def layer_bytes(rank: int, world: int, shape: str, tokens: int, modes=("headwise", "chunkwise", "all_gather")) -> dict:
    """Bytes this rank sends in one forward + backward of a bf16 GDN layer at CP=``world``.

    Args:
        shape: a key of :data:`SHAPES`.
        tokens: global SBHD sequence length (batch 1), a multiple of ``2 * world``.

    Returns:
        ``{mode: {"layer": bytes, "by_kind": {...}, "per_token": bytes / global token}}``.
    """
    import fla_emulation
    import gdn_harness as H

    hidden, kh, vh, dk, dv = SHAPES[shape]
    geom = H.Geometry(hidden=hidden, k_heads=kh, v_heads=vh, dk=dk, dv=dv)
    case = H.Case("sbhd", tokens)
    single = [dist.new_group([r]) for r in range(world)][rank]
    group = dist.new_group(list(range(world)))
    out = {}
    x, G = H.global_inputs(case, hidden, seed=7, dtype=torch.bfloat16)
    idx = H.shard_index(case, world, rank)
    for mode in modes:
        if mode == "headwise" and not H.headwise_legal(geom, world):
            continue
        with fla_emulation.emulated_fla_in_megatron():
            cfg = H.make_config(geom, cp=world, mode=mode, dtype=torch.bfloat16, cpu_init=True)
            m = H.build_gdn(cfg, H.make_pg(single, group))
            with torch.no_grad():  # the bytes do not depend on the values: zeros are cheap
                for p in m.parameters():
                    p.zero_()
            with count_sent_bytes() as sent:
                H.run_layer(m, x[idx], G[idx], None)
        layer = sum(v for k, v in sent.items() if not k.startswith("fla_emulated:"))
        out[mode] = {"layer": layer, "per_token": layer / tokens, "by_kind": dict(sorted(sent.items()))}
        del m
    return out


def table(rank: int, world: int, shapes, tokens: int, modes=("headwise", "chunkwise", "all_gather")) -> dict:
    """``{shape: layer_bytes(...)}`` for several shapes in one world (gloo worker entry)."""
    return {shape: layer_bytes(rank, world, shape, tokens, modes) for shape in shapes}
