"""Build and run Megatron's GatedDeltaNet under CP, and compare against CP=1 (any tree).

Shared by the CPU tests (gloo, FLA replaced by ``fla_emulation``) and the GPU scripts
(NCCL, real FLA). Everything here imports ``megatron`` lazily, from whatever tree is first
on ``sys.path``; nothing is copied from either tree.

Shapes: hidden states are SBHD ``[s, b, hidden]`` (THD: ``[t, 1, hidden]``), float32 unless
a geometry says otherwise. Weights are set by parameter name from seeded CPU generators, so
two builds (CP=1 vs CP>1, base vs patched tree) get identical weights.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_layout_ref import zigzag_rank_indices

MODES = ("headwise", "chunkwise", "all_gather")

# Frozen numerical gates (the project's design notes; docs/gpu.md "Gates").
GATE_CP = {"atol": 2e-3, "rtol": 1e-2, "cos_min": 0.9999}
GATE_OLD_NEW = {"atol": 2e-4, "rtol": 2e-3, "cos_min": 0.99999}


@dataclass(frozen=True)
class Geometry:
    hidden: int
    k_heads: int
    v_heads: int
    dk: int
    dv: int
    conv: int = 4


GEOMETRIES = {
    # GQA (2 value heads per key head) and key dim != value dim in one layer
    "gqa_dk32_dv64": Geometry(hidden=128, k_heads=4, v_heads=8, dk=32, dv=64),
    # 2 key / 6 value heads: headwise needs heads % CP == 0, so it is illegal at CP=4
    "headwise_illegal_at_cp4": Geometry(hidden=128, k_heads=2, v_heads=6, dk=64, dv=64),
}


def headwise_legal(geom: Geometry, cp: int, tp: int = 1) -> bool:
    return geom.k_heads % (tp * cp) == 0 and geom.v_heads % (tp * cp) == 0


@dataclass(frozen=True)
class Case:
    """A global input: SBHD of ``length`` tokens (batch 1), or packed THD.

    ``cu_padded``: global cumulative lengths used for the layout (each a multiple of 2*CP);
    ``valid``: valid tokens at the start of each packed sequence (the rest is padding).
    """

    name: str
    length: int
    cu_padded: Optional[Sequence[int]] = None
    valid: Optional[Sequence[int]] = None

    @property
    def thd(self) -> bool:
        return self.cu_padded is not None

    def seq_lens(self) -> List[int]:
        if not self.thd:
            return [self.length]
        return [b - a for a, b in zip(self.cu_padded[:-1], self.cu_padded[1:])]

    def valid_mask(self) -> torch.Tensor:
        m = torch.zeros(self.length, dtype=torch.bool)
        if not self.thd:
            m[:] = True
            return m
        for a, n in zip(self.cu_padded[:-1], self.valid):
            m[a : a + n] = True
        return m


CASES = {
    "sbhd": Case("sbhd", 256),
    "thd_single": Case("thd_single", 256, [0, 256], [256]),
    "thd_unequal": Case("thd_unequal", 256, [0, 64, 200, 256], [64, 136, 56]),
    # per-sample padding: actual lengths 61/130/50 padded to multiples of 8
    "thd_padding": Case("thd_padding", 256, [0, 64, 200, 256], [61, 130, 50]),
    # padding tail: the end padding is a dummy last sequence without valid tokens
    "thd_padding_tail": Case("thd_padding_tail", 256, [0, 120, 192, 256], [120, 72, 0]),
}


# --------------------------------------------------------------------------------------
# building
# --------------------------------------------------------------------------------------


def make_config(geom: Geometry, *, cp: int, mode: Optional[str], tp: int = 1,
                dtype=torch.float32, cpu_init: bool = False, **extra):
    """TransformerConfig for one GDN layer; ``mode=None`` leaves ``linear_cp_mode`` unset
    (the base tree has no such field)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=1,
        hidden_size=geom.hidden,
        num_attention_heads=4,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=1,
        linear_conv_kernel_dim=geom.conv,
        linear_key_head_dim=geom.dk,
        linear_value_head_dim=geom.dv,
        linear_num_key_heads=geom.k_heads,
        linear_num_value_heads=geom.v_heads,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=cpu_init,
        perform_initialization=False,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        activation_func=F.silu,
    )
    if mode is not None:
        kw["linear_cp_mode"] = mode
    kw.update(extra)
    return TransformerConfig(**kw)


