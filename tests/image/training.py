"""The training tier: a small GDN language model trained under CP with Megatron's own pieces.

One *run* is a :class:`RunSpec` executed by :func:`train` inside an initialised process group
of ``tp * cp * dp`` ranks (gloo; CPU with FLA replaced by ``fla_emulation``, or ranks sharing
CUDA devices with the real FLA kernels). What a user's training loop does, from the tree first
on ``sys.path``:

* ``parallel_state.initialize_model_parallel`` (TP, CP; DP is the rest of the world),
* a ``GPTModel`` (``position_embedding_type="none"``) whose layers are ``TransformerLayer``\\ s
  with ``GatedDeltaNet`` as the token mixer (tensor-parallel linears and a torch norm, as
  ``gdn_harness.build_gdn`` builds it) and a local MLP,
* ``megatron.core.distributed.DistributedDataParallel`` (gradients reduced over DP x CP),
  ``get_megatron_optimizer`` with the distributed optimizer (torch Adam: no Apex, no TE),
  ``finalize_model_grads`` with the step's valid-token count (``calculate_per_token_loss``),
* ``megatron.core.dist_checkpointing`` save/load of the model's and the optimizer's
  ``sharded_state_dict`` with the metadata Megatron's training checkpointing builds
  (``dp_reshardable`` distributed-optimizer state, the default of ``--use-distributed-optimizer``).

Data: every step has :data:`MICRO_BATCHES` global micro-batches of :data:`SEQ` tokens, the same
for every parallel layout; DP rank ``d`` takes its contiguous share. Documents are arithmetic
token streams (``start + stride * i mod VOCAB``; the model learns the stride from context).
THD micro-batches pack three documents of unequal lengths, each padded to a multiple of
``2 * MAX_CP``, an empty segment between the first two, and a padding tail; SBHD is one stream,
batch 1. Each rank takes its zigzag tokens (checked against ``context_parallel_layout`` of the
tree under test and the independent ``cp_layout_ref``). Under TP every rank holds its shard of
the TP=1 weights (``gdn_harness.set_weights``); sequence-parallel runs use
:class:`SequenceParallelTorchNorm`. Dynamic-CP runs put each step's micro-batches on the CP 4,
2 and 1 subgroups of one CP=4 world (:data:`DYNAMIC_SCHEDULE`).

Base Megatron-Core problems worked around here (none is in our patch; ``docs/training-tier-tests.md``):
:func:`workaround_gloo_cuda_coalescing` (1), :func:`workaround_adam_state_before_load` (2),
:func:`workaround_reshardable_load_without_no_grad` (3), :func:`workaround_adam_step_after_load` (4),
:func:`workaround_gdn_out_norm_grad_over_tp` (6).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gdn_harness as H
from cp_layout_ref import zigzag_rank_indices

VOCAB = 64
SEQ = 128  # tokens per micro-batch (global, before the CP split)
MAX_CP = 4  # documents are padded to multiples of 2 * MAX_CP: legal at every CP size used
MICRO_BATCHES = 4  # global micro-batches per step (divisible by every DP size used)
LAYERS = 2
LR = 1e-3
# GDN_TRAINING_NO_OUT_NORM_WORKAROUND=1: leave problem 6 in place (shows what it does)
_NO_OUT_NORM_WORKAROUND = os.environ.get("GDN_TRAINING_NO_OUT_NORM_WORKAROUND") == "1"

GEOMETRIES = {
    # 4 key / 8 value heads: headwise is legal at CP 1, 2 and 4
    "legal": H.Geometry(hidden=64, k_heads=4, v_heads=8, dk=16, dv=16),
    # 2 key / 6 value heads: headwise is illegal at CP=4 (chunkwise and all_gather only)
    "headwise_illegal_at_cp4": H.Geometry(hidden=64, k_heads=2, v_heads=6, dk=16, dv=16),
}


TREES = ("patched", "base")
# SPIED names the base tree does not have (it has the headwise all-to-alls only): a base-tree
# run proves which tree it imported by their absence, a patched run by their presence
BASE_TREE_LACKS = frozenset(q for k, names in H.SPIED.items() if k != "headwise" for q in names)
# TransformerConfig fields of the patched tree the base tree's config does not accept
PATCH_ONLY_CONFIG_FIELDS = frozenset({"linear_cp_mode"})


@dataclass(frozen=True)
class RunSpec:
    """One training run. ``world = tp * cp * dp``; ``steps`` counts from step 1 (or from the
    checkpoint's step when ``load`` is given). ``save_at``: save after that step into
    ``<ckpt_root>/<save_name>``. ``order``: ``"forward"`` or ``"reversed"`` micro-batch order
    within a rank's accumulation (equivalent runs, used to derive the gates). ``tree``: which
    tree's ``megatron`` package the run's processes import (:data:`TREES`); the runner starts a
    base-tree run in processes of their own with that tree first on ``sys.path``.
    ``dynamic_cp``: :func:`dynamic_assignments` places the step's micro-batches on CP subgroups."""

    name: str
    cp: int = 1
    dp: int = 1
    tp: int = 1
    mode: str = "chunkwise"
    layout: str = "thd"
    geometry: str = "legal"
    recompute: bool = False
    sequence_parallel: bool = False
    steps: int = 6
    save_at: Optional[int] = None
    save_name: Optional[str] = None
    load: Optional[str] = None
    order: str = "forward"
    # which tree's ``megatron`` the run's processes import: "patched" (build/tree/patched) or
    # "base" (build/tree/base: the old image's GDN, no CP modes; CP=1 runs here)
    tree: str = "patched"
    # dynamic CP: one CP=``cp`` world (``initialize_model_parallel(dynamic_context_parallel=
    # True)``) whose micro-batches run on its CP subgroups of the sizes of DYNAMIC_SCHEDULE,
    # each micro-batch's PackedSeqParams carrying cp_group/local_cp_size (THD, DP=1, TP=1)
    dynamic_cp: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp


# --------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------


@dataclass
class MicroBatch:
    """A global micro-batch: ``tokens``/``labels``/``loss_mask``/``position_ids`` ``[SEQ]``
    (int64, float32 mask); ``cu_padded``/``cu_valid`` for THD (None for SBHD)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_padded: Optional[List[int]] = None
    valid: Optional[List[int]] = None

    def seq_lens(self) -> List[int]:
        if self.cu_padded is None:
            return [int(self.tokens.numel())]
        return [b - a for a, b in zip(self.cu_padded[:-1], self.cu_padded[1:])]


def _stream(gen, n: int) -> torch.Tensor:
    start = int(torch.randint(0, VOCAB, (1,), generator=gen))
    stride = int(torch.tensor([1, 3, 5, 7])[torch.randint(0, 4, (1,), generator=gen)])
    return (start + stride * torch.arange(n)) % VOCAB


def micro_batch(step: int, index: int, layout: str) -> MicroBatch:
    """The ``index``-th global micro-batch of ``step`` (1-based), deterministic.

    ``layout``: ``"sbhd"`` (one stream), ``"thd"`` (three documents, an empty segment between
    the first two, a padding tail) or ``"thd_noempty"`` (the same documents and tail without
    the empty segment: the base tree passes ``cu_seqlens`` to FLA as given, and FLA 0.4.1's
    ``prepare_chunk_indices`` maps every chunk after an empty segment to the wrong sequence;
    the upgrade runs use it, docs/training-tier-tests.md)."""
    if layout not in ("sbhd", "thd", "thd_noempty"):
        raise ValueError(f"micro_batch: unknown layout {layout!r} (sbhd, thd, thd_noempty)")
    gen = torch.Generator().manual_seed(1_000 * step + index)
    tokens = torch.zeros(SEQ, dtype=torch.long)
    labels = torch.zeros(SEQ, dtype=torch.long)
    mask = torch.zeros(SEQ, dtype=torch.float32)
    pos = torch.zeros(SEQ, dtype=torch.long)
    if layout == "sbhd":
        s = _stream(gen, SEQ + 1)
        tokens[:], labels[:], mask[:] = s[:-1], s[1:], 1.0
        pos[:] = torch.arange(SEQ)
        return MicroBatch(tokens, labels, mask, pos)
    q = 2 * MAX_CP
    lens = [int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((17, 34), (25, 42), (9, 22))]
    padded = [-(-n // q) * q for n in lens]
    # segments: doc0, an empty segment, doc1, doc2, the padding tail
    seg_valid = [lens[0], 0, lens[1], lens[2], 0]
    seg_len = [padded[0], 0, padded[1], padded[2], SEQ - sum(padded)]
    if layout == "thd_noempty":
        del seg_valid[1], seg_len[1]
    assert seg_len[-1] > 0, "the padding tail must not be empty"
    cu = [0]
    for n in seg_len:
        cu.append(cu[-1] + n)
    for a, n in zip(cu[:-1], seg_valid):
        if n == 0:
            continue
        s = _stream(gen, n)
        tokens[a : a + n] = s
        labels[a : a + n - 1] = s[1:]
        mask[a : a + n - 1] = 1.0  # the document's last token predicts nothing
        pos[a : a + n] = torch.arange(n)
    return MicroBatch(tokens, labels, mask, pos, cu, seg_valid)


def rank_indices(mb: MicroBatch, cp: int, cp_rank: int, tree: str = "patched") -> torch.Tensor:
    """This CP rank's zigzag token indices, from the tree's ``context_parallel_layout``
    (THD), checked against the independent definition of ``cp_layout_ref``. The base tree has
    no ``context_parallel_layout`` (our patch adds it): there, at CP=1 only, the independent
    definition alone (the identity).

    Raises:
        AssertionError: the tree's indices disagree with the independent ones.
        ValueError: a base-tree run at CP>1 (nothing of the tree to check the split against).
    """
    ref = torch.tensor(zigzag_rank_indices(mb.seq_lens(), cp, cp_rank), dtype=torch.long)
    if tree == "base":
        if cp != 1:
            raise ValueError(f"rank_indices: base-tree runs are CP=1 here, got CP={cp}")
        return ref
    if mb.cu_padded is not None:
        from megatron.core.context_parallel_layout import get_thd_context_parallel_rank_indices

        got = get_thd_context_parallel_rank_indices(
            torch.tensor(mb.cu_padded, dtype=torch.int32), cp, cp_rank, "zigzag").to(torch.long)
        assert torch.equal(got.cpu(), ref), (
            f"context_parallel_layout's zigzag indices differ from cp_layout_ref at CP={cp} rank {cp_rank}")
    return ref


# Dynamic CP: every step's MICRO_BATCHES global micro-batches, in rounds of one CP size each;
# a round of size s runs one micro-batch on each CP subgroup of s consecutive ranks (ranks
# [g*s, (g+1)*s), as parallel_state.create_dynamic_dp_cp_groups makes them), in this order.
# Of a CP=4 world: micro-batch 0 on all four ranks, 1 and 2 on the two pairs, 3 on rank 0 alone.
DYNAMIC_SCHEDULE = ((4, (0,)), (2, (1, 2)), (1, (3,)))


def dynamic_assignments(rank: int, world_cp: int, schedule=DYNAMIC_SCHEDULE) -> List[tuple]:
    """This rank's ``(micro-batch index, CP size, rank in its subgroup)`` of a step, in order.

    Raises:
        ValueError: the schedule does not place every micro-batch exactly once, or a size does
            not divide ``world_cp``, or a round has more micro-batches than subgroups.
    """
    placed = sorted(i for _, idxs in schedule for i in idxs)
    if placed != list(range(MICRO_BATCHES)):
        raise ValueError(f"dynamic CP schedule {schedule} places micro-batches {placed}, "
                         f"not each of 0..{MICRO_BATCHES - 1} once")
    out = []
    for size, idxs in schedule:
        if world_cp % size or len(idxs) > world_cp // size:
            raise ValueError(f"dynamic CP schedule: {len(idxs)} micro-batches on CP {size} "
                             f"subgroups of a CP={world_cp} world")
        g = rank // size
        if g < len(idxs):
            out.append((idxs[g], size, rank % size))
    return out


def packed_seq_params(mb: MicroBatch, device, cp_group=None, local_cp_size=None):
    """``PackedSeqParams`` of a THD micro-batch (None for SBHD); ``cp_group``/``local_cp_size``:
    the dynamic-CP subgroup it runs on (both or neither)."""
    if mb.cu_padded is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    actual = [0]
    for a, n in zip(mb.cu_padded[:-1], mb.valid):
        actual.append(actual[-1] + n)
    cu_pad = torch.tensor(mb.cu_padded, dtype=torch.int32, device=device)
    cu = torch.tensor(actual, dtype=torch.int32, device=device)
    mx = max(mb.seq_lens())
    kw = {} if cp_group is None else {"cp_group": cp_group, "local_cp_size": local_cp_size}
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad,
                           max_seqlen_q=mx, max_seqlen_kv=mx, **kw)


# --------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------


def make_config(spec: RunSpec, device):
    from megatron.core.transformer.transformer_config import TransformerConfig

    g = GEOMETRIES[spec.geometry]
    kw = dict(
        num_layers=LAYERS,
        hidden_size=g.hidden,
        ffn_hidden_size=2 * g.hidden,
        num_attention_heads=4,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=1,
        linear_conv_kernel_dim=g.conv,
        linear_key_head_dim=g.dk,
        linear_value_head_dim=g.dv,
        linear_num_key_heads=g.k_heads,
        linear_num_value_heads=g.v_heads,
        linear_cp_mode=spec.mode,
        tensor_model_parallel_size=spec.tp,
        context_parallel_size=spec.cp,
        sequence_parallel=spec.sequence_parallel,
        params_dtype=torch.float32,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,  # weights by name: gdn_harness.set_weights
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        activation_func=F.silu,
        gated_linear_unit=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=True,
        transformer_impl="local",
    )
    # dynamic CP: TransformerConfig(dynamic_context_parallel=True) only selects Megatron's data
    # scheduler (sequence_packing_scheduler="default_dynamic_cp", whose config check requires
    # Transformer Engine >= 2.9: the image has no TE); the model reads cp_group/local_cp_size
    # from PackedSeqParams, and the subgroups come from initialize_model_parallel. The flag
    # stays off; DYNAMIC_SCHEDULE plays the scheduler.
    if spec.recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(**config_kwargs_for_tree(kw, spec, TransformerConfig))


def config_kwargs_for_tree(kw: dict, spec: RunSpec, config_cls) -> dict:
    """``kw`` restricted to what the imported tree's ``TransformerConfig`` accepts.

    The patched tree must accept every field; the base tree may lack exactly the fields our
    patch adds (:data:`PATCH_ONLY_CONFIG_FIELDS`, i.e. ``linear_cp_mode``: it has no CP modes,
    its GDN is headwise). A base-tree run asks for CP=1 (its only CP run here) and a base-tree
    config never silently loses any other field.

    Raises:
        ValueError: ``spec.tree`` unknown; a base-tree run at CP>1; a field missing from the
            tree's config that the patch does not add (names the fields and the run).
    """
    import dataclasses

    if spec.tree not in TREES:
        raise ValueError(f"run {spec.name}: unknown tree {spec.tree!r} (one of {TREES})")
    accepted = {f.name for f in dataclasses.fields(config_cls)}
    missing = sorted(k for k in kw if k not in accepted)
    if spec.tree == "patched" and missing:
        raise ValueError(f"run {spec.name}: the patched tree's TransformerConfig lacks {missing}")
    if spec.tree == "base":
        if spec.cp != 1:
            raise ValueError(f"run {spec.name}: base-tree runs are CP=1 here (got CP={spec.cp})")
        unexpected = [k for k in missing if k not in PATCH_ONLY_CONFIG_FIELDS]
        if unexpected:
            raise ValueError(f"run {spec.name}: the base tree's TransformerConfig lacks "
                             f"{unexpected}, which our patch does not add")
    return {k: v for k, v in kw.items() if k in accepted}


class SequenceParallelTorchNorm:
    """``torch.nn.RMSNorm`` for sequence-parallel runs: Megatron's ``WrappedTorchNorm`` refuses
    ``sequence_parallel`` ("sequence parallel not supported by torch LayerNorm"); this one marks
    its weight ``sequence_parallel`` as Megatron's own norms do (``FusedLayerNorm``, ``TENorm``),
    so ``finalize_model_grads`` sums its gradient over TP (each TP rank saw its part of the
    sequence; for GDN's ``out_norm``, its part of the heads). Same arguments as
    ``WrappedTorchNorm``; RMSNorm only (the tier's normalization)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelTorchNorm: normalization {config.normalization!r}; "
                             "the training tier uses RMSNorm")
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        setattr(norm.weight, "sequence_parallel", bool(config.sequence_parallel))
        return norm


def layer_spec(sequence_parallel: bool = False):
    """``TransformerBlockSubmodules``: every layer GDN (local linears, torch norm) + local MLP.
    ``sequence_parallel``: every norm a :class:`SequenceParallelTorchNorm`."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    norm = SequenceParallelTorchNorm if sequence_parallel else WrappedTorchNorm
    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear))
    layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm,
        self_attention=gdn,
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=norm,
        mlp=get_mlp_module_spec_for_backend(LocalSpecProvider(), num_experts=None),
        mlp_bda=get_bias_dropout_add,
    ))
    return TransformerBlockSubmodules(layer_specs=[layer] * LAYERS, layer_norm=norm)


def build_model(spec: RunSpec, device):
    """GPTModel + DDP + distributed optimizer for ``spec`` (parallel_state initialised).

    Weights: ``gdn_harness.set_weights`` (seeded by parameter name, on the CPU, each TP rank
    its shard of the TP=1 values), so every run starts from the same weights on any device and
    TP/CP/DP size.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = make_config(spec, device)
    model = GPTModel(config, layer_spec(spec.sequence_parallel), vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="none", share_embeddings_and_output_weights=False,
                     parallel_output=True).to(device)
    H.set_weights(model, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=spec.tp)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               overlap_param_gather=False,
                                               use_distributed_optimizer=True)
    model = DistributedDataParallel(config, ddp_config, model)
    opt_config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, adam_beta1=0.9,
                                 adam_beta2=0.95, adam_eps=1e-8, clip_grad=1e6, bf16=False, fp16=False,
                                 params_dtype=torch.float32, use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(opt_config, [model])
    return config, model, optimizer


# --------------------------------------------------------------------------------------
# base Megatron-Core problems, worked around in test code (docs/training-tier-tests.md)
# --------------------------------------------------------------------------------------


class _EachOnItsOwn:
    """Stands in for ``torch.distributed._coalescing_manager``: the collectives inside run one
    by one, synchronously (``wait`` has nothing left to wait for)."""

    def __init__(self, group=None, device=None, async_ops=False):
        assert not async_ops, "the workaround supports synchronous collectives only (overlap off)"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait(self):
        return None


@contextlib.contextmanager
def workaround_gloo_cuda_coalescing(device):
    """Problem 1: on gloo with CUDA tensors the distributed optimizer's coalesced parameter
    all-gather segfaults (coalesced all_reduce raises "unsupported device type cuda"); each
    collective on its own works. Replaces ``_coalescing_manager`` in
    ``megatron.core.distributed.param_and_grad_buffer`` (gloo + CUDA only; DDP runs with
    ``overlap_grad_reduce=False``/``overlap_param_gather=False``, so every call is synchronous)."""
    import megatron.core.distributed.param_and_grad_buffer as pgb

    if device.type != "cuda" or dist.get_backend() != "gloo":
        yield False
        return
    with mock.patch.object(pgb, "_coalescing_manager", _EachOnItsOwn):
        yield True


def workaround_adam_state_before_load(optimizer) -> None:
    """Problem 2: with torch Adam (no Apex/TE) a fresh optimizer has no state, and
    ``sharded_state_dict(is_loading=True)`` asserts on it. Megatron's training loop gives it
    dummy state first (``DistributedOptimizer._init_optimizer_states_with_dummy_values``, a
    step on zero gradients); the loaded state replaces it."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt._init_optimizer_states_with_dummy_values()


def workaround_reshardable_load_without_no_grad():
    """Problem 3: ``DistributedOptimizer.load_parameter_state_from_dp_reshardable`` copies into
    float32 main parameters (views of leaves that require grad) without the ``torch.no_grad``
    its fully-reshardable sibling has: "a view of a leaf Variable that requires grad is being
    used in an in-place operation". The optimizer's ``load_state_dict`` runs under
    ``torch.no_grad()`` (a load records no autograd history anyway)."""
    return torch.no_grad()


def workaround_adam_step_after_load(optimizer, step: int) -> dict:
    """Problem 4 (silent): after the distributed optimizer's reshardable load every parameter
    can share one Adam ``step`` tensor, holding the fresh (dummy) value instead of the
    checkpoint's, so bias correction is wrong. Gives every parameter its own ``step`` equal to
    the optimizer steps taken (the checkpoint's iteration; no step is ever skipped here).

    Returns ``{"shared_step_tensor": bool, "step_values_before": sorted distinct values}``:
    what was found, for the run's record."""
    found = {"shared_step_tensor": False, "step_values_before": []}
    values, ids = set(), set()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        states = list(opt.optimizer.state.values())
        for st in states:
            if "step" in st:
                s = st["step"]
                values.add(float(s))
                ids.add(id(s))
                st["step"] = torch.tensor(float(step), dtype=torch.float32,
                                          device=s.device if torch.is_tensor(s) else "cpu")
        found["shared_step_tensor"] = found["shared_step_tensor"] or (len(states) > 1 and len(ids) == 1)
    found["step_values_before"] = sorted(values)
    return found


def workaround_gdn_out_norm_grad_over_tp(model, spec: "RunSpec") -> bool:
    """Problem 6: under TP each rank normalises its own value heads with GDN's ``out_norm``
    (one weight of ``value_head_dim``, shared by every head), so each TP rank's gradient of that
    weight holds only its heads' part. The weight is not ``tensor_model_parallel``, and
    ``finalize_model_grads`` sums a replicated weight's gradient over TP only when it is marked
    ``sequence_parallel`` *and* sequence parallelism is on; without sequence parallelism nothing
    sums it: the TP ranks' ``out_norm`` weights get different updates and the optimizer's grad
    norm counts TP rank 0's part only. Sums ``main_grad`` of every GDN ``out_norm`` parameter
    over TP after the micro-batches' backward, before ``finalize_model_grads`` (TP > 1 without
    sequence parallelism only; with it, :class:`SequenceParallelTorchNorm`'s mark does this).
    Returns True when it summed."""
    from megatron.core import parallel_state as ps
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    if spec.tp == 1 or spec.sequence_parallel:
        return False
    group = ps.get_tensor_model_parallel_group()
    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            for p in m.out_norm.parameters():
                g = p.main_grad if hasattr(p, "main_grad") else p.grad
                dist.all_reduce(g, group=group)
    return True


@contextlib.contextmanager
def dynamic_cp_init_on_cpu(device, dynamic: bool):
    """gloo worlds: ``initialize_model_parallel(dynamic_context_parallel=True)`` ends with a
    barrier on each dynamic subgroup with ``device_ids=[torch.cuda.current_device()]``, an NCCL
    option (on a CPU host ``"cpu"`` under ``_world``'s CPU shim, which gloo's options reject);
    in a gloo world the barrier runs without ``device_ids``. On a CPU host the
    ``torch.cuda.synchronize()`` after it does nothing."""
    if not dynamic or dist.get_backend() != "gloo":
        yield
        return
    barrier = dist.barrier

    def gloo_barrier(*a, device_ids=None, **k):
        return barrier(*a, **k)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(dist, "barrier", gloo_barrier))
        if device.type == "cpu" and not torch.cuda.is_available():
            stack.enter_context(mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None))
        yield


