# Downstream adaptation shipped by the gdn-backport recipe (not from upstream Megatron-LM).
"""Context-parallel (CP) mode selection and helpers for Gated DeltaNet layers.

The GDN CP mode is static for the process: ``TransformerConfig.linear_cp_mode`` is read
when the layer is built and in forward, and nothing in forward writes to the module or
to the shared config. Three modes exist:

* ``headwise`` (default): all-to-all from sequence shards to head shards, each CP rank
  runs conv + scan on the full sequence for TP*CP-divided heads.
* ``chunkwise``: each CP rank keeps its sequence chunk, reorders Megatron's zigzag shard
  into contiguous time order and runs FLA's CP-aware conv + scan with a ``cp_context``
  (upstream NVIDIA/Megatron-LM 5139086e, ``megatron/core/ssm/gated_delta_net.py``).
* ``all_gather``: the fallback; gather the projected sequence on every CP rank, run conv
  + scan on the full sequence, keep this rank's zigzag part.

There is no ``auto``. Misuse raises :class:`LinearCPError` before any collective runs.
"""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.context_parallel_layout import get_thd_context_parallel_rank_indices
from megatron.core.packed_seq_params import resolve_cp_group

LINEAR_CP_MODES = ("headwise", "chunkwise", "all_gather")
DEFAULT_LINEAR_CP_MODE = "headwise"


class LinearCPError(ValueError):
    """A GDN context-parallel setting or input that cannot run; the message says what to change."""


def check_linear_cp_mode(mode) -> str:
    """Return ``mode`` if it is one of :data:`LINEAR_CP_MODES`.

    Raises:
        LinearCPError: for any other value, ``"auto"`` included.
    """
    if mode not in LINEAR_CP_MODES:
        raise LinearCPError(
            f"linear_cp_mode={mode!r} is not supported. Use one of "
            f"{', '.join(repr(m) for m in LINEAR_CP_MODES)} (there is no 'auto'; "
            "the mode is fixed for the process)."
        )
    return mode


def check_linear_cp_geometry(
    mode: str, num_key_heads: int, num_value_heads: int, tp_size: int, cp_size: int
) -> None:
    """Check the GDN head rule of ``mode``.

    headwise needs heads % (TP*CP) == 0; chunkwise and all_gather keep every TP-local head
    on each CP rank and need heads % TP == 0.

    Args:
        mode: one of :data:`LINEAR_CP_MODES`.
        num_key_heads, num_value_heads: global GDN head counts.
        tp_size, cp_size: tensor- and context-parallel sizes (static, i.e. the largest CP).

    Raises:
        LinearCPError: unknown mode or a head count the mode cannot split.
    """
    check_linear_cp_mode(mode)
    split = tp_size * cp_size if (mode == "headwise" and cp_size > 1) else tp_size
    for name, heads in (("linear_num_key_heads", num_key_heads), ("linear_num_value_heads", num_value_heads)):
        if heads % split == 0:
            continue
        if mode == "headwise" and cp_size > 1:
            raise LinearCPError(
                f"{name}={heads} is not divisible by TP*CP={tp_size}*{cp_size}, which "
                "linear_cp_mode='headwise' needs. Use linear_cp_mode='chunkwise' or "
                "linear_cp_mode='all_gather' (they need heads % TP == 0), or change TP/CP."
            )
        raise LinearCPError(
            f"{name}={heads} is not divisible by TP={tp_size}, which linear_cp_mode="
            f"{mode!r} needs. Change the tensor-parallel size or the head count."
        )


@dataclass(frozen=True)
class LinearCPPlan:
    """How one GDN forward runs under CP; built before any collective.

    Attributes:
        mode: the static mode of the layer.
        group: the CP process group of this micro-batch (dynamic or static).
        size: ``group.size()``; 1 means no CP communication in any mode.
        global_seq_len: tokens of the whole (un-split) sequence per batch row, i.e. the
            local length times sequence-parallel size times ``size``.
    """

    mode: str
    group: Optional[dist.ProcessGroup]
    size: int
    global_seq_len: int

    @property
    def headwise(self) -> bool:
        """True when the headwise all-to-all runs (headwise mode and CP > 1)."""
        return self.mode == "headwise" and self.size > 1

    @property
    def chunkwise(self) -> bool:
        """True when the chunkwise path (FLA ``cp_context``) runs."""
        return self.mode == "chunkwise" and self.size > 1

    @property
    def all_gather(self) -> bool:
        """True when the all-gather fallback runs."""
        return self.mode == "all_gather" and self.size > 1