def make_pg(tp_group, cp_group):
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg = ProcessGroupCollection()
    pg.tp = tp_group
    pg.cp = cp_group
    return pg


def build_gdn(config, pg, via_spec: bool = False):
    """GatedDeltaNet with tensor-parallel linears and a torch norm (no transformer_engine).

    ``via_spec``: go through ``get_gated_delta_net_module_spec`` with the local backend,
    whose missing fused layernorm-linear is supplied as a plain ColumnParallelLinear.
    """
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not via_spec:
        sub = GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear
        )
        return GatedDeltaNet(config, sub, layer_number=1, pg_collection=pg)

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec,
    )
    from megatron.core.transformer.spec_utils import build_module

    class LocalWithoutTE(LocalSpecProvider):
        def column_parallel_layer_norm_linear(self):
            return ColumnParallelLinear

    spec = get_gated_delta_net_module_spec(config, backend=LocalWithoutTE())
    return build_module(spec, config=config, layer_number=1, pg_collection=pg)


def tp_shard_layout(module: torch.nn.Module, tp_size: int) -> Dict[str, tuple]:
    """How each tensor-parallel parameter of ``module`` is cut from its TP=1 tensor.

    Returns ``{parameter name: (dim, sections)}`` for every parameter marked
    ``tensor_model_parallel``: ``dim`` its ``partition_dim`` (0 for column-parallel linears,
    the vocab-parallel embedding, GDN's conv1d / A_log / dt_bias; 1 for row-parallel linears),
    ``sections`` the full (TP=1) sizes of the consecutive blocks along ``dim`` that are split
    over TP one by one; a TP rank's shard is its ``1/tp_size`` of every block, concatenated.
    One block unless the module's forward splits its local tensor into parts:

    * ``GatedDeltaNet.in_proj``: ``[q, k, v, z, beta, alpha]`` =
      ``[qk_dim, qk_dim, v_dim, v_dim, num_value_heads, num_value_heads]`` (the forward splits
      the local output by ``qk_dim_local_tp``, ... ``num_value_heads // tp_size``),
    * ``GatedDeltaNet.conv1d``: ``[q, k, v]`` = ``[qk_dim, qk_dim, v_dim]`` channels,
    * a gated MLP's ``linear_fc1``: ``[gate, up]`` = ``[ffn_hidden_size] * 2`` (``glu``
      chunks the local output in two).

    Parameters without the mark (norms) are replicated: absent from the result.
    """
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.mlp import MLP

    blocks: Dict[str, List[int]] = {}
    for mname, m in module.named_modules():
        pre = f"{mname}." if mname else ""
        if isinstance(m, GatedDeltaNet):
            qk, v, nv = m.qk_dim, m.v_dim, m.num_value_heads
            for leaf in ("in_proj.weight", "in_proj.bias"):
                blocks[pre + leaf] = [qk, qk, v, v, nv, nv]
            for leaf in ("conv1d.weight", "conv1d.bias"):
                blocks[pre + leaf] = [qk, qk, v]
        elif isinstance(m, MLP) and m.config.gated_linear_unit:
            for leaf in ("linear_fc1.weight", "linear_fc1.bias"):
                blocks[pre + leaf] = [m.config.ffn_hidden_size] * 2
    out = {}
    for name, p in module.named_parameters():
        if not getattr(p, "tensor_model_parallel", False):
            continue
        dim = int(getattr(p, "partition_dim", 0))
        full = int(p.shape[dim]) * tp_size
        sections = blocks.get(name, [full])
        if sum(sections) != full or any(n % tp_size for n in sections):
            raise ValueError(f"tp_shard_layout: {name} has {p.shape[dim]} rows along dim {dim} at "
                             f"TP={tp_size}; blocks {sections} (full {full}) do not split evenly")
        out[name] = (dim, sections)
    return out