class _NoRngFork:
    """CPU hosts: stands in for the CUDA RNG tracker (``fork`` does nothing; no dropout)."""

    def fork(self, *a, **k):
        return contextlib.nullcontext()


@contextlib.contextmanager
def cuda_literals_on_cpu(device):
    """CPU hosts only (never on a GPU): Megatron's optimizer, gradient clipping, DDP and
    dist_checkpointing allocate small tensors with ``device="cuda"`` / ``.cuda()`` literals and
    call ``torch.cuda.synchronize`` / streams, and check ``param.type()`` against
    ``torch.cuda.*Tensor``; the sequence-parallel embedding forks the CUDA RNG tracker. On a host
    without CUDA those land on the CPU, the stream calls and the fork do nothing; nothing else
    changes. (``_world.install_cpu_device_shim``
    already answers ``torch.cuda.current_device()`` with ``"cpu"``.)"""
    if device.type != "cpu" or torch.cuda.is_available():
        yield
        return

    def cpu_dev(kw):
        d = kw.get("device")
        if d is not None and torch.device(d).type == "cuda":
            kw["device"] = "cpu"
        return kw

    def wrap(fn):
        def inner(*a, **kw):
            return fn(*a, **cpu_dev(kw))
        return inner

    class _Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, *a, **k):
            return None

        def synchronize(self):
            return None

    with contextlib.ExitStack() as stack:
        for name in ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "empty_like",
                     "ones_like", "arange"):
            stack.enter_context(mock.patch.object(torch, name, wrap(getattr(torch, name))))
        stack.enter_context(mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self))
        type_orig = torch.Tensor.type

        def cuda_type(self, *a, **k):  # the optimizer checks param.type() == "torch.cuda.FloatTensor"
            if a or k:
                return type_orig(self, *a, **k)
            t = type_orig(self)
            return t.replace("torch.", "torch.cuda.", 1) if not t.startswith("torch.cuda.") else t

        stack.enter_context(mock.patch.object(torch.Tensor, "type", cuda_type))
        stack.enter_context(mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None))
        stack.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda *a, **k: _Stream()))
        stack.enter_context(mock.patch.object(torch.cuda, "Stream", _Stream))
        # sequence parallelism: the embedding's dropout runs inside the CUDA RNG tracker's
        # fork, whose state model_parallel_cuda_manual_seed (CUDA only) adds; dropout is 0
        # here, so on a CPU host the fork is a no-op
        import megatron.core.tensor_parallel as tpar

        stack.enter_context(mock.patch.object(tpar, "get_cuda_rng_tracker", lambda *a, **k: _NoRngFork()))
        yield


