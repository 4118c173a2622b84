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

Packed (THD) ``cu_seqlens`` are validated and normalised here before conv and scan see them
(:func:`packed_seq_metadata`): zero-length segments (repeated boundaries, as padded static
batching makes them) are dropped, because FLA 0.4.2 numbers its chunks by counting segment
starts and assigns every chunk after an empty segment to the wrong sequence (the conv leaves
outputs unwritten, the scan restarts its state at the wrong token). This is a downstream fix,
not upstream Megatron-LM behaviour.

A packed micro-batch's metadata is built once, in the data path, by
:func:`finalize_packed_seq_params` (upstream dev's name and call; also importable from
``megatron.core.context_parallel_layout``): the checked host boundaries, device tensors of its
own for FLA (FLA caches on tensor identity, so it never gets a tensor the caller may rewrite),
the CP routes and FLA's CP context (:class:`PackedSeqMetadata`, kept on the
``PackedSeqParams``). The GDN layers then only read it, after a cheap check that it still
matches the tensors they are given; without it the first GDN layer of the micro-batch builds it
(one device->host copy, a one-time warning).

The FLA releases this tree is tested with are listed in :data:`SUPPORTED_FLA_VERSIONS`;
:func:`check_fla_version` refuses any other when a GDN layer is built (FLA moved
``chunk_gated_delta_rule``'s parameters between releases, so an untested one would fail
mid-forward with a ``TypeError``, or run with other semantics).
"""

import collections
import dataclasses
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.packed_seq_params import resolve_cp_group
from megatron.core.tensor_parallel import all_to_all

LINEAR_CP_MODES = ("headwise", "chunkwise", "all_gather")
DEFAULT_LINEAR_CP_MODE = "headwise"


class LinearCPError(ValueError):
    """A GDN context-parallel setting or input that cannot run; the message says what to change."""


#: What the packed-metadata path did in this process, by event (read and reset by tests and
#: benchmarks; never read by the layers): ``finalized`` (metadata built by
#: :func:`finalize_packed_seq_params`), ``layer_built`` (built by a GDN layer because the
#: micro-batch was not finalized or its metadata no longer matched), ``host_copies``
#: (device->host copies of boundaries), ``routes`` (:class:`ThdLayoutRoutes` built),
#: ``gather_indices`` (all_gather index pairs built), ``fla_contexts`` (FLA
#: ``build_cp_context`` calls), ``late_builds`` (any of the last three built by a layer on a
#: finalized micro-batch because its mode was not prebuilt).
PACKED_METADATA_COUNTS: "collections.Counter[str]" = collections.Counter()

#: The linear_cp_modes GatedDeltaNet layers of this process were built with
#: (:func:`register_linear_cp_mode`); :func:`finalize_packed_seq_params` prebuilds their CP state.
_LAYER_MODES: set = set()


def register_linear_cp_mode(mode: str) -> None:
    """Record that a GatedDeltaNet layer of ``mode`` was built (called from its ``__init__``), so
    that :func:`finalize_packed_seq_params` prebuilds exactly the CP state that mode reads."""
    _LAYER_MODES.add(check_linear_cp_mode(mode))


#: FLA (flash-linear-attention / fla-core) releases the GDN layers are tested with. 0.4.2: triton
#: 3.6.0. 0.5.2 and 0.6.0: triton >= 3.7.1 on Hopper (FLA refuses its gated backward with triton
#: >= 3.4.0, < 3.7.1 there unless tilelang is usable); they run FlashQLA instead of their Triton
#: kernels when ``flash_qla`` is installed, except under CP (``FLA_FLASH_QLA=0`` turns that off).
#: 0.6.0 is fla-core alone (flash-linear-attention 0.6.0 needs a transformers Bridge refuses).
SUPPORTED_FLA_VERSIONS = ("0.4.2", "0.5.2", "0.6.0")


class UnsupportedFLAError(RuntimeError):
    """The installed FLA release is not one of :data:`SUPPORTED_FLA_VERSIONS`."""


def installed_fla_version() -> Optional[str]:
    """Version of the ``fla`` package that imports (``fla.__version__``), else fla-core's
    distribution metadata; None when neither is there."""
    try:
        import fla

        found = getattr(fla, "__version__", None)
        if found:
            return str(found)
    except ImportError:
        pass
    try:
        from importlib import metadata

        return metadata.version("fla-core")
    except Exception:  # PackageNotFoundError, or broken metadata
        return None


def check_fla_version(version: Optional[str] = None) -> str:
    """Return the installed FLA version (or ``version``) when it is supported.

    Raises:
        UnsupportedFLAError: naming the version found and the supported ones.
    """
    found = installed_fla_version() if version is None else version
    if found not in SUPPORTED_FLA_VERSIONS:
        raise UnsupportedFLAError(
            f"flash-linear-attention {found or '(not found)'} is installed; the GDN layers of this "
            f"Megatron tree support FLA {', '.join(SUPPORTED_FLA_VERSIONS[:-1])} and "
            f"{SUPPORTED_FLA_VERSIONS[-1]} only (FLA changed chunk_gated_delta_rule's parameters "
            "between releases). Install one of them: "
            "`pip install flash-linear-attention==0.4.2 fla-core==0.4.2 triton==3.6.0`, "
            "`pip install flash-linear-attention==0.5.2 fla-core==0.5.2 triton==3.7.1`, or "
            "`pip install fla-core==0.6.0 triton==3.7.1` (without flash-linear-attention), "
            "the last two with a torch that declares that triton (torch 2.12.1)."
        )
    return found


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
    for name, heads in (
        ("linear_num_key_heads", num_key_heads),
        ("linear_num_value_heads", num_value_heads),
    ):
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
        LinearCPError: a micro-batch without tokens (any mode and CP size); local_cp_size
            mismatch; headwise with a group whose size does not split the heads; chunkwise
            with deterministic mode, with an inference context, or with SBHD input and
            batch > 1.
    """
    if local_seq_len == 0 or batch == 0:
        raise LinearCPError(
            f"GDN got a micro-batch without tokens (hidden_states of {local_seq_len} x {batch} "
            "tokens on this rank); FLA's kernels cannot run on it. Drop empty micro-batches "
            "before the model, or give every CP rank at least one token per sequence chunk."
        )
    group = resolve_cp_group(static_cp_group, packed_seq_params)
    size = group.size() if group is not None else 1
    local_cp_size = getattr(packed_seq_params, "local_cp_size", None)
    if local_cp_size is not None and int(local_cp_size) != size:
        raise LinearCPError(
            f"PackedSeqParams.local_cp_size={local_cp_size} but its CP group has {size} ranks. "
            "Set local_cp_size to cp_group.size() when building the micro-batch."
        )
    plan = LinearCPPlan(
        mode=mode, group=group, size=size, global_seq_len=local_seq_len * sp_size * size
    )
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