def tp_shard(full: torch.Tensor, dim: int, sections: Sequence[int], tp_rank: int,
             tp_size: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s part of the TP=1 tensor ``full``: its ``1/tp_size`` of each block
    of ``sections`` along ``dim``, concatenated (any dtype; a new tensor)."""
    parts = []
    for blk in torch.split(full, list(sections), dim=dim):
        parts.append(torch.chunk(blk, tp_size, dim=dim)[tp_rank])
    return torch.cat(parts, dim=dim)


def set_weights(module: torch.nn.Module, seed: int = 1234, tp_rank: int = 0,
                tp_size: int = 1) -> None:
    """Fill every parameter from a generator seeded by (seed, parameter name).

    The value is drawn for the parameter's TP=1 shape (float64, CPU) and, at ``tp_size > 1``,
    cut to TP rank ``tp_rank``'s shard (:func:`tp_shard_layout`, :func:`tp_shard`): every TP
    rank holds its part of the very weights a TP=1 build gets; replicated parameters are the
    same on every rank.
    """
    layout = tp_shard_layout(module, tp_size) if tp_size > 1 else {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            shape = list(p.shape)
            if name in layout:
                dim, sections = layout[name]
                shape[dim] = sum(sections)
            shape = tuple(shape)
            rn = lambda: torch.randn(shape, generator=gen, dtype=torch.float64)  # noqa: E731
            if name.endswith("A_log"):
                val = torch.log(torch.empty(shape, dtype=torch.float64).uniform_(1, 16, generator=gen))
            elif name.endswith("dt_bias"):
                val = 0.5 * rn()
            elif "norm" in name:
                val = 1.0 + 0.1 * rn()
            elif name.endswith("conv1d.weight"):
                val = rn() / math.sqrt(shape[-1])
            elif name.endswith("weight") and len(shape) == 2:
                val = rn() / math.sqrt(shape[1])
            else:
                val = 0.1 * rn()
            if name in layout:
                val = tp_shard(val, layout[name][0], layout[name][1], tp_rank, tp_size)
            if tuple(val.shape) != tuple(p.shape):
                raise ValueError(f"set_weights: {name} is {tuple(p.shape)} on TP rank {tp_rank}, "
                                 f"its shard of the TP=1 value is {tuple(val.shape)}")
            p.copy_(val.to(dtype=p.dtype, device=p.device))


# --------------------------------------------------------------------------------------
# inputs and sharding
# --------------------------------------------------------------------------------------


def global_inputs(case: Case, hidden: int, seed: int, dtype=torch.float32):
    """``x`` ``[T, 1, hidden]`` and upstream gradient ``G`` (zero on padding), CPU."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(case.length, 1, hidden, generator=gen, dtype=torch.float64)
    G = torch.randn(case.length, 1, hidden, generator=gen, dtype=torch.float64)
    G = G * case.valid_mask().to(G.dtype)[:, None, None]
    return x.to(dtype), G.to(dtype)


def shard_index(case: Case, cp: int, rank: int) -> torch.Tensor:
    return torch.tensor(zigzag_rank_indices(case.seq_lens(), cp, rank), dtype=torch.long)


def packed_seq_params(case: Case, device, cp_group=None, local_cp_size=None):
    if not case.thd:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_pad = torch.tensor(case.cu_padded, dtype=torch.int32, device=device)
    actual = [0]
    for n in case.valid:
        actual.append(actual[-1] + n)
    cu = torch.tensor(actual, dtype=torch.int32, device=device)
    kw = {}
    if cp_group is not None:
        kw = {"cp_group": cp_group, "local_cp_size": local_cp_size}
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_pad,
        cu_seqlens_kv_padded=cu_pad,
        max_seqlen_q=max(case.seq_lens()),
        max_seqlen_kv=max(case.seq_lens()),
        **kw,
    )


def run_layer(module, x_local, G_local, psp, recompute_wrapper=None):
    """Forward + backward of ``sum(out * G)``. Returns out, dx and a dict of param grads."""
    module.zero_grad(set_to_none=True)
    x = x_local.detach().clone().requires_grad_(True)

    def fwd(inp):
        out, _bias = module(inp, None, packed_seq_params=psp)
        return out

    out = recompute_wrapper(fwd, x) if recompute_wrapper is not None else fwd(x)
    (out.float() * G_local.float()).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    missing = sorted(n for n, p in module.named_parameters() if p.grad is None)
    return {"out": out.detach(), "dx": x.grad.detach(), "grads": grads, "missing_grads": missing}