@contextlib.contextmanager
def without_psutil():
    """Environment, not Megatron: ``dist_checkpointing``'s file writer logs its process memory
    through ``psutil``, which the image has (``docker/requirements-*.lock``) but a bare test
    venv or GPU host may not; there the logged figure is 0. Nothing else changes."""
    import importlib.util

    import megatron.core.dist_checkpointing.strategies.filesystem_async as fsa

    if importlib.util.find_spec("psutil") is not None:
        yield False
        return
    with mock.patch.object(fsa, "_process_memory", lambda: 0):
        yield True


@contextlib.contextmanager
def workaround_nvrx_without_async_api():
    """Base MCore x the image's packages (problem 5 of docs/training-tier-tests.md): ``torch_dist`` saves go
    through nvidia-resiliency-ext's async writer whenever that package imports, and the image's
    locked nvidia-resiliency-ext 0.4.1 lacks ``get_write_results_queue``, which the pinned MCore's
    ``get_async_strategy`` imports: every ``dist_checkpointing.save`` then fails with
    "nvidia-resiliency-ext package is not installed". Megatron's own fallback, the ``mcore``
    async strategy, is used instead (as the error message advises), only when the API is absent.
    Yields True when the workaround is active."""
    import importlib

    import megatron.core.dist_checkpointing.strategies.torch as ts

    try:
        fsa = importlib.import_module("nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async")
        missing = not hasattr(fsa, "get_write_results_queue")
    except ImportError:
        missing = False  # no package: MCore already takes its own strategy
    if not (missing and getattr(ts, "HAVE_NVRX", False)):
        yield False
        return
    with mock.patch.object(ts, "HAVE_NVRX", False):
        yield True