def _check_zigzag_lengths(what: str, lengths: Sequence[int], cp_size: int) -> None:
    # One check for every caller that splits sequences into 2*CP zigzag chunks.
    divisor = 2 * cp_size
    bad = [n for n in lengths if n % divisor] if cp_size > 1 else []
    if bad:
        raise LinearCPError(
            f"{what} with CP={cp_size} needs every sequence length divisible by "
            f"2*CP={divisor} (the zigzag split); got {bad[:8]}. Pad each sequence to a multiple "
            f"of {divisor} (SBHD: the sequence; THD: cu_seqlens_q_padded) or change CP."
        )


def check_sequence_lengths(
    plan: LinearCPPlan, cu_seqlens: Optional[torch.Tensor], conv_kernel_size: int = 1
) -> None:
    """Require sequence lengths that the CP paths can split (every mode, CP > 1).

    Every sequence (the global SBHD length, or each packed THD sequence) must split into
    2*CP equal zigzag chunks: headwise undoes the zigzag split per sequence after its
    all-to-all (``torch.chunk`` into 2*CP pieces silently reorders or drops tokens otherwise),
    all_gather and chunkwise rebuild the natural order from it, and FLA's
    ``build_cp_context`` silently drops the tail tokens of a sequence that does not split.
    This also refuses a micro-batch with fewer tokens per sequence than 2*CP. FLA's CP conv
    further needs every chunkwise rank's contiguous share (total tokens / CP) to hold the
    conv halo (kernel - 1 tokens).

    Args:
        plan: from :func:`plan_linear_cp`.
        cu_seqlens: global cumulative (padded) lengths, int32/int64 [num_seqs + 1], best the
            host copy from :func:`packed_seq_metadata` (no device sync); None for SBHD (then
            ``plan.global_seq_len`` is checked).
        conv_kernel_size: the GDN conv width (chunkwise halo check).

    Raises:
        LinearCPError: a length not divisible by 2*CP, or a chunkwise rank share shorter
            than the conv halo.
    """
    if plan.size == 1:
        return
    if cu_seqlens is None:
        lengths: Sequence[int] = [plan.global_seq_len]
    else:
        lengths = torch.diff(cu_seqlens.detach().to("cpu", torch.long)).tolist()
    _check_zigzag_lengths(f"linear_cp_mode={plan.mode!r}", lengths, plan.size)
    share = sum(lengths) // plan.size
    if plan.chunkwise and share < conv_kernel_size - 1:
        raise LinearCPError(
            f"linear_cp_mode='chunkwise' with CP={plan.size} gives each rank {share} tokens, fewer "
            f"than the conv halo of {conv_kernel_size - 1}. Use fewer CP ranks for such short "
            "micro-batches (dynamic CP) or linear_cp_mode='all_gather'."
        )


CU_SEQLENS_DTYPES = (torch.int32, torch.int64)
# FLA 0.4.2's conv and scan kernels compute some element offsets in int32 (e.g.
# ``(bos * H + i_h) * V`` in ``fla/ops/gated_delta_rule/wy_fast.py``): a tensor handed to
# them must hold fewer elements than this.
KERNEL_MAX_ELEMENTS = 2**31