def reduce_grads(grads: Dict[str, torch.Tensor], group) -> Dict[str, torch.Tensor]:
    """Sum parameter grads over the CP group (what the DP x CP gradient reduction does)."""
    out = {}
    for n, g in grads.items():
        g = g.clone()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(g, group=group)
        out[n] = g
    return out


# --------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------


def compare(got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float, cos_min: float,
            rel_l2_max: float = 0.1) -> dict:
    """Compare ``got`` to ``ref`` (any shape, any float dtype; computed in float64 on CPU).

    Gate (``passed``), the frozen one (docs/gpu.md "Gates"): every value finite, every
    element within ``atol + rtol*|ref|``, AND cosine >= ``cos_min``. It is strict on purpose:
    a CP bug that corrupts a few tokens (a lost conv halo, a wrong state at one rank edge)
    moves single elements far past the bound while the cosine stays above 0.9999.

    ``upstream_rule_passed`` (reported, never gated): the rule of the upstream test these
    numbers come from (``_test_parallel_attention_correctness`` in
    ``tests/unit_tests/transformer/test_attention.py`` at 5139086e, which upstream applies to
    the output and input gradient only): allclose, else cosine >= ``cos_min`` and relative L2
    <= ``rel_l2_max``. ``allclose``, ``worst_bound_ratio`` (max of ``|got-ref| / (atol +
    rtol*|ref|)``), ``cosine`` and ``nrms`` (relative L2) are the figures behind both.
    """
    g = got.detach().double().cpu().reshape(-1)
    r = ref.detach().double().cpu().reshape(-1)
    rec = {"shape_ok": tuple(got.shape) == tuple(ref.shape), "numel": int(r.numel())}
    if not rec["shape_ok"] or r.numel() == 0:
        rec.update(got_shape=list(got.shape), ref_shape=list(ref.shape),
                   passed=rec["shape_ok"], upstream_rule_passed=rec["shape_ok"])
        return rec
    d = (g - r).abs()
    bound = atol + rtol * r.abs()
    denom = g.norm() * r.norm()
    cos = float((g @ r) / denom) if denom > 0 else (1.0 if float(d.max()) == 0 else 0.0)
    rms_ref = float(r.pow(2).mean().sqrt())
    rec.update(
        finite=bool(torch.isfinite(g).all()),
        max_abs_err=float(d.max()),
        max_ref_abs=float(r.abs().max()),
        worst_bound_ratio=float((d / bound).max()),
        cosine=cos,
        nrms=float((g - r).pow(2).mean().sqrt()) / rms_ref if rms_ref > 0 else float(d.max()),
        atol=atol,
        rtol=rtol,
        cos_min=cos_min,
        rel_l2_max=rel_l2_max,
    )
    rec["allclose"] = bool(rec["worst_bound_ratio"] <= 1.0)
    rec["passed"] = bool(rec["finite"] and rec["allclose"] and cos >= cos_min)
    rec["upstream_rule_passed"] = bool(rec["finite"] and (
        rec["allclose"] or (cos >= cos_min and rec["nrms"] <= rel_l2_max)))
    return rec


def compare_nrms(got: torch.Tensor, ref: torch.Tensor, limit: float) -> dict:
    """Normalized RMS ``||got-ref|| / ||ref||`` (kernel-level gate)."""
    g = got.detach().double().cpu().reshape(-1)
    r = ref.detach().double().cpu().reshape(-1)
    rec = {"shape_ok": tuple(got.shape) == tuple(ref.shape), "numel": int(r.numel())}
    if not rec["shape_ok"]:
        rec.update(got_shape=list(got.shape), ref_shape=list(ref.shape), passed=False)
        return rec
    nr = float(r.norm())
    nrms = float((g - r).norm()) / nr if nr > 0 else float((g - r).abs().max())
    rec.update(finite=bool(torch.isfinite(g).all()), nrms=nrms, limit=limit,
               max_abs_err=float((g - r).abs().max()) if r.numel() else 0.0)
    rec["passed"] = bool(rec["finite"] and nrms < limit)
    return rec


