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
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional
from unittest import mock

import torch
import torch.distributed as dist

import gdn_reference as ref


@dataclass
class EmulatedCPContext:
    group: Any
    cu_seqlens: torch.Tensor  # global, before the CP split
    conv1d_kernel_size: Optional[int]


def build_cp_context(cu_seqlens, group, conv1d_kernel_size=None, cu_seqlens_cpu=None):
    return EmulatedCPContext(group, cu_seqlens.detach().to("cpu", torch.long), conv1d_kernel_size)


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
    if cp_context is None:
        return _record_dy(ref.causal_conv1d_ref(x, weight, bias, activation, cu_seqlens)), None
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
    if use_qk_l2norm_in_kernel:
        q, k = ref.l2norm(q), ref.l2norm(k)
    if cp_context is None:
        o, _ = ref.gdn_chunked(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens)
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
    """Point ``megatron.core.ssm.gated_delta_net``'s FLA names at the CPU stand-ins.

    Must be entered before GatedDeltaNet is built (it binds ``chunk_gated_delta_rule``
    at construction).
    """
    import megatron.core.ssm.gated_delta_net as gdn

    with contextlib.ExitStack() as stack:
        for name, fn in (
            ("causal_conv1d", causal_conv1d),
            ("chunk_gated_delta_rule", chunk_gated_delta_rule),
            ("l2norm", l2norm),
            ("build_cp_context", build_cp_context),
        ):
            if hasattr(gdn, name):  # the base tree has no build_cp_context
                stack.enter_context(mock.patch.object(gdn, name, fn))
        yield