# --------------------------------------------------------------------------------------
# path proof, per layer
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def spy_model_paths(model):
    """Wrap the contract's per-mode names once (``gdn_harness.SPIED``, counts shared) and each
    GDN layer's scan; conv calls are attributed to the layer whose forward is running. Yields
    ``{layer_number: gdn_harness.PathSpy}``."""
    import megatron.core.ssm.gated_delta_net as gdn
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    try:
        import megatron.core.ssm.gdn_context_parallel as gcp
    except ImportError:
        gcp = None
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    counts: Dict[str, int] = {}
    spies = {m.layer_number: H.PathSpy(counts=counts) for m in layers}
    inputs: Dict[int, List[int]] = {m.layer_number: [] for m in layers}
    for n, spy in spies.items():
        spy.input_tokens = inputs[n]  # tokens of each forward's hidden_states, this rank
    current = [None]  # the GDN layer whose forward is running (conv calls happen inside it)
    mods = {"gdn": gdn, "gcp": gcp, "meta": getattr(gcp, "PackedSeqMetadata", None)}
    with contextlib.ExitStack() as stack:
        for names in H.SPIED.values():
            for qual in names:
                prefix, attr = qual.split(".")
                mod = mods[prefix]
                counts[qual] = 0
                if mod is None or not hasattr(mod, attr):
                    counts[qual] = -1
                    continue
                orig = getattr(mod, attr)

                def wrapper(*a, __orig=orig, __q=qual, **k):
                    counts[__q] += 1
                    return __orig(*a, **k)

                stack.enter_context(mock.patch.object(mod, attr, wrapper))
        conv_orig = gdn.causal_conv1d

        def conv(*a, **k):
            x = k.get("x", a[0] if a else None)
            layer = current[0]
            if layer in spies:
                spies[layer].conv_calls.append({"tokens": int(x.shape[1]),
                                                "cp_context": k.get("cp_context") is not None})
            return conv_orig(*a, **k)

        stack.enter_context(mock.patch.object(gdn, "causal_conv1d", conv))
        for m in layers:
            rule_orig = m.gated_delta_rule

            def rule(q, *a, __orig=rule_orig, __spy=spies[m.layer_number], **k):
                __spy.rule_calls.append({"tokens": int(q.shape[1]), "heads": int(q.shape[2]),
                                         "cp_context": k.get("cp_context") is not None})
                return __orig(q, *a, **k)

            stack.enter_context(mock.patch.object(m, "gated_delta_rule", rule))

            def enter(mod, args, __n=m.layer_number):
                current[0] = __n
                inputs[__n].append(int(args[0].shape[0]))  # hidden_states [s, b, h]

            def leave(mod, args, output):
                current[0] = None

            for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave)):
                stack.callback(h.remove)
        yield spies