# --------------------------------------------------------------------------------------
# fail-fast detector
# --------------------------------------------------------------------------------------

COLLECTIVES = (
    "all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor",
    "_all_gather_base", "all_gather_object", "all_reduce", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "broadcast_object_list",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "gather", "scatter",
    "new_group",
)


class CollectiveCalled(RuntimeError):
    pass


@contextlib.contextmanager
def collective_bomb():
    """Replace every collective entry point of ``torch.distributed`` (and ``distributed_c10d``)
    by one that records its name and raises :class:`CollectiveCalled`; yields the names."""
    import torch.distributed.distributed_c10d as c10d

    called = []

    def make(name):
        def bomb(*a, **k):
            called.append(name)
            raise CollectiveCalled(f"collective {name} ran before the check")

        return bomb

    with contextlib.ExitStack() as stack:
        for name in COLLECTIVES:
            for mod in (dist, c10d):
                if hasattr(mod, name):
                    stack.enter_context(mock.patch.object(mod, name, make(name)))
        yield called


class ComputeStarted(RuntimeError):
    pass


def _compute_bomb(*args, **kwargs):
    raise ComputeStarted("the input projection ran before the check")


def attempt(fn, module=None) -> dict:
    """Run ``fn()`` with :func:`collective_bomb` armed.

    ``module``: a GatedDeltaNet whose ``in_proj`` must not run either (raises
    ``ComputeStarted``): a missing check on a huge input must not reach the projection.

    Returns ``{"raised": "LinearCPError" | <other exception type> | None, "message",
    "collectives": [names the bomb recorded]}``.
    """
    from megatron.core.ssm.gdn_context_parallel import LinearCPError

    with contextlib.ExitStack() as stack:
        if module is not None:
            stack.enter_context(mock.patch.object(module.in_proj, "forward", _compute_bomb))
        called = stack.enter_context(collective_bomb())
        try:
            fn()
        except LinearCPError as exc:
            return {"raised": "LinearCPError", "message": str(exc), "collectives": list(called)}
        except Exception as exc:  # noqa: BLE001 - reported, asserted by the caller
            return {"raised": type(exc).__name__, "message": str(exc)[:400],
                    "collectives": list(called)}
    return {"raised": None, "message": "", "collectives": list(called)}


# --------------------------------------------------------------------------------------
# path spies
# --------------------------------------------------------------------------------------

SPIED = {
    "headwise": ("gdn.tensor_a2a_cp2hp", "gdn.tensor_a2a_hp2cp"),
    "chunkwise": ("gdn.zigzag_to_contiguous_chunks", "gdn.contiguous_to_zigzag_chunks",
                  "gdn.build_cp_context"),
    # packed THD: both conversions go through one host-routed ThdLayoutRoutes per micro-batch
    # (no device sync), never through upstream's cu_seqlens conversion; FLA's CP context comes
    # from the micro-batch's PackedSeqMetadata (``meta.``: its methods), built once there
    "chunkwise_thd": ("gcp.ThdLayoutRoutes", "meta.fla_cp_context"),
    "all_gather": ("gcp.gather_zigzag_sequence", "gcp.scatter_zigzag_sequence"),
}


@dataclass
class PathSpy:
    """Counts calls of each mode's contract names and what conv / the scan were given."""

    counts: Dict[str, int] = field(default_factory=dict)
    conv_calls: List[dict] = field(default_factory=list)
    rule_calls: List[dict] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "counts": dict(self.counts),
            "conv": self.conv_calls,
            "rule": self.rule_calls,
        }