def _check_cu_seqlens_tensor(name: str, cu_seqlens) -> None:
    # What can be checked without reading the values (no device sync); ``name`` is how the
    # messages call the tensor.
    if not isinstance(cu_seqlens, torch.Tensor):
        raise LinearCPError(
            f"PackedSeqParams.{name} must be a tensor, got {type(cu_seqlens).__name__}. "
            "Build it with torch.tensor(..., dtype=torch.int32)."
        )
    if cu_seqlens.dtype not in CU_SEQLENS_DTYPES:
        raise LinearCPError(
            f"PackedSeqParams.{name} has dtype {cu_seqlens.dtype}; GDN takes int32 or int64 "
            "cumulative lengths. Convert it with .to(torch.int32)."
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise LinearCPError(
            f"PackedSeqParams.{name} must be 1-D with at least two entries [0, ..., total], got "
            f"shape {tuple(cu_seqlens.shape)}. Pass the cumulative lengths of the micro-batch."
        )
    if cu_seqlens.is_meta:
        raise LinearCPError(
            f"PackedSeqParams.{name} is on the meta device (no values). Build it on the host "
            "or on the device of the micro-batch."
        )


def _copy_cu_seqlens_to_host(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Copy cumulative lengths to the host in one device->host copy, whatever their number.

    This is the only place where GDN reads packed boundaries back from the device (one host
    sync on an accelerator). Several tensors (e.g. distinct ``cu_seqlens_q`` and
    ``cu_seqlens_kv``) are concatenated as int64 on their device first, so they still cost
    one copy. Host tensors are cloned: the result never aliases the caller's tensor.

    Args:
        tensors: 1-D int32/int64 tensors, all on one device.

    Returns:
        Host copies, one per tensor, each in the dtype of its tensor.
    """
    PACKED_METADATA_COUNTS["host_copies"] += 1
    if len(tensors) == 1:
        tensor = tensors[0].detach()
        return [tensor.clone() if tensor.device.type == "cpu" else tensor.to("cpu")]
    flat = torch.cat([t.detach().to(torch.long) for t in tensors])
    host = flat if flat.device.type == "cpu" else flat.to("cpu")
    parts = torch.split(host, [t.numel() for t in tensors])
    return [part.to(t.dtype) for part, t in zip(parts, tensors)]


def _check_host_cu_seqlens(
    name: str, host: torch.Tensor, total_tokens: Optional[int] = None
) -> None:
    # The value checks of global cumulative lengths, on their host copy (no device sync).
    # ``total_tokens``: the length of the packed buffer, when known.
    lengths = torch.diff(host.to(torch.long))
    first, last = int(host[0]), int(host[-1])
    if first != 0 or bool((lengths < 0).any()):
        raise LinearCPError(
            f"PackedSeqParams.{name} must start at 0 and never decrease, got "
            f"{host.tolist()[:16]}. Pass cumulative lengths (torch.cumsum of the lengths, "
            "with a leading 0)."
        )
    if total_tokens is not None and last != total_tokens:
        raise LinearCPError(
            f"PackedSeqParams.{name}[-1]={last} but the micro-batch holds {total_tokens} tokens "
            "(local tokens x SP x CP). cu_seqlens must be global (before the CP split) and "
            "cover the whole packed buffer, padding included."
        )


def _host_cu_seqlens(
    name: str, cu_seqlens: torch.Tensor, total_tokens: Optional[int] = None
) -> torch.Tensor:
    # The checked host copy of global cumulative lengths, in their dtype; a host tensor is
    # used as it is (no copy).
    _check_cu_seqlens_tensor(name, cu_seqlens)
    if cu_seqlens.device.type == "cpu":
        host = cu_seqlens.detach()
    else:
        (host,) = _copy_cu_seqlens_to_host([cu_seqlens])
    _check_host_cu_seqlens(name, host, total_tokens)
    return host


def _thd_cu_seqlens_sources(packed_seq_params):
    # ((name, tensor) of q, (name, tensor) of kv): the padded lengths when given, else the
    # actual ones, as the base GatedDeltaNet._resolve_cu_seqlens reads them.
    sources = []
    for side in ("q", "kv"):
        padded = getattr(packed_seq_params, f"cu_seqlens_{side}_padded", None)
        name = f"cu_seqlens_{side}_padded" if padded is not None else f"cu_seqlens_{side}"
        tensor = padded if padded is not None else getattr(packed_seq_params, name, None)
        if tensor is None:
            raise LinearCPError(
                f"THD input needs PackedSeqParams.cu_seqlens_{side} (or its _padded form). "
                "Set both, or pass SBHD input without packed_seq_params."
            )
        sources.append((name, tensor))
    return tuple(sources)


def _tensor_stamp(tensor: torch.Tensor) -> tuple:
    # What identifies the values of ``tensor`` without reading them (no device sync): the
    # object, its in-place version counter, and its view (device, dtype, data pointer, shape,
    # strides, storage offset). Inference tensors keep no version counter (None).
    try:
        version = tensor._version
    except RuntimeError:
        version = None
    return (
        tensor,
        version,
        tensor.device,
        tensor.dtype,
        tensor.data_ptr(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
    )


def _same_stamp(made: tuple, now: tuple, unversioned_ok: bool = False) -> bool:
    # The tensor is compared by identity: == on tensors would compare (and sync on) values.
    # Inference tensors (torch.inference_mode) keep no version counter (None): they match only
    # when ``unversioned_ok`` (finalized metadata: identity and view, the finalize-after-the-
    # last-write contract), else never (a layer's own metadata is rebuilt, as it cannot tell).
    return made[0] is now[0] and (made[1] is not None or unversioned_ok) and made[1:] == now[1:]


def _cp_key(cp_group: Optional[dist.ProcessGroup]) -> tuple:
    if cp_group is None:
        return (None, 1, 0)
    return (cp_group, cp_group.size(), cp_group.rank())


_NOT_FINALIZED_WARNED = False


class PackedSeqMetadata:
    """Everything the GDN layers need to know about one packed (THD) micro-batch, built once.

    Built by :func:`finalize_packed_seq_params` in the data pipeline (or, when that was not
    called, by the first GDN layer of the micro-batch) and kept on the micro-batch's
    ``PackedSeqParams.gdn_packed_metadata``; never on a module or the shared config. It holds:

    * the checked host copy of the final boundaries (``host_q``/``host_kv``) and the boundaries
      without zero-length segments (``cu_seqlens_cpu``), which FLA 0.4.2 would assign to the
      wrong sequence;
    * ``cu_seqlens``: a device tensor of its own with those boundaries. FLA caches index helpers
      on the identity of the tensor it is given (FLA issue #1274), so FLA never receives a
      tensor the caller owns and may rewrite in place for the next micro-batch;
    * at CP > 1: the chunkwise zigzag <-> contiguous route (:class:`ThdLayoutRoutes`, also put
      on ``PackedSeqParams.cp_partition_route``), the all_gather index pair and FLA's CP context
      for chunkwise (per conv width, :meth:`fla_cp_context`).

    A layer uses it only while :meth:`matches` holds: the same boundary tensor objects in the
    same fields, unchanged in place (``Tensor._version``) and in view (device, data pointer,
    dtype, shape, strides, storage offset), the same CP group, size and rank, and for host
    tensors the same values. Writes that no counter sees (a collective into a reused device
    buffer on a receiving rank, ``.data`` writes, numpy views of device memory) cannot be
    detected without a host sync: the contract is to finalize after the last write of a
    micro-batch.

    Args:
        packed_seq_params: ``PackedSeqParams`` of a packed (THD) micro-batch with global
            cumulative lengths, int32 or int64 ``[num_seqs + 1]`` (padded ones when given).
        cp_group: the CP group the GDN layers run the micro-batch on (None: no CP).
        cu_seqlens_cpu: host copy of those boundaries when the caller has one (then no
            device->host copy is made); copied, never kept.
        finalized: built by :func:`finalize_packed_seq_params` (else by a layer).
        linear_cp_modes: the modes to prebuild CP state for (default all three).

    Raises:
        LinearCPError: boundaries missing, not int32/int64, not 1-D of >= 2 entries, on the
            meta device, q and kv on different devices or with different values, not starting
            at 0 or decreasing, a ``cu_seqlens_cpu`` of another shape or not on the host, or
            (CP > 1) a sequence length not divisible by 2*CP.
    """

    def __init__(
        self,
        packed_seq_params,
        cp_group: Optional[dist.ProcessGroup] = None,
        *,
        cu_seqlens_cpu: Optional[torch.Tensor] = None,
        finalized: bool = False,
        linear_cp_modes: Sequence[str] = LINEAR_CP_MODES,
    ):
        (name_q, cu_q), (name_kv, cu_kv) = _thd_cu_seqlens_sources(packed_seq_params)
        _check_cu_seqlens_tensor(name_q, cu_q)
        if cu_kv is not cu_q:
            _check_cu_seqlens_tensor(name_kv, cu_kv)
            if cu_kv.device != cu_q.device:
                raise LinearCPError(
                    f"PackedSeqParams.{name_q} is on {cu_q.device} but {name_kv} on "
                    f"{cu_kv.device}. Put both on one device (or pass one tensor for both)."
                )
        if cu_seqlens_cpu is not None:
            host_q = _given_host_cu_seqlens(cu_seqlens_cpu, name_q, cu_q)
            host_kv = host_q
            for name, tensor in ((name_q, cu_q), (name_kv, cu_kv)):
                # free to compare where the boundaries live on the host; on a device, trusted
                differs = tuple(tensor.shape) != tuple(host_q.shape) or (
                    tensor.device.type == "cpu"
                    and not torch.equal(tensor.detach().to(torch.long), host_q.to(torch.long))
                )
                if differs:
                    values = (
                        f", values {tensor.tolist()[:16]}" if tensor.device.type == "cpu" else ""
                    )
                    raise LinearCPError(
                        f"cu_seqlens_cpu={host_q.tolist()[:16]} is not the host copy of "
                        f"PackedSeqParams.{name} (shape {tuple(tensor.shape)}{values}). Pass the "
                        "host copy as it is after the last change to the micro-batch (q and kv "
                        "alike), or leave cu_seqlens_cpu out (one device->host copy)."
                    )
        elif cu_kv is cu_q:
            (host_q,) = _copy_cu_seqlens_to_host([cu_q])
            host_kv = host_q
        else:
            host_q, host_kv = _copy_cu_seqlens_to_host([cu_q, cu_kv])
        _check_host_cu_seqlens(name_q, host_q)
        if host_kv is not host_q:
            _check_host_cu_seqlens(name_kv, host_kv)
            if not torch.equal(host_q.to(torch.long), host_kv.to(torch.long)):
                raise LinearCPError(
                    f"GDN needs {name_q} equal to {name_kv} (self-attention-like packing), got "
                    f"{host_q.tolist()[:16]} and {host_kv.tolist()[:16]}."
                )
        self.names = (name_q, name_kv)
        self.host_q, self.host_kv = host_q, host_kv
        self.finalized = finalized
        self.total_tokens = int(host_q[-1])
        if self.total_tokens == 0:
            raise LinearCPError(
                f"PackedSeqParams.{name_q}={host_q.tolist()[:16]}: a packed micro-batch without "
                "tokens (every segment empty); FLA's kernels cannot run on it. Drop empty "
                "micro-batches before the model."
            )
        self._stamps = (_tensor_stamp(cu_q), _tensor_stamp(cu_kv))
        self._cp = _cp_key(cp_group)
        keep = torch.ones(host_q.numel(), dtype=torch.bool)
        keep[1:] = host_q[1:] != host_q[:-1]
        self.cu_seqlens_cpu = host_q[keep]  # a new tensor even when nothing is dropped
        self.cu_seqlens = _own_device_copy(self.cu_seqlens_cpu, cu_q.device)
        self.group = cp_group
        self.size = self._cp[1]
        self.route: Optional[ThdLayoutRoutes] = None
        self._gather_index: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._fla_contexts: dict = {}
        self._built = False
        if self.size > 1:
            _check_zigzag_lengths(
                "The THD zigzag <-> contiguous layout",
                torch.diff(self.cu_seqlens_cpu.to(torch.long)).tolist(),
                self.size,
            )
            for mode in linear_cp_modes:
                if mode == "chunkwise":
                    self.layout_route()
                    self.fla_cp_context(None)
                elif mode == "all_gather":
                    self.gather_index()
        self._built = finalized

    def matches(self, packed_seq_params, cp_group: Optional[dist.ProcessGroup] = None) -> bool:
        """True when this still describes ``packed_seq_params`` run on ``cp_group``.

        Compares tensor identity, version counters, dtypes and views, the CP group, size and
        rank, and for host tensors their values; reads no device tensor value (no sync).
        Missing boundaries raise :class:`LinearCPError` as in :class:`PackedSeqMetadata`.
        """
        sources = _thd_cu_seqlens_sources(packed_seq_params)
        if tuple(name for name, _ in sources) != self.names:
            return False
        for (_, tensor), made in zip(sources, self._stamps):
            if not isinstance(tensor, torch.Tensor) or not _same_stamp(
                made, _tensor_stamp(tensor), unversioned_ok=self.finalized
            ):
                return False
        for (_, tensor), host in zip(sources, (self.host_q, self.host_kv)):
            if tensor.device.type == "cpu" and not torch.equal(
                tensor.detach().to(torch.long), host.to(torch.long)
            ):
                return False  # a write torch did not count (numpy view, .data): values differ
        now = _cp_key(cp_group)
        return now[0] is self._cp[0] and now[1:] == self._cp[1:]

    def _count_late(self):
        if self._built:
            PACKED_METADATA_COUNTS["late_builds"] += 1

    def layout_route(self) -> "ThdLayoutRoutes":
        """The chunkwise zigzag <-> contiguous route of this rank (built on first use)."""
        if self.route is None:
            self.route = ThdLayoutRoutes(self.cu_seqlens_cpu, self.group, self.cu_seqlens.device)
            PACKED_METADATA_COUNTS["routes"] += 1
            self._count_late()
        return self.route

    def gather_index(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(natural_index, local_order) device index tensors of the all_gather path: the
        gathered shards -> natural order, and natural order -> this rank's zigzag shard."""
        if self._gather_index is None:
            cu = self.cu_seqlens_cpu.to(torch.long)
            natural_index = _natural_index(cu, self.size)
            local = _zigzag_tokens(cu, self.size, self.group.rank())
            device = self.cu_seqlens.device
            self._gather_index = (
                _own_device_copy(natural_index, device),
                _own_device_copy(local, device),
            )
            PACKED_METADATA_COUNTS["gather_indices"] += 1
            self._count_late()
        return self._gather_index

    def fla_cp_context(self, conv1d_kernel_size: Optional[int]):
        """FLA's CP context of this micro-batch for a conv of ``conv1d_kernel_size``.

        ``build_cp_context`` runs once per micro-batch (on the host copy: no sync); other
        conv widths get a copy of that context with only ``conv1d_kernel_size`` changed.
        """
        if conv1d_kernel_size in self._fla_contexts:
            return self._fla_contexts[conv1d_kernel_size]
        if not self._fla_contexts:
            from fla.ops.cp import build_cp_context

            context = build_cp_context(
                cu_seqlens=self.cu_seqlens,
                group=self.group,
                conv1d_kernel_size=conv1d_kernel_size,
                cu_seqlens_cpu=self.cu_seqlens_cpu,
            )
            PACKED_METADATA_COUNTS["fla_contexts"] += 1
            self._count_late()
        else:
            context = dataclasses.replace(
                next(iter(self._fla_contexts.values())), conv1d_kernel_size=conv1d_kernel_size
            )
        self._fla_contexts[conv1d_kernel_size] = context
        return context


def _given_host_cu_seqlens(host, name: str, like: torch.Tensor) -> torch.Tensor:
    # The caller's host copy of PackedSeqParams.<name> (checked for what needs no values of the
    # device tensor), as a tensor of our own in the dtype of ``like``.
    _check_cu_seqlens_tensor(f"{name} (cu_seqlens_cpu=)", host)
    if host.device.type != "cpu" or tuple(host.shape) != tuple(like.shape):
        raise LinearCPError(
            f"cu_seqlens_cpu= must be the host copy of PackedSeqParams.{name}: a CPU tensor of "
            f"shape {tuple(like.shape)}, got a {host.device.type} tensor of shape "
            f"{tuple(host.shape)}. Pass the boundaries as the loader held them before the copy "
            "to the device, or leave cu_seqlens_cpu out (one device->host copy)."
        )
    return host.detach().to(like.dtype).clone()


def _own_device_copy(host: torch.Tensor, device) -> torch.Tensor:
    # A new tensor with the values of ``host`` on ``device`` (a clone on the host: ``.to`` would
    # return the tensor itself), copied without a sync.
    if torch.device(device).type == "cpu":
        return host.clone()
    return host_to_device(host, device)


def finalize_packed_seq_params(
    packed_seq_params,
    *,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    cp_group: Optional[dist.ProcessGroup] = None,
    linear_cp_modes: Optional[Sequence[str]] = None,
):
    """Resolve a micro-batch's CP group and build its packed metadata once, in the data path.

    Same name and call as upstream Megatron-LM dev (3f49de20, PR #6387,
    ``megatron/core/context_parallel_layout/utils.py``: ``finalize_packed_seq_params``): call
    it on the very ``PackedSeqParams`` the model gets, after the last change to it (repacking,
    padding, a VLM/Bridge unsplit path, a broadcast into its tensors), once per micro-batch.
    The CP group is ``packed_seq_params.cp_group`` (dynamic CP) or else the context-parallel
    group of ``parallel_state``; it is stored on ``packed_seq_params.cp_group``. For packed
    (THD) input a :class:`PackedSeqMetadata` goes to ``packed_seq_params.gdn_packed_metadata``
    and, at CP > 1, its chunkwise route to ``packed_seq_params.cp_partition_route``. The GDN
    layers then only read: no device->host copy, route or FLA context in the model. SBHD
    input gets only the CP group. Calling it again rebuilds from the current values (the same
    result when nothing changed).

    Args:
        packed_seq_params: ``PackedSeqParams`` or None (returned as is).
        cu_seqlens_cpu: the host copy of the boundaries the GDN layers read
            (``cu_seqlens_q_padded`` when given, else ``cu_seqlens_q``; int32/int64
            ``[num_seqs + 1]``) when the loader has it: then no device->host copy is made at
            all. Its values are trusted to equal the device tensor's (they cannot be compared
            without a sync).
        cp_group: the CP group, overriding the resolution above.
        linear_cp_modes: the GDN modes to prebuild CP state for (default: the modes the
            GatedDeltaNet layers of this process were built with, :func:`register_linear_cp_mode`;
            the headwise mode needs none). A mode left out is built by the first layer that
            needs it, on the host (no sync; counted as ``late_builds``).

    Returns:
        ``packed_seq_params``.

    Raises:
        LinearCPError: as :class:`PackedSeqMetadata`, raised here in the data path.
    """
    if packed_seq_params is None:
        return None
    if cp_group is None:
        cp_group = resolve_cp_group(
            parallel_state.get_context_parallel_group(check_initialized=False), packed_seq_params
        )
    if cp_group is not None:
        packed_seq_params.cp_group = cp_group
    if getattr(packed_seq_params, "qkv_format", None) != "thd":
        return packed_seq_params
    modes = sorted(_LAYER_MODES) if linear_cp_modes is None else tuple(linear_cp_modes)
    for mode in modes:
        check_linear_cp_mode(mode)
    metadata = PackedSeqMetadata(
        packed_seq_params,
        cp_group,
        cu_seqlens_cpu=cu_seqlens_cpu,
        finalized=True,
        linear_cp_modes=modes,
    )
    packed_seq_params.gdn_packed_metadata = metadata
    packed_seq_params.cp_partition_route = metadata.route
    PACKED_METADATA_COUNTS["finalized"] += 1
    return packed_seq_params


def prebuild_thd_cp_partition_routes(packed_seq_params, cp_group: Optional[dist.ProcessGroup]):
    """Upstream's name (Megatron-LM dev 3f49de20,
    ``megatron/core/context_parallel_layout/routes.py``) for building a THD micro-batch's
    route on ``cp_group``: here :func:`finalize_packed_seq_params` with that group.

    Returns:
        ``packed_seq_params.cp_partition_route`` (None for SBHD or CP=1).
    """
    finalize_packed_seq_params(packed_seq_params, cp_group=cp_group)
    return getattr(packed_seq_params, "cp_partition_route", None)


def packed_seq_metadata(
    packed_seq_params, total_tokens: int, cp_group: Optional[dist.ProcessGroup] = None
) -> PackedSeqMetadata:
    """The current :class:`PackedSeqMetadata` of a packed micro-batch, for a GDN layer.

    With a finalized micro-batch whose metadata still :meth:`~PackedSeqMetadata.matches`, this
    reads only (no sync, no build). Otherwise the layer builds it (one device->host copy,
    counted as ``layer_built`` in :data:`PACKED_METADATA_COUNTS`) and puts it on the
    ``PackedSeqParams``, so later layers and activation recompute of the micro-batch reuse it;
    the first time in the process a warning names :func:`finalize_packed_seq_params`.

    Like the base ``GatedDeltaNet._resolve_cu_seqlens``, the padded lengths are read when
    given, else the actual ones, and q and kv must agree. Zero-length segments (repeated
    boundaries, e.g. ``[0, 0, 64, 64, 200, 256, 256]``) are dropped (``[0, 64, 200, 256]``):
    they hold no token, so the zigzag layout is unchanged, while FLA 0.4.2's ``causal_conv1d``
    and ``chunk_gated_delta_rule`` (``prepare_chunk_indices`` counts segment starts) assign
    every chunk after an empty segment to the wrong sequence.

    Args:
        packed_seq_params: ``PackedSeqParams`` with ``qkv_format == "thd"``.
        total_tokens: tokens of the whole packed buffer (local tokens x SP x CP).
        cp_group: the CP group of this forward (None: no CP).

    Raises:
        LinearCPError: as :class:`PackedSeqMetadata`, or boundaries that do not end at
            ``total_tokens``.
    """
    global _NOT_FINALIZED_WARNED
    metadata = getattr(packed_seq_params, "gdn_packed_metadata", None)
    if not (
        isinstance(metadata, PackedSeqMetadata) and metadata.matches(packed_seq_params, cp_group)
    ):
        stale = isinstance(metadata, PackedSeqMetadata) and metadata.finalized
        # Built lazily: a layer builds only the CP state its mode uses.
        metadata = PackedSeqMetadata(packed_seq_params, cp_group, linear_cp_modes=())
        packed_seq_params.gdn_packed_metadata = metadata
        packed_seq_params.cp_partition_route = metadata.route
        PACKED_METADATA_COUNTS["layer_built"] += 1
        if stale:
            PACKED_METADATA_COUNTS["stale"] += 1
            warnings.warn(
                "A GDN layer got a packed micro-batch whose finalized metadata no longer matches "
                "its PackedSeqParams (new or rewritten cu_seqlens tensors, or another CP group): "
                "it rebuilt it (one device->host copy). Call megatron.core.context_parallel_layout."
                "finalize_packed_seq_params(packed_seq_params) after the last change to a "
                "micro-batch.",
                stacklevel=2,
            )
        elif not _NOT_FINALIZED_WARNED:
            _NOT_FINALIZED_WARNED = True
            warnings.warn(
                "GDN layers are building the packed micro-batch's metadata themselves (one "
                "device->host copy per micro-batch). Call megatron.core.context_parallel_layout."
                "finalize_packed_seq_params(packed_seq_params) when building each micro-batch "
                "(with cu_seqlens_cpu= when the loader has the boundaries on the host): then the "
                "model makes no host sync for it.",
                stacklevel=2,
            )
    if metadata.total_tokens != total_tokens:
        raise LinearCPError(
            f"PackedSeqParams.{metadata.names[0]}[-1]={metadata.total_tokens} but the micro-batch "
            f"holds {total_tokens} tokens (local tokens x SP x CP). cu_seqlens must be global "
            "(before the CP split) and cover the whole packed buffer, padding included."
        )
    return metadata


def check_kernel_extent(
    plan: LinearCPPlan,
    batch: int,
    conv_channels: int,
    scan_heads: int,
    key_head_dim: int,
    value_head_dim: int,
) -> None:
    """Refuse inputs whose conv or scan tensors FLA 0.4.2 would index past int32.

    The tokens one rank hands to FLA are the whole sequence (CP=1, headwise, all_gather) or
    its contiguous share (chunkwise). The conv input is ``[batch, tokens, conv_channels]``;
    the scan's per-token tensors are ``[batch, tokens, scan_heads, d]`` for d = K, V and the
    64-wide chunk matrices. Some of FLA's offsets are int32 (see
    :data:`KERNEL_MAX_ELEMENTS`), so at 2**31 elements or more they would wrap and the
    kernels would read or write the wrong memory; this refuses such inputs instead (a
    conservative bound: the whole buffer, whatever the packing).

    Args:
        plan: from :func:`plan_linear_cp`.
        batch: SBHD batch size (1 for THD).
        conv_channels: conv channels on this rank (TP- and headwise-CP-local).
        scan_heads: value heads the scan sees on this rank.
        key_head_dim, value_head_dim: K and V.

    Raises:
        LinearCPError: a conv or scan tensor of 2**31 elements or more.
    """
    tokens = plan.global_seq_len // plan.size if plan.chunkwise else plan.global_seq_len
    width = max(conv_channels, scan_heads * max(key_head_dim, value_head_dim, 64))
    elements = batch * tokens * width
    if elements >= KERNEL_MAX_ELEMENTS:
        raise LinearCPError(
            f"GDN would hand FLA a tensor of {elements} elements ({batch} x {tokens} tokens x "
            f"{width}); FLA 0.4.2 indexes its conv and scan tensors with int32 offsets, which "
            f"wrap at 2**31. Use fewer tokens per micro-batch, more CP ranks (linear_cp_mode="
            "'chunkwise' splits the tokens, 'headwise' the heads) or more TP."
        )


def host_to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without synchronising the stream.

    ``.to("cuda")`` waits for the stream after the copy (a host sync). With
    ``non_blocking=True`` from pageable memory, CUDA stages the bytes before the call returns,
    so the host tensor may be freed at once and nothing waits for the device. Pinning instead
    cost 2.8 ms of host time per call on the H200 host (session 20, call B profile).
    """
    return tensor.to(device, non_blocking=True)


def _zigzag_tokens(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    # Global token indices of one rank's zigzag shard, in its local order: per sequence, chunk
    # cp_rank then chunk 2*cp_size-1-cp_rank of the sequence's 2*cp_size equal chunks. That
    # order is ascending, which ThdLayoutRoutes relies on. Host tensors, O(tokens), no sort.
    if cp_size == 1:
        return torch.arange(int(cu_seqlens[-1]))
    starts = cu_seqlens[:-1]
    chunk = (cu_seqlens[1:] - starts) // (2 * cp_size)
    run_starts = torch.stack(
        [starts + cp_rank * chunk, starts + (2 * cp_size - 1 - cp_rank) * chunk], dim=1
    ).flatten()
    run_lens = chunk.repeat_interleave(2)
    run_offsets = torch.cumsum(run_lens, 0) - run_lens
    tokens = int(run_lens.sum())
    return torch.repeat_interleave(run_starts - run_offsets, run_lens) + torch.arange(tokens)


def _natural_index(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    # Host index that puts the all-gathered zigzag shards (rank 0's, then rank 1's, ...) back
    # into natural token order.
    order = torch.cat([_zigzag_tokens(cu_seqlens, cp_size, r) for r in range(cp_size)])
    natural_index = torch.empty_like(order)
    natural_index[order] = torch.arange(order.numel())
    return natural_index


def _route_cu_seqlens(
    cu_seqlens: torch.Tensor, cp_size: int, total_tokens: Optional[int] = None
) -> torch.Tensor:
    # The checks depend only on the global cu_seqlens, so every rank refuses alike (a rank
    # that built its route would otherwise wait in the all-to-all for one that refused), and
    # a length not divisible by 2*CP cannot silently drop its tail tokens from the route.
    cu = _host_cu_seqlens("cu_seqlens", cu_seqlens, total_tokens).to(torch.long)
    _check_zigzag_lengths("The THD zigzag <-> contiguous layout", torch.diff(cu).tolist(), cp_size)
    return cu


def _zigzag_cu_seqlens(cu_seqlens: Optional[torch.Tensor], seq_len: int, cp_size: int):
    # Checked host int64 cumulative lengths of the zigzag layout; SBHD (None) is one sequence.
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, seq_len], dtype=torch.long)
    return _route_cu_seqlens(cu_seqlens, cp_size, total_tokens=seq_len)


class ThdLayoutRoutes:
    """Both THD layout conversions of one micro-batch on one CP rank, routed on the host.

    Upstream's ``zigzag_to_contiguous_chunks(..., cu_seqlens=...)`` derives the route from
    device ``cu_seqlens`` at every call: each call computes every rank's token indices for
    both layouts with ``.item()``, tensor truth tests and boolean-mask indexing (about 30
    host syncs per conversion at CP=2, 64 per step with 8 samples), then permutes the tokens
    on both sides of its all-to-all. Here the route is derived once per forward from the
    host copy of ``cu_seqlens`` (the one :class:`PackedSeqMetadata` holds) in O(tokens)
    without sorting, and only one index tensor per conversion is copied to the device,
    without a sync. A zigzag shard lists its tokens in ascending order, so zigzag ->
    contiguous sends the shard as it is and permutes what it receives, and contiguous ->
    zigzag permutes what it sends and keeps what it receives. The exchanged tokens and their
    order match upstream's conversion: same values and gradients, bit for bit.

    Args:
        cu_seqlens_cpu: global cumulative lengths on the host, int ``[num_seqs + 1]``, every
            sequence length a multiple of ``2 * CP`` (checked by
            :func:`check_sequence_lengths`).
        group: CP group (size 1: both conversions return their input, as upstream).
        device: device of the tensors to convert.

    Raises:
        LinearCPError: cu_seqlens that are not int32/int64, not 1-D, on the meta device, not
            starting at 0 or decreasing, or (CP > 1) with a sequence length not divisible by
            ``2 * CP``: raised on every rank alike, before any collective (upstream raises
            ValueError). Also when the route does not place every token exactly once.
    """

    def __init__(self, cu_seqlens_cpu: torch.Tensor, group: dist.ProcessGroup, device):
        size, rank = group.size(), group.rank()
        cu = _route_cu_seqlens(cu_seqlens_cpu, size)
        self.group = group
        if size == 1:
            # As upstream: one rank holds the whole buffer in both layouts.
            self._to_contiguous = self._to_zigzag = None
            return
        span = int(cu[-1]) // size  # tokens of one rank's contiguous part
        shards = [_zigzag_tokens(cu, size, r) for r in range(size)]
        lo, hi = rank * span, (rank + 1) * span
        # Per rank: the tokens of its zigzag shard inside this rank's contiguous span, as
        # positions in the span (ascending, i.e. in both layouts' local order).
        in_span = []
        for shard in shards:
            first, last = torch.searchsorted(shard, torch.tensor([lo, hi])).tolist()
            in_span.append(shard[first:last] - lo)
        by_span = torch.searchsorted(shards[rank], torch.arange(size + 1) * span).tolist()
        mine_per_span = [by_span[r + 1] - by_span[r] for r in range(size)]
        from_shards = [int(part.numel()) for part in in_span]
        received = torch.cat(in_span)
        filled = torch.zeros(span, dtype=torch.bool)
        filled[received] = True
        if received.numel() != span or not bool(filled.all()):
            raise LinearCPError(
                "The THD zigzag <-> contiguous route does not cover this rank's tokens exactly "
                "once; cu_seqlens must be the same on every CP rank. Build PackedSeqParams "
                "from the global (pre-CP) cu_seqlens on all ranks."
            )
        gather_rows = torch.empty_like(received)
        gather_rows[received] = torch.arange(span)
        # (rows to send, rows to keep of what is received, input splits, output splits)
        self._to_contiguous = (
            None,
            host_to_device(gather_rows, device),
            mine_per_span,
            from_shards,
        )
        self._to_zigzag = (host_to_device(received, device), None, from_shards, mine_per_span)

    def _swap(self, x: torch.Tensor, route: Optional[tuple]) -> torch.Tensor:
        if route is None:
            return x
        send_rows, keep_rows, input_split_sizes, output_split_sizes = route
        if x.shape[0] != sum(input_split_sizes):
            raise LinearCPError(
                f"Local THD tensor of {x.shape[0]} tokens, but cu_seqlens give this CP rank "
                f"{sum(input_split_sizes)}; pass each rank its zigzag shard of the packed buffer."
            )
        send = x if send_rows is None else x.index_select(0, send_rows)
        received = all_to_all(self.group, send.contiguous(), output_split_sizes, input_split_sizes)
        return received if keep_rows is None else received.index_select(0, keep_rows)

    def to_contiguous(self, x: torch.Tensor) -> torch.Tensor:
        """``[t_local, ...]`` zigzag shard -> this rank's contiguous span (tokens on dim 0)."""
        return self._swap(x, self._to_contiguous)

    def to_zigzag(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_contiguous`."""
        return self._swap(x, self._to_zigzag)


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
    natural_index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gather this rank's zigzag shard into the full sequence in natural token order.

    Args:
        x: local shard, any dtype, sequence on ``seq_dim`` (``[s_local, b, d]`` SBHD or
            ``[t_local, 1, d]`` THD), in Megatron's zigzag layout: rank r holds chunks r and
            2*CP-1-r of each sequence split into 2*CP equal chunks.
        group: CP group.
        cu_seqlens: global cumulative lengths for THD (a host copy avoids a device sync),
            None for SBHD.
        natural_index: the prebuilt device index of a finalized micro-batch
            (:meth:`PackedSeqMetadata.gather_index`); then ``cu_seqlens`` is not read.

    Returns:
        ``[s_local * CP, ...]`` on ``seq_dim``, natural order, same dtype. Differentiable.
    """
    if natural_index is None:
        cp_size = group.size()
        cu = _zigzag_cu_seqlens(cu_seqlens, x.shape[seq_dim] * cp_size, cp_size)
        natural_index = host_to_device(_natural_index(cu, cp_size), x.device)
    return _GatherZigzag.apply(x, group, seq_dim, natural_index)


def scatter_zigzag_sequence(
    x_full: torch.Tensor,
    group: dist.ProcessGroup,
    seq_dim: int = 0,
    cu_seqlens: Optional[torch.Tensor] = None,
    local_order: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Keep this rank's zigzag part of a full natural-order sequence (inverse of the gather).

    Args:
        x_full: ``[s_global, ...]`` on ``seq_dim``, natural order.
        group: CP group; the rank's position in it picks the part.
        cu_seqlens: global cumulative lengths for THD (a host copy avoids a device sync),
            None for SBHD.
        local_order: the prebuilt device index of a finalized micro-batch
            (:meth:`PackedSeqMetadata.gather_index`); then ``cu_seqlens`` is not read.

    Returns:
        ``[s_global / CP, ...]``, zigzag order, same dtype. Differentiable (no collective).
    """
    if local_order is None:
        cp_size = group.size()
        cu = _zigzag_cu_seqlens(cu_seqlens, x_full.shape[seq_dim], cp_size)
        local_order = host_to_device(_zigzag_tokens(cu, cp_size, group.rank()), x_full.device)
    return x_full.index_select(seq_dim, local_order)