@contextlib.contextmanager
def count_new_groups():
    """Record ``torch.distributed.new_group`` calls (dynamic CP must create no process group
    while it trains: the subgroups exist from ``initialize_model_parallel``). Yields the list
    of calls; the calls still go through."""
    import torch.distributed.distributed_c10d as c10d

    calls: List[int] = []
    orig = c10d.new_group

    def counted(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    with mock.patch.object(dist, "new_group", counted), mock.patch.object(c10d, "new_group", counted):
        yield calls


def check_model_paths(spies, spec: RunSpec, mb: MicroBatch, cp: Optional[int] = None) -> dict:
    """Every GDN layer took ``spec.mode``'s path (``gdn_harness.expected_path``; under TP each
    rank's scan sees its ``1/tp`` of the heads) and got ``SEQ / cp`` tokens (``/ tp`` more under
    sequence parallelism). ``cp``: the CP size the micro-batches ran on (default ``spec.cp``;
    a dynamic-CP subgroup's size)."""
    cp = spec.cp if cp is None else cp
    geom = GEOMETRIES[spec.geometry]
    case = H.Case("train", SEQ, mb.cu_padded, mb.valid) if mb.cu_padded else H.Case("train", SEQ)
    expect = expected_tree_path(spec, geom, case, cp)
    if spec.tp > 1:  # each TP rank scans its own value heads (after the CP split, headwise)
        expect = {**expect, "heads": expect["heads"] // spec.tp}
    per_layer = {str(n): H.check_path(s, expect) for n, s in sorted(spies.items())}
    # the layer's input: this rank's CP share, and under sequence parallelism its 1/TP of it
    want = SEQ // cp // (spec.tp if spec.sequence_parallel else 1)
    for n, s in sorted(spies.items()):
        rec = per_layer[str(n)]
        rec.pop("seen", None)
        bad = sorted(set(t for t in s.input_tokens if t != want))
        if bad or not s.input_tokens:
            rec["passed"] = False
            rec["problems"].append(f"layer input had {bad or 'no'} tokens, expected {want}")
    tree = check_tree_names(spies, spec)
    return {"passed": bool(per_layer) and all(r["passed"] for r in per_layer.values())
            and tree["passed"], "layers": per_layer, "tree": tree}


def expected_tree_path(spec: RunSpec, geom, case, cp: Optional[int] = None) -> dict:
    """``gdn_harness.expected_path`` of ``spec.mode`` for the patched tree. The base tree's GDN
    has one path: every forward goes through its headwise all-to-alls
    (``tensor_a2a_cp2hp``/``hp2cp``: identities at CP=1), the scan and conv see the whole
    sequence with all value heads over CP and no ``cp_context``; the patch's other names do not
    exist there (:func:`check_tree_names`)."""
    cp = spec.cp if cp is None else cp
    if spec.tree != "base":
        return H.expected_path(spec.mode, cp, geom, case)
    called = {q: q in H.SPIED["headwise"] for names in H.SPIED.values() for q in names}
    return {"called": called, "cp_context": False, "tokens": case.length,
            "heads": geom.v_heads // cp}


def check_tree_names(spies, spec: RunSpec) -> dict:
    """The path proof's tree half: the spied names absent from the imported tree are exactly
    :data:`BASE_TREE_LACKS` for a base-tree run (its GDN has only the headwise all-to-alls) and
    none for a patched run. ``{"passed", "absent", "problems"}``."""
    counts = next(iter(spies.values())).counts if spies else {}
    absent = sorted(q for q, n in counts.items() if n == -1)
    want = sorted(BASE_TREE_LACKS) if spec.tree == "base" else []
    problems = [] if absent == want else [
        f"{spec.tree} tree: spied names absent {absent}, expected {want}"]
    return {"passed": not problems, "absent": absent, "problems": problems}


def imported_tree(spec: RunSpec, tree_dir: Optional[str]) -> dict:
    """Which ``megatron`` and FLA this process imported: ``{"megatron", "fla", "fla_file"}``.

    Raises:
        RuntimeError: ``tree_dir`` given and the GDN module is not under it (a run of one tree
            that imported the other: the runner's ``sys.path`` is wrong), naming both.
    """
    import megatron.core.ssm.gated_delta_net as gdn

    path = os.path.realpath(gdn.__file__)
    if tree_dir is not None and not path.startswith(os.path.realpath(tree_dir) + os.sep):
        raise RuntimeError(f"run {spec.name} (tree {spec.tree}) imported {path}, not from {tree_dir}")
    info = {"megatron": path, "fla": None, "fla_file": None}
    try:
        import fla

        info["fla"], info["fla_file"] = getattr(fla, "__version__", None), fla.__file__
    except Exception as exc:  # noqa: BLE001 - recorded (CPU: emulated anyway)
        info["fla"] = f"unavailable: {exc!r}"[:300]
    return info


# --------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------


def _metadata(dp_cp_group) -> dict:
    # what megatron.training.checkpointing._build_sharded_state_dict_metadata gives with
    # --use-distributed-optimizer (its default, dp_reshardable: reshardable along DP x CP)
    return {"distrib_optim_sharding_type": "dp_reshardable",
            "singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "dp_cp_group": dp_cp_group}


def _sharded(model, optimizer, step, is_loading, dp_cp_group):
    md = _metadata(dp_cp_group)
    msd = model.module.sharded_state_dict(metadata=md)  # the GPTModel inside DDP
    return {"model": msd, "optimizer": optimizer.sharded_state_dict(msd, is_loading=is_loading,
                                                                    metadata=md),
            "iteration": step}


def save_checkpoint(path, model, optimizer, step, dp_cp_group) -> None:
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    with workaround_nvrx_without_async_api():
        dist_checkpointing.save(_sharded(model, optimizer, step, False, dp_cp_group), path)
    dist.barrier()


def load_checkpoint(path, model, optimizer, dp_cp_group) -> dict:
    """Load model + optimizer; returns what the workarounds found and the step loaded."""
    from megatron.core import dist_checkpointing

    workaround_adam_state_before_load(optimizer)
    # iteration is a common (non-sharded) value: read it through the loaded dict
    sd = _sharded(model, optimizer, 0, True, dp_cp_group)
    state = dist_checkpointing.load(sd, path)
    model.module.load_state_dict(state["model"])
    with workaround_reshardable_load_without_no_grad():
        optimizer.load_state_dict(state["optimizer"])
    step = int(state["iteration"])
    found = workaround_adam_step_after_load(optimizer, step)
    return {"step": step, **found}


# --------------------------------------------------------------------------------------
# the training loop
# --------------------------------------------------------------------------------------


def _bcast_float(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t)


def train(rank: int, world: int, spec: RunSpec, device, ckpt_root: str, emulate: bool,
          tree_dir: Optional[str] = None) -> dict:
    """Run ``spec`` on this rank (process group of ``spec.world`` ranks initialised).

    Returns (every rank; rank 0's is the run's) ``{"spec", "steps": [{"step", "loss",
    "grad_norm", "valid_tokens", "finite"}], "paths": [per-step check_model_paths],
    "layout_checked", "workarounds", "loaded"}``. ``loss`` is the step's global mean token loss
    before the update; ``grad_norm`` the optimizer's (global, before clipping). ``tree_dir``:
    the tree ``spec.tree`` names; the GDN module must come from it (``imported_tree``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    assert world == spec.world, (world, spec.world)
    device = torch.device(device)
    stack = contextlib.ExitStack()
    if emulate:
        from fla_emulation import emulated_fla_in_megatron

        stack.enter_context(emulated_fla_in_megatron())
    if spec.dynamic_cp and (spec.tp, spec.dp, spec.layout) != (1, 1, "thd"):
        raise ValueError(f"{spec.name}: dynamic CP runs are TP=1, DP=1, THD; got TP={spec.tp}, "
                         f"DP={spec.dp}, {spec.layout}")
    dyn_kw = {"dynamic_context_parallel": True} if spec.dynamic_cp else {}
    with dynamic_cp_init_on_cpu(device, spec.dynamic_cp):
        ps.initialize_model_parallel(tensor_model_parallel_size=spec.tp,
                                     context_parallel_size=spec.cp, **dyn_kw)
    if device.type == "cuda":  # the RNG tracker recompute's checkpoint saves and restores
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    out = {"spec": asdict(spec), "steps": [], "paths": [], "workarounds": {}, "loaded": None,
           "imported": imported_tree(spec, tree_dir)}
    try:
        with stack:
            stack.enter_context(cuda_literals_on_cpu(device))
            coalesce = stack.enter_context(workaround_gloo_cuda_coalescing(device))
            out["workarounds"]["gloo_cuda_coalescing"] = coalesce
            out["workarounds"]["no_psutil"] = stack.enter_context(without_psutil())
            config, model, optimizer = build_model(spec, device)
            config.finalize_model_grads_func = finalize_model_grads
            dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
            cp_group = ps.get_context_parallel_group()
            cp_rank, dp_rank = ps.get_context_parallel_rank(), ps.get_data_parallel_rank()
            first = 1
            if spec.load:
                loaded = load_checkpoint(os.path.join(ckpt_root, spec.load), model, optimizer, dp_cp)
                out["loaded"] = loaded
                first = loaded["step"] + 1
            share = MICRO_BATCHES // spec.dp
            for step in range(first, first + spec.steps):
                idxs = list(range(dp_rank * share, (dp_rank + 1) * share))
                if spec.order == "reversed":
                    idxs.reverse()
                model.zero_grad_buffer()
                optimizer.zero_grad()
                loss_sum = torch.zeros((), dtype=torch.float64, device=device)
                tokens = torch.zeros((), dtype=torch.int64, device=device)
                if spec.dynamic_cp:  # (index, CP size, subgroup, rank in it), this rank's
                    work = [(i, n, ps.get_dynamic_data_context_parallel_groups(group_size=n), r)
                            for i, n, r in dynamic_assignments(cp_rank, spec.cp)]
                else:
                    work = [(i, spec.cp, None, cp_rank) for i in idxs]
                mb_paths = []
                with spy_model_paths(model.module) as step_spies, count_new_groups() as created:
                    for j, (i, size, group, rank_in) in enumerate(work):
                        mb = micro_batch(step, i, spec.layout)
                        idx = rank_indices(mb, size, rank_in, spec.tree)
                        psp = packed_seq_params(mb, device, cp_group=group,
                                                local_cp_size=size if group is not None else None)
                        mb_spies = (contextlib.nullcontext(step_spies) if not spec.dynamic_cp
                                    else spy_model_paths(model.module))
                        with mb_spies as spies, (model.no_sync() if j < len(work) - 1
                                                 else contextlib.nullcontext()):
                            per_tok = model(mb.tokens[idx][None].to(device),
                                            mb.position_ids[idx][None].to(device), None,
                                            labels=mb.labels[idx][None].to(device),
                                            packed_seq_params=psp)
                            m = mb.loss_mask[idx][None].to(device)
                            loss = (per_tok.float() * m).sum()
                            loss.backward()
                        if spec.dynamic_cp:  # the path of the subgroup size it ran on
                            mb_paths.append({"index": i, "cp": size,
                                             **check_model_paths(spies, spec, mb, cp=size)})
                        loss_sum += loss.detach().double()
                        tokens += int(m.sum())
                num_tokens = tokens.clone()
                if not _NO_OUT_NORM_WORKAROUND:
                    out["workarounds"]["gdn_out_norm_grad_over_tp"] = (
                        workaround_gdn_out_norm_grad_over_tp(model.module, spec))
                finalize_model_grads([model], num_tokens)  # all-reduces num_tokens over DP x CP
                ok, grad_norm, _ = optimizer.step()
                dist.all_reduce(loss_sum, group=dp_cp)
                rec = {"step": step, "loss": float(loss_sum) / int(num_tokens),
                       "grad_norm": float(grad_norm), "valid_tokens": int(num_tokens),
                       "update_successful": bool(ok)}
                rec["finite"] = math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"])
                out["steps"].append(rec)
                if spec.dynamic_cp:
                    path = {"passed": bool(mb_paths) and all(p["passed"] for p in mb_paths)
                            and not created, "micro_batches": mb_paths,
                            "new_group_calls": len(created)}
                else:
                    path = check_model_paths(step_spies, spec, mb)
                out["paths"].append(path)
                if spec.save_at == step:
                    save_checkpoint(os.path.join(ckpt_root, spec.save_name), model, optimizer,
                                    step, dp_cp)
            out["layout_checked"] = True
            out["cp_group_size"] = cp_group.size()
    finally:
        ps.destroy_model_parallel()
    return out


# --------------------------------------------------------------------------------------
# comparisons against the frozen gates (docs/training-tier-tests.md)
# --------------------------------------------------------------------------------------


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def band_for(bands: List[dict], k: int) -> dict:
    """The gate band of ``k`` steps since the last common state (1-based): the first band
    whose ``upto`` is >= k."""
    for b in bands:
        if k <= b["upto"]:
            return b
    return bands[-1]


def compare_runs(got: dict, ref: dict, bands: List[dict], start: int = 0) -> dict:
    """Step-by-step ``got`` vs ``ref`` over the steps both have (matched by step number).

    ``bands``: ``[{"upto": k, "loss_rel", "grad_norm_rel"}]``, relative per-step gates by
    ``k = step - start`` (steps since the common state: the weights at step 0, or the
    checkpoint a resume loaded). Also: equal valid-token counts at every step, every value
    finite, and every step's path check passed."""
    ref_by = {s["step"]: s for s in ref["steps"]}
    rows, problems = [], []
    for s in got["steps"]:
        r = ref_by.get(s["step"])
        if r is None:
            problems.append(f"step {s['step']} has no reference")
            continue
        gate = band_for(bands, s["step"] - start)
        row = {"step": s["step"], "loss": s["loss"], "ref_loss": r["loss"],
               "loss_rel": _rel(s["loss"], r["loss"]), "grad_norm": s["grad_norm"],
               "ref_grad_norm": r["grad_norm"], "grad_norm_rel": _rel(s["grad_norm"], r["grad_norm"]),
               "valid_tokens": s["valid_tokens"], "ref_valid_tokens": r["valid_tokens"],
               "gate_loss_rel": gate["loss_rel"], "gate_grad_norm_rel": gate["grad_norm_rel"]}
        rows.append(row)
        if not s["finite"]:
            problems.append(f"step {s['step']}: not finite")
        if s["valid_tokens"] != r["valid_tokens"]:
            problems.append(f"step {s['step']}: {s['valid_tokens']} valid tokens, reference {r['valid_tokens']}")
        if not row["loss_rel"] <= gate["loss_rel"]:
            problems.append(f"step {s['step']}: loss rel {row['loss_rel']:.2e} > {gate['loss_rel']:.0e}")
        if not row["grad_norm_rel"] <= gate["grad_norm_rel"]:
            problems.append(f"step {s['step']}: grad norm rel {row['grad_norm_rel']:.2e} > {gate['grad_norm_rel']:.0e}")
    bad_paths = [s["step"] for s, p in zip(got["steps"], got.get("paths", [])) if not p["passed"]]
    if bad_paths:
        problems.append(f"path check failed at steps {bad_paths}")
    if not rows:
        problems.append("no steps compared")
    return {"passed": not problems, "problems": problems, "rows": rows,
            "max_loss_rel": max((r["loss_rel"] for r in rows), default=None),
            "max_grad_norm_rel": max((r["grad_norm_rel"] for r in rows), default=None)}


def loss_fell(run: dict) -> bool:
    s = run["steps"]
    return len(s) >= 2 and s[-1]["loss"] < s[0]["loss"]
