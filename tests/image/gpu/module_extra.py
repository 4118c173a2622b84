"""Module-level GPU checks beyond ``module_matrix`` (issue 13), in a world of 4 ranks.

Record ids (one record per id and rank, same fields as ``module_matrix``):

* ``tp2cp2/{nosp,sp}/{sbhd,thd_unequal}/{mode}`` (kind ``tp_cp_vs_ref``): TP=2 x CP=2,
  TP innermost (TP groups ``[0,1] [2,3]``, CP groups ``[0,2] [1,3]``), with and without
  sequence parallelism, against the TP=1 CP=1 layer with the same weights (each TP rank gets
  its slice of every TP-sharded parameter, section by section as
  ``GatedDeltaNet.sharded_state_dict`` splits them). Compared per rank at the CP gate: the
  output and input gradient of the rank's tokens (zigzag shard of its CP rank; under SP the
  TP rank's half of it), every TP-sharded parameter gradient summed over the CP group against
  the reference's slice, and every TP-replicated one (``out_norm.weight``: each TP rank sees
  only its heads) summed over TP and CP against the whole reference gradient.
* ``gqa_dk32_dv64_conv2/...`` (kinds of ``module_matrix``): the gqa geometry with conv width 2,
  SBHD and unequal THD, CP 1/2/4, every mode, run by ``module_matrix.run_matrix`` itself.
* ``dynamic_cp/thd_len70_on_cp1/{mode}`` (kind ``dynamic_cp``): a layer built for CP=4 takes a
  micro-batch on a CP=1 group (``PackedSeqParams.cp_group``/``local_cp_size=1``) of 70 tokens
  (sequences 30 + 40: neither the total nor either sequence is divisible by 4 or 8). It must be
  accepted, since the length rule uses the group in use, and match the CP=1 layer at the CP=1
  gate; no process group may be created.
* ``empty_segments/{f32,bf16}_T{256,4096}/{start,middle,end}/cp{1,2,4}/{mode}`` (kind
  ``empty_segments``, issue 12 at real size): the same packed batch (H=4, K=V=64, hidden
  256) with one zero-length segment added to ``cu_seqlens`` (and its padded twin) at the start,
  in the middle or at the end, against the batch without it, same mode, CP size and weights.
  Output, input gradient and every parameter gradient (summed over the CP group in float32)
  at the old-vs-new gate (atol 2e-4, rtol 2e-3, cosine >= 0.99999, all finite). The token
  shards are the same with and without the empty segment (it holds no token).

Everything imports Megatron lazily from the tree first on ``sys.path``; ``emulate=True`` swaps
FLA for the CPU stand-ins (a dry run of the plumbing; the stand-ins do not have FLA's
empty-segment fault).
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from typing import Callable, Dict, List, Optional
from unittest import mock

import torch
import torch.distributed as dist

import gdn_harness as H
import module_matrix as MM

GQA = H.GEOMETRIES["gqa_dk32_dv64"]
CONV2_NAME = "gqa_dk32_dv64_conv2"
CONV2 = dataclasses.replace(GQA, conv=2)
EMPTY_GEOM = H.Geometry(hidden=256, k_heads=4, v_heads=4, dk=64, dv=64)
# base packed batches (cu_seqlens), every sequence divisible by 2*4
EMPTY_SIZES = {"T256": [0, 64, 200, 256], "T4096": [0, 1024, 2816, 4096]}
EMPTY_POSITIONS = ("start", "middle", "end")
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
ODD_CASE = H.Case("thd_len70", 70, [0, 30, 70], [30, 40])
TP_CASES = ("sbhd", "thd_unequal")


def with_empty_segment(cu: List[int], where: str) -> List[int]:
    """``cu`` with one repeated boundary: before the first sequence, after the first one,
    or after the last one."""
    if where == "start":
        return [0] + list(cu)
    if where == "middle":
        return list(cu[:2]) + list(cu[1:])
    if where == "end":
        return list(cu) + [cu[-1]]
    raise ValueError(f"unknown position {where!r}")


def tp_sections(geom: H.Geometry) -> Dict[str, tuple]:
    """Per TP-sharded parameter: (section sizes of the full tensor, dim). Each section is split
    over TP separately (``GatedDeltaNet.sharded_state_dict`` at the patched tree)."""
    qk, v, nv = geom.k_heads * geom.dk, geom.v_heads * geom.dv, geom.v_heads
    return {"in_proj.weight": ([qk, qk, v, v, nv, nv], 0), "in_proj.bias": ([qk, qk, v, v, nv, nv], 0),
            "conv1d.weight": ([qk, qk, v], 0), "conv1d.bias": ([qk, qk, v], 0),
            "A_log": ([nv], 0), "dt_bias": ([nv], 0), "out_proj.weight": ([v], 1)}


def tp_slice(name: str, full: torch.Tensor, geom: H.Geometry, tp: int, tp_rank: int):
    """TP rank ``tp_rank``'s part of parameter (or gradient) ``full``; None if replicated."""
    spec = tp_sections(geom).get(name)
    if spec is None:
        return None
    secs, dim = spec
    parts = [p.chunk(tp, dim=dim)[tp_rank] for p in torch.split(full, secs, dim=dim)]
    return torch.cat(parts, dim=dim)


