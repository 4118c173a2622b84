"""CPU stand-ins for the four FLA entry points the GDN layer uses (CPU runs only).

FLA's kernels are Triton and need a GPU. To exercise Megatron's CP plumbing (layouts,
all-to-alls, gathers, gradient flow, path selection) on CPU, these functions take the
same arguments and honour the same contract, computed by the independent eager oracle
``gdn_reference``:

* ``build_cp_context(cu_seqlens, group, conv1d_kernel_size)`` -> an opaque context for the
  contiguous CP layout (rank ``r`` holds packed tokens ``[r*T/P, (r+1)*T/P)``).
* ``causal_conv1d(x, weight, bias, activation, cu_seqlens, cp_context=...)`` -> ``(y, None)``.
* ``chunk_gated_delta_rule(q, k, v, g, beta, ..., cu_seqlens, cp_context=...)`` -> ``(o, None)``.
* ``l2norm(x)``.

The conv and the scan take only the parameters FLA 0.4.2, 0.5.2 and 0.6.0 all accept, and those
that moved in 0.5.1 and 0.6.0 (everything past ``beta`` / ``bias``) by keyword only; a call that passes
one positionally, or a keyword only one release knows (``transpose_state_layout``,
``state_v_first``, ``head_first``), fails here with a ``TypeError`` (docs/fla-versions.md).
The numbers come from the eager oracle, not from any release's kernels.

With a context, the local shard is all-gathered (autograd-aware: backward all-reduces the
full-sequence gradient and keeps this rank's span), the op runs on the whole packed
sequence and the rank's contiguous span is returned. This emulates what FLA's CP kernels
compute, not how. The GPU suite never uses this module.

FLA's identity-keyed caches are emulated too: FLA 0.4.2 derives its index helpers from
``cu_seqlens`` through ``fla.utils.tensor_cache``, a single-entry cache that hits when it gets
the very same tensor object (``is``) as last time, whatever its values now (FLA issue #1274).
So the conv and the scan stand-ins each read the boundaries through one such cache
(:class:`TensorCache`): a caller that hands FLA the same tensor with new values gets the old
boundaries, i.e. wrong numbers, as on the real kernels. ``FLA_DISABLE_TENSOR_CACHE=1`` turns
it off, as in FLA. :func:`record_fla_tensor_args` lists every tensor the stand-ins get as
boundaries, for tests that check FLA never receives a tensor the caller owns.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, List, Optional
from unittest import mock

import torch
import torch.distributed as dist

import gdn_reference as ref


@dataclass
class EmulatedCPContext:
    group: Any
    cu_seqlens: torch.Tensor  # global, before the CP split
    conv1d_kernel_size: Optional[int]


class TensorCache:
    """FLA 0.4.2's ``fla.utils.tensor_cache`` applied to reading ``cu_seqlens``: one entry,
    keyed on the identity of the tensor (``is``), holding the values seen when it was stored.

    ``read(t)`` returns a host int64 copy of ``t``'s values, or, when ``t`` is the tensor of the
    previous call, that call's copy (stale when ``t`` was rewritten in between). It keeps a
    reference to ``t``, as FLA does, so the identity cannot be recycled.
    """

    def __init__(self):
        self.last = None
        self.values = None

    def read(self, t):
        if t is None:
            return None
        if os.environ.get("FLA_DISABLE_TENSOR_CACHE") == "1":
            return t.detach().to("cpu", torch.long).clone()
        if self.last is not t:
            self.last, self.values = t, t.detach().to("cpu", torch.long).clone()
        return self.values


CONV_CACHE = TensorCache()
RULE_CACHE = TensorCache()

# When a list (inside :func:`record_fla_tensor_args`): (entry point, argument, tensor) for every
# boundary tensor the stand-ins receive.
_RECEIVED: Optional[List[tuple]] = None


def _received(entry, **tensors):
    if _RECEIVED is not None:
        _RECEIVED.extend((entry, name, t) for name, t in tensors.items() if torch.is_tensor(t))


@contextlib.contextmanager
def record_fla_tensor_args():
    """Yield a list that collects ``(entry point, argument name, tensor)`` for each
    ``cu_seqlens`` / ``cu_seqlens_cpu`` tensor given to the conv, the scan or
    ``build_cp_context`` stand-ins while the context is open."""
    global _RECEIVED
    before, _RECEIVED = _RECEIVED, []
    try:
        yield _RECEIVED
    finally:
        _RECEIVED = before


def build_cp_context(cu_seqlens, group, conv1d_kernel_size=None, cu_seqlens_cpu=None):
    # Like FLA's, the context holds what it derived from the boundaries when built.
    _received("build_cp_context", cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    return EmulatedCPContext(group, cu_seqlens.detach().to("cpu", torch.long).clone(),
                             conv1d_kernel_size)


class _GatherContiguous(torch.autograd.Function):
    """``[1, T_local, ...]`` on each rank -> ``[1, T, ...]`` (rank order along dim 1)."""

    @staticmethod
    def forward(ctx, x, group):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.local = group, x.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return grad[:, r * ctx.local : (r + 1) * ctx.local], None


def _span(ctx: EmulatedCPContext, local_len: int):
    r = dist.get_rank(ctx.group)
    return slice(r * local_len, (r + 1) * local_len)


# One entry per backward through the emulated conv: (is_contiguous, stride) of the output
# gradient Megatron hands back, i.e. the ``dy`` the real FLA kernel would receive. FLA 0.4.2's
# conv backward reads ``dy`` as a dense [B, T, D] tensor whatever its strides (FLA PR #871),
# so the patched GDN must only ever pass a contiguous one.
CONV_DY_LAYOUTS: list = []


def _record_dy(y):
    if y.requires_grad:
        y.register_hook(lambda g: CONV_DY_LAYOUTS.append((g.is_contiguous(), tuple(g.stride()))))
    return y


def causal_conv1d(
    x,
    weight=None,
    bias=None,
    *,
    residual=None,
    initial_state=None,
    output_final_state=False,
    activation=None,
    backend=None,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    chunk_indices=None,
    cp_context=None,
):
    assert residual is None and initial_state is None and not output_final_state
    _received("causal_conv1d", cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    if cp_context is None:
        cu = CONV_CACHE.read(cu_seqlens)
        return _record_dy(ref.causal_conv1d_ref(x, weight, bias, activation, cu)), None
    # gather in float32 so that the cross-rank gradient sum rounds once, like a real kernel
    full = _GatherContiguous.apply(x.float(), cp_context.group)
    w = weight.float()
    b = bias.float() if bias is not None else None
    y = ref.causal_conv1d_ref(full, w, b, activation, cp_context.cu_seqlens)
    return _record_dy(y[:, _span(cp_context, x.shape[1])].to(x.dtype)), None


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    cp_context=None,
):
    assert initial_state is None and not output_final_state
    _received("chunk_gated_delta_rule", cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    if use_qk_l2norm_in_kernel:
        q, k = ref.l2norm(q), ref.l2norm(k)
    if cp_context is None:
        o, _ = ref.gdn_chunked(q, k, v, g, beta, scale=scale, cu_seqlens=RULE_CACHE.read(cu_seqlens))
        return o, None
    local = q.shape[1]
    full = [_GatherContiguous.apply(t.float(), cp_context.group) for t in (q, k, v, g, beta)]
    o, _ = ref.gdn_chunked(*full, scale=scale, cu_seqlens=cp_context.cu_seqlens)
    return o[:, _span(cp_context, local)].to(v.dtype), None


def l2norm(x, eps=1e-6, output_dtype=None):
    assert output_dtype is None
    return ref.l2norm(x, eps)


@contextlib.contextmanager
def emulated_fla_in_megatron():
    """Point ``megatron.core.ssm.gated_delta_net``'s FLA names at the CPU stand-ins, and
    ``fla.ops.cp.build_cp_context`` too (the packed-metadata path of the patched tree imports
    it from there when it builds a micro-batch's CP context).

    Must be entered before GatedDeltaNet is built (it binds ``chunk_gated_delta_rule``
    at construction).
    """
    import megatron.core.ssm.gated_delta_net as gdn

    with contextlib.ExitStack() as stack:
        try:
            import fla.ops.cp as fla_cp
        except Exception:  # noqa: BLE001 - FLA absent or not importable: nothing to point
            fla_cp = None
        if fla_cp is not None and hasattr(fla_cp, "build_cp_context"):
            stack.enter_context(mock.patch.object(fla_cp, "build_cp_context", build_cp_context))
        for name, fn in (
            ("causal_conv1d", causal_conv1d),
            ("chunk_gated_delta_rule", chunk_gated_delta_rule),
            ("l2norm", l2norm),
            ("build_cp_context", build_cp_context),
        ):
            if hasattr(gdn, name):  # the base tree has no build_cp_context
                stack.enter_context(mock.patch.object(gdn, name, fn))
        yield