def plan_linear_cp(
    mode: str,
    static_cp_group: Optional[dist.ProcessGroup],
    packed_seq_params,
    local_seq_len: int,
    batch: int,
    sp_size: int,
    deterministic_mode: bool,
    has_inference_context: bool,
    num_key_heads: int,
    num_value_heads: int,
    tp_size: int,
) -> LinearCPPlan:
    """Resolve the CP group of this micro-batch and reject unsupported inputs.

    Dynamic CP only swaps ``cp_group`` / ``local_cp_size`` carried by ``PackedSeqParams``;
    no process group is ever created here.

    Args:
        mode: the layer's static ``linear_cp_mode``.
        static_cp_group: the CP group the layer was built with.
        packed_seq_params: ``PackedSeqParams`` or None.
        local_seq_len: this rank's sequence length of ``hidden_states`` ([s, b, h]).
        batch: batch size of ``hidden_states``.
        sp_size: sequence-parallel size (TP size under sequence parallelism, else 1).
        deterministic_mode, has_inference_context: what chunkwise cannot run with.
        num_key_heads, num_value_heads, tp_size: for the headwise head rule of the group
            actually used (a dynamic CP group may differ from the static one).

    Raises:
        LinearCPError: local_cp_size mismatch; headwise with a group whose size does not
            split the heads; chunkwise with deterministic mode, with an inference context,
            or with SBHD input and batch > 1.
    """
    group = resolve_cp_group(static_cp_group, packed_seq_params)
    size = group.size() if group is not None else 1
    local_cp_size = getattr(packed_seq_params, "local_cp_size", None)
    if local_cp_size is not None and int(local_cp_size) != size:
        raise LinearCPError(
            f"PackedSeqParams.local_cp_size={local_cp_size} but its CP group has {size} ranks. "
            "Set local_cp_size to cp_group.size() when building the micro-batch."
        )
    plan = LinearCPPlan(mode=mode, group=group, size=size, global_seq_len=local_seq_len * sp_size * size)
    if plan.headwise:
        check_linear_cp_geometry(mode, num_key_heads, num_value_heads, tp_size, size)
    if plan.chunkwise:
        if deterministic_mode:
            raise LinearCPError(
                "linear_cp_mode='chunkwise' does not support deterministic_mode (FLA's CP "
                "kernels are not deterministic). Use linear_cp_mode='headwise' or 'all_gather'."
            )
        if has_inference_context:
            raise LinearCPError(
                "linear_cp_mode='chunkwise' does not support inference contexts. Run inference "
                "without context parallelism or with linear_cp_mode='headwise'."
            )
        is_thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if not is_thd and batch > 1:
            raise LinearCPError(
                f"linear_cp_mode='chunkwise' with SBHD input needs batch 1 (got {batch}): FLA's "
                "cp_context takes one sequence row. Use packed THD input or micro_batch_size=1."
            )
    return plan


def check_sequence_lengths(
    plan: LinearCPPlan, cu_seqlens: Optional[torch.Tensor], conv_kernel_size: int = 1
) -> None:
    """Require sequence lengths that the CP paths can split.

    Every packed sequence must split into 2*CP zigzag chunks (headwise THD too: its
    per-sequence all-to-all divides the boundaries by CP). FLA's ``build_cp_context`` silently drops tail tokens of a sequence that does not
    split into 2*CP equal zigzag chunks, and FLA's CP conv needs every rank's contiguous
    share (total tokens / CP) to hold the conv halo (kernel - 1 tokens); both are checked
    up front.

    Args:
        plan: from :func:`plan_linear_cp`.
        cu_seqlens: global cumulative (padded) lengths, int32/int64 [num_seqs + 1], or None
            for SBHD (then ``plan.global_seq_len`` is checked).
        conv_kernel_size: the GDN conv width (chunkwise halo check).

    Raises:
        LinearCPError: a length not divisible by 2*CP, or a chunkwise rank share shorter
            than the conv halo.
    """
    if not (plan.chunkwise or plan.all_gather or (plan.headwise and cu_seqlens is not None)):
        return
    divisor = 2 * plan.size
    if cu_seqlens is None:
        lengths: Sequence[int] = [plan.global_seq_len]
    else:
        lengths = torch.diff(cu_seqlens.detach().to("cpu", torch.long)).tolist()
    bad = [n for n in lengths if n % divisor]
    if bad:
        raise LinearCPError(
            f"linear_cp_mode={plan.mode!r} with CP={plan.size} needs every sequence length "
            f"divisible by 2*CP={divisor}; got {bad[:8]}. Pad each packed sequence to a "
            f"multiple of {divisor} (cu_seqlens_q_padded) or change CP."
        )
    share = sum(lengths) // plan.size
    if plan.chunkwise and share < conv_kernel_size - 1:
        raise LinearCPError(
            f"linear_cp_mode='chunkwise' with CP={plan.size} gives each rank {share} tokens, fewer "
            f"than the conv halo of {conv_kernel_size - 1}. Use fewer CP ranks for such short "
            "micro-batches (dynamic CP) or linear_cp_mode='all_gather'."
        )