class ExtraGroups:
    """Every rank creates every group in the same order. TP x CP and the CP=4 group need a
    world that is a multiple of 4 (else ``quad``, ``tp`` and ``cp_of_tp`` are None)."""

    def __init__(self, world: int):
        rank = dist.get_rank()
        self.single = [dist.new_group([r]) for r in range(world)][rank]
        quads = [list(range(4 * q, 4 * q + 4)) for q in range(world // 4)]
        self.quad = [dist.new_group(q) for q in quads][rank // 4] if quads else None
        pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
        self.pair = pairs[rank // 2] if pairs else None
        # TP x CP inside each quad: TP innermost ([4q, 4q+1], [4q+2, 4q+3]) = the pairs above;
        # CP across ([4q, 4q+2], [4q+1, 4q+3]).
        strided = [dist.new_group([4 * q + t, 4 * q + 2 + t]) for q in range(world // 4) for t in (0, 1)]
        self.tp = self.pair if quads else None
        self.cp_of_tp = strided[2 * (rank // 4) + rank % 2] if quads else None
        self.tp_rank = rank % 2
        self.cp_rank_of_tp = (rank % 4) // 2

    def cp(self, size: int):
        return {1: self.single, 2: self.pair, 4: self.quad}[size]


def _sum_f32(t: torch.Tensor, group) -> torch.Tensor:
    t = t.float().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def run_extra(rank: int, world: int, device, *, emulate: bool = False,
              select: Optional[Callable[[str], bool]] = None,
              log: Callable[[str], None] = lambda s: None,
              records: Optional[List[dict]] = None) -> List[dict]:
    """Run the checks whose ids ``select`` accepts; append records to ``records``."""
    device = torch.device(device)
    select = select or (lambda rid: True)
    records = [] if records is None else records
    if world % 2:
        raise ValueError(f"module_extra needs an even world (4 for TP x CP and dynamic CP), got "
                         f"{world}; hint: GDN_SUITE_NPROC=4 (ranks may share GPUs)")

    # Conv width 2: module_matrix's own loop, over a geometry table holding only what it needs.
    conv2_sel = lambda rid: rid.startswith(CONV2_NAME + "/") and select(rid)  # noqa: E731
    if any(conv2_sel(f"{CONV2_NAME}/{c}/cp{p}/{m}") for c in TP_CASES for p in (1, 2, 4)
           for m in H.MODES):
        with mock.patch.dict(H.GEOMETRIES, {"gqa_dk32_dv64": GQA, CONV2_NAME: CONV2}, clear=True):
            MM.run_matrix(rank, world, device, emulate=emulate, select=conv2_sel, log=log,
                          records=records)

    stack = contextlib.ExitStack()
    if emulate:
        from fla_emulation import emulated_fla_in_megatron

        stack.enter_context(emulated_fla_in_megatron())
    groups = ExtraGroups(world)
    cpu_init = device.type == "cpu"
    refs: Dict[tuple, tuple] = {}

    def guarded(rid, kind, fn):
        if not select(rid):
            return
        log(f"[rank {rank}] {rid}")
        try:
            recs = fn()
        except Exception as exc:  # noqa: BLE001 - recorded; ranks fail symmetrically here
            recs = [MM._record(rid, kind, rank, False, error=repr(exc)[:2000],
                               traceback=traceback.format_exc()[-4000:])]
        if not MM._all_agree(all(r["passed"] for r in recs), device):
            for r in recs:
                r.setdefault("note", "another rank failed this item")
        records.extend(recs)

    def build(geom, cp, mode, tp_group, cp_group, dtype=torch.float32, **extra):
        tp = dist.get_world_size(tp_group)
        cfg = H.make_config(geom, cp=cp, tp=tp, mode=mode, dtype=dtype, cpu_init=cpu_init, **extra)
        if cfg.sequence_parallel:
            return _build_gdn_sp(cfg, H.make_pg(tp_group, cp_group)).to(device)
        return H.build_gdn(cfg, H.make_pg(tp_group, cp_group)).to(device)

    def reference(geom, case, dtype=torch.float32):
        key = (geom, case.name, dtype)
        if key not in refs:
            x, G = H.global_inputs(case, geom.hidden, seed=11, dtype=dtype)
            m = build(geom, 1, "headwise", groups.single, groups.single, dtype)
            H.set_weights(m)
            res = H.run_layer(m, x.to(device), G.to(device), H.packed_seq_params(case, device))
            full = {n: p.detach().clone() for n, p in m.named_parameters()}
            refs[key] = (x.to(device), G.to(device), res, full)
        return refs[key]

    with stack:
        # ---- TP=2 x CP=2, with and without sequence parallelism -------------------------
        if groups.quad is None:  # a world of 2: neither TP x CP nor dynamic CP fits
            select_four = select
            select = lambda rid: select_four(rid) and rid.startswith("empty_segments/")  # noqa: E731
        if any(select(f"tp2cp2/{s}/{c}/{m}") for s in ("nosp", "sp") for c in TP_CASES
               for m in H.MODES):
            _ensure_memory_buffer()
        for sp in (False, True):
            for cname in TP_CASES:
                case = H.CASES[cname]
                for mode in H.MODES:
                    rid = f"tp2cp2/{'sp' if sp else 'nosp'}/{cname}/{mode}"

                    def tp_cp(mode=mode, case=case, sp=sp, rid=rid):
                        x, G, ref, full = reference(GQA, case)
                        tr, P = groups.tp_rank, 2
                        idx = H.shard_index(case, P, groups.cp_rank_of_tp).to(device)
                        xl, Gl = x[idx], G[idx]
                        keep = torch.arange(idx.numel(), device=device)
                        if sp:
                            keep = keep.chunk(2)[tr]
                        m = build(GQA, P, mode, groups.tp, groups.cp_of_tp, sequence_parallel=sp)
                        with torch.no_grad():
                            for n, p in m.named_parameters():
                                part = tp_slice(n, full[n], GQA, 2, tr)
                                p.copy_(full[n] if part is None else part)
                        with H.spy_paths(m) as spy:
                            res = H.run_layer(m, xl[keep], Gl[keep], H.packed_seq_params(case, device))
                        checks = {"output": H.compare(res["out"], ref["out"][idx][keep], **H.GATE_CP),
                                  "input_grad": H.compare(res["dx"], ref["dx"][idx][keep], **H.GATE_CP)}
                        for n in sorted(set(ref["grads"]) | set(res["grads"])):
                            if n not in res["grads"] or n not in ref["grads"]:
                                checks[f"grad:{n}"] = {"passed": False, "missing": True}
                                continue
                            got = _sum_f32(res["grads"][n], groups.cp_of_tp)
                            want = tp_slice(n, ref["grads"][n], GQA, 2, tr)
                            if want is None:  # TP-replicated: each TP rank holds a partial sum
                                got, want = _sum_f32(got, groups.tp), ref["grads"][n]
                            checks[f"grad:{n}"] = H.compare(got, want, **H.GATE_CP)
                        checks["no_missing_grads"] = {"passed": not res["missing_grads"],
                                                      "missing": res["missing_grads"]}
                        expect = H.expected_path(mode, P, GQA, case)
                        expect["heads"] //= 2  # TP=2 halves the heads on every path
                        path = H.check_path(spy, expect)
                        return [MM._record(rid, "tp_cp_vs_ref", rank,
                                           path["passed"] and H.all_passed(checks), checks=checks,
                                           path=path, tp=2, cp=P, sequence_parallel=sp)]

                    guarded(rid, "tp_cp_vs_ref", tp_cp)

        # ---- dynamic CP: a CP=1 micro-batch of 70 tokens in a CP=4 world -----------------
        for mode in H.MODES:
            rid = f"dynamic_cp/thd_len70_on_cp1/{mode}"

            def dyn_odd(mode=mode, rid=rid):
                x, G, ref, _ = reference(GQA, ODD_CASE)
                m = build(GQA, 4, mode, groups.single, groups.quad)
                H.set_weights(m)
                psp = H.packed_seq_params(ODD_CASE, device, cp_group=groups.single, local_cp_size=1)
                with MM._no_new_groups() as created, H.spy_paths(m) as spy:
                    res = H.run_layer(m, x, G, psp)
                idx = torch.arange(ODD_CASE.length, device=device)
                checks = H.compare_to_reference(res, ref, idx, groups.single, H.GATE_OLD_NEW)
                checks["no_process_group_created"] = {"passed": not created,
                                                      "new_group_calls": len(created)}
                path = H.check_path(spy, H.expected_path(mode, 1, GQA, ODD_CASE))
                return [MM._record(rid, "dynamic_cp", rank, path["passed"] and H.all_passed(checks),
                                   checks=checks, path=path)]

            guarded(rid, "dynamic_cp", dyn_odd)

        # ---- empty segments in cu_seqlens (issue 12) at real size --------------------------
        layers: Dict[tuple, torch.nn.Module] = {}
        bases: Dict[tuple, dict] = {}
        # T=256 in both dtypes first: a run cut short still covers every mode and CP size
        for sname, cu in EMPTY_SIZES.items():
            for dname, dtype in DTYPES.items():
                base_case = H.Case(f"{sname}_base", cu[-1], cu, [b - a for a, b in zip(cu[:-1], cu[1:])])
                x, G = H.global_inputs(base_case, EMPTY_GEOM.hidden, seed=23, dtype=dtype)
                x, G = x.to(device), G.to(device)
                for P in (1, 2, 4):
                    if P > world:
                        continue
                    group = groups.cp(P)
                    idx = H.shard_index(base_case, P, dist.get_rank(group)).to(device)
                    for where in EMPTY_POSITIONS:
                        for mode in H.MODES:
                            rid = f"empty_segments/{dname}_{sname}/{where}/cp{P}/{mode}"

                            def empty(dname=dname, dtype=dtype, sname=sname, cu=cu, P=P, group=group,
                                      idx=idx, where=where, mode=mode, base_case=base_case, x=x, G=G):
                                lkey = (dname, P, mode)
                                if lkey not in layers:
                                    layers[lkey] = build(EMPTY_GEOM, P, mode, groups.single, group, dtype)
                                    H.set_weights(layers[lkey])
                                m = layers[lkey]
                                bkey = (dname, sname, P, mode)
                                if bkey not in bases:
                                    bases[bkey] = H.run_layer(m, x[idx], G[idx],
                                                              H.packed_seq_params(base_case, device))
                                base = bases[bkey]
                                cu_e = with_empty_segment(cu, where)
                                case = H.Case(f"{sname}_{where}", cu[-1], cu_e,
                                              [b - a for a, b in zip(cu_e[:-1], cu_e[1:])])
                                res = H.run_layer(m, x[idx], G[idx], H.packed_seq_params(case, device))
                                checks = {"output": H.compare(res["out"], base["out"], **H.GATE_OLD_NEW),
                                          "input_grad": H.compare(res["dx"], base["dx"], **H.GATE_OLD_NEW)}
                                for n in sorted(base["grads"]):
                                    if n not in res["grads"]:
                                        checks[f"grad:{n}"] = {"passed": False, "missing": True}
                                        continue
                                    checks[f"grad:{n}"] = H.compare(_sum_f32(res["grads"][n], group),
                                                                    _sum_f32(base["grads"][n], group),
                                                                    **H.GATE_OLD_NEW)
                                return [MM._record(rid, "empty_segments", rank, H.all_passed(checks),
                                                   checks=checks, cu_seqlens=cu_e, base_cu_seqlens=cu,
                                                   dtype=dname, issue=12)]

                            guarded(rid, "empty_segments", empty)
    return records


class _TorchRMSNorm:
    """``out_norm`` for the SP builds: torch's RMSNorm over one head (``value_head_dim``).

    ``WrappedTorchNorm`` refuses ``sequence_parallel`` (it cannot mark its weight for the SP
    gradient all-reduce, which TE's norm does); GDN's out_norm sees the whole sequence of the
    rank's TP heads, after in_proj's SP all-gather, so the refusal does not apply to it. Its
    gradient is checked like the no-SP one: summed over TP and CP against the reference.
    """

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        assert config.normalization == "RMSNorm", config.normalization
        return torch.nn.RMSNorm(hidden_size, eps=eps)


def _build_gdn_sp(config, pg):
    """``gdn_harness.build_gdn`` with :class:`_TorchRMSNorm` as out_norm (sequence parallel)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    sub = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=_TorchRMSNorm,
                                  out_proj=RowParallelLinear)
    return GatedDeltaNet(config, sub, layer_number=1, pg_collection=pg)


def _ensure_memory_buffer():
    """Megatron's sequence-parallel linears gather into ``parallel_state``'s global buffer,
    which ``initialize_model_parallel`` would create; the suite builds its own groups."""
    from megatron.core import parallel_state as ps

    if getattr(ps, "_GLOBAL_MEMORY_BUFFER", None) is None:
        ps._set_global_memory_buffer()