@contextlib.contextmanager
def spy_paths(module):
    """Wrap (never replace) the contract's per-mode names; yields a :class:`PathSpy`."""
    import megatron.core.ssm.gated_delta_net as gdn

    try:
        import megatron.core.ssm.gdn_context_parallel as gcp
    except ImportError:  # base tree
        gcp = None
    spy = PathSpy()
    mods = {"gdn": gdn, "gcp": gcp, "meta": getattr(gcp, "PackedSeqMetadata", None)}
    with contextlib.ExitStack() as stack:
        for names in SPIED.values():
            for qual in names:
                prefix, attr = qual.split(".")
                mod = mods[prefix]
                spy.counts[qual] = 0
                if mod is None or not hasattr(mod, attr):
                    spy.counts[qual] = -1  # absent in this tree
                    continue
                orig = getattr(mod, attr)

                def wrapper(*a, __orig=orig, __q=qual, **k):
                    spy.counts[__q] += 1
                    return __orig(*a, **k)

                stack.enter_context(mock.patch.object(mod, attr, wrapper))

        conv_orig = gdn.causal_conv1d

        def conv_wrapper(*a, **k):
            x = k.get("x", a[0] if a else None)
            spy.conv_calls.append({"tokens": int(x.shape[1]),
                                   "cp_context": k.get("cp_context") is not None})
            return conv_orig(*a, **k)

        stack.enter_context(mock.patch.object(gdn, "causal_conv1d", conv_wrapper))
        rule_orig = module.gated_delta_rule

        def rule_wrapper(q, *a, **k):
            spy.rule_calls.append({"tokens": int(q.shape[1]), "heads": int(q.shape[2]),
                                   "cp_context": k.get("cp_context") is not None})
            return rule_orig(q, *a, **k)

        stack.enter_context(mock.patch.object(module, "gated_delta_rule", rule_wrapper))
        yield spy


def expected_path(mode: str, cp: int, geom: Geometry, case: Case) -> dict:
    """What the spies must see for ``mode`` at CP size ``cp``."""
    active = mode if cp > 1 else None
    spied = SPIED["chunkwise_thd" if active == "chunkwise" and case.thd else active] if active else ()
    counts = {q: q in spied for names in SPIED.values() for q in names}
    tokens = case.length // cp if active == "chunkwise" else case.length
    heads = geom.v_heads // cp if active == "headwise" else geom.v_heads
    return {"called": counts, "cp_context": active == "chunkwise", "tokens": tokens, "heads": heads}


def check_path(spy: PathSpy, expect: dict) -> dict:
    problems = []
    for q, should in expect["called"].items():
        n = spy.counts.get(q, 0)
        if should and n <= 0:
            problems.append(f"{q} not called")
        if not should and n > 0:
            problems.append(f"{q} called {n}x")
    for kind, calls in (("conv", spy.conv_calls), ("rule", spy.rule_calls)):
        if not calls:
            problems.append(f"{kind} never called")
        for c in calls:
            if c["cp_context"] != expect["cp_context"]:
                problems.append(f"{kind} cp_context={'given' if c['cp_context'] else 'absent'}")
            if c["tokens"] != expect["tokens"]:
                problems.append(f"{kind} saw {c['tokens']} tokens, expected {expect['tokens']}")
    for c in spy.rule_calls:
        if c["heads"] != expect["heads"]:
            problems.append(f"rule saw {c['heads']} heads, expected {expect['heads']}")
    return {"passed": not problems, "problems": problems, "seen": spy.summary()}


# --------------------------------------------------------------------------------------
# one comparison: a CP run against the CP=1 reference
# --------------------------------------------------------------------------------------


def compare_to_reference(res: dict, ref: dict, idx: torch.Tensor, group, gate: dict) -> dict:
    """Per-rank checks of output, input grad (this rank's zigzag tokens) and every param grad
    (summed over the CP group)."""
    checks = {
        "output": compare(res["out"], ref["out"][idx], **gate),
        "input_grad": compare(res["dx"], ref["dx"][idx], **gate),
    }
    grads = reduce_grads(res["grads"], group)
    for name in sorted(set(ref["grads"]) | set(grads)):
        if name not in grads or name not in ref["grads"]:
            checks[f"grad:{name}"] = {"passed": False, "missing": True}
            continue
        checks[f"grad:{name}"] = compare(grads[name], ref["grads"][name], **gate)
    checks["no_missing_grads"] = {"passed": not res["missing_grads"], "missing": res["missing_grads"]}
    return checks


def to_device(d: dict, device) -> dict:
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in d.items()}


def all_passed(checks: Dict[str, Any]) -> bool:
    return all(bool(c.get("passed")) for c in checks.values())