def _rank_order(cu_seqlens: Optional[torch.Tensor], seq_len: int, cp_size: int, device) -> list:
    if cu_seqlens is None:
        cu = torch.tensor([0, seq_len], dtype=torch.long, device=device)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
    return [get_thd_context_parallel_rank_indices(cu, cp_size, r, "zigzag") for r in range(cp_size)]


class _GatherZigzag(torch.autograd.Function):
    """All-gather zigzag shards into natural order; backward sums over ranks, keeps ours."""

    @staticmethod
    def forward(ctx, x, group, seq_dim, natural_index):
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.seq_dim = group, seq_dim
        ctx.save_for_backward(natural_index)
        return torch.cat(parts, dim=seq_dim).index_select(seq_dim, natural_index)

    @staticmethod
    def backward(ctx, grad):
        (natural_index,) = ctx.saved_tensors
        group, seq_dim = ctx.group, ctx.seq_dim
        stacked = grad.new_zeros(grad.shape).index_copy_(seq_dim, natural_index, grad)
        local_len = stacked.shape[seq_dim] // group.size()
        if "nccl" in str(dist.get_backend(group)) and grad.is_cuda and seq_dim == 0:
            out = grad.new_empty((local_len,) + tuple(stacked.shape[1:]))
            dist.reduce_scatter_tensor(out, stacked.contiguous(), group=group)
            return out, None, None, None
        dist.all_reduce(stacked, group=group)
        return stacked.narrow(seq_dim, group.rank() * local_len, local_len), None, None, None


def gather_zigzag_sequence(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    seq_dim: int = 0,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gather this rank's zigzag shard into the full sequence in natural token order.

    Args:
        x: local shard, any dtype, sequence on ``seq_dim`` (``[s_local, b, d]`` SBHD or
            ``[t_local, 1, d]`` THD), in Megatron's zigzag layout: rank r holds chunks r and
            2*CP-1-r of each sequence split into 2*CP equal chunks.
        group: CP group.
        cu_seqlens: global cumulative lengths for THD, None for SBHD.

    Returns:
        ``[s_local * CP, ...]`` on ``seq_dim``, natural order, same dtype. Differentiable.
    """
    cp_size = group.size()
    order = _rank_order(cu_seqlens, x.shape[seq_dim] * cp_size, cp_size, x.device)
    natural_index = torch.argsort(torch.cat(order))
    return _GatherZigzag.apply(x, group, seq_dim, natural_index)


def scatter_zigzag_sequence(
    x_full: torch.Tensor,
    group: dist.ProcessGroup,
    seq_dim: int = 0,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Keep this rank's zigzag part of a full natural-order sequence (inverse of the gather).

    Args:
        x_full: ``[s_global, ...]`` on ``seq_dim``, natural order.
        group: CP group; the rank's position in it picks the part.
        cu_seqlens: global cumulative lengths for THD, None for SBHD.

    Returns:
        ``[s_global / CP, ...]``, zigzag order, same dtype. Differentiable (no collective).
    """
    order = _rank_order(cu_seqlens, x_full.shape[seq_dim], group.size(), x_full.device)
    return x_full.index_select(seq_dim, order[group.rank()])
