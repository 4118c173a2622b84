"""The module-level regression matrix: full GatedDeltaNet, CP=1 vs CP=2/4, every mode.

``run_matrix(rank, world, device)`` runs inside an initialised process group of 4 ranks
(NCCL on GPUs via ``gpu/run_module.py``; gloo on CPU with ``emulate=True``, which swaps
FLA for ``fla_emulation``) and returns a list of JSON-able records, one per check and
rank::

    {"id": "gqa_dk32_dv64/thd_unequal/cp4/chunkwise", "kind": "cp_vs_ref", "rank": 2,
     "passed": true, "checks": {"output": {...}, "input_grad": {...}, "grad:A_log": {...}},
     "path": {"passed": true, "problems": [], "seen": {...}}}

Groups (every rank creates every group, same order): CP=1 (one per rank), CP=2
(``[0,1]``, ``[2,3]``) and CP=4 (``[0..3]``). The CP=1 reference is computed on every rank
for each (geometry, case); a CP>1 rank compares its zigzag tokens of the output and input
gradient, and every parameter gradient summed over its CP group, against it.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Callable, List, Optional
from unittest import mock

import torch
import torch.distributed as dist

import gdn_harness as H


class Groups:
    def __init__(self, world: int):
        rank = dist.get_rank()
        self.world = world
        singles = [dist.new_group([r]) for r in range(world)]
        self.single = singles[rank]
        self.pair = None
        self.quad = None
        if world >= 2:
            pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
            self.pair = pairs[rank // 2]
        if world >= 4:
            self.quad = dist.new_group(list(range(4))) if world == 4 else None

    def cp(self, size: int):
        return {1: self.single, 2: self.pair, 4: self.quad}[size]


def _record(rid, kind, rank, passed, **kw):
    return {"id": rid, "kind": kind, "rank": rank, "passed": bool(passed), **kw}


def _all_agree(flag: bool, device) -> bool:
    t = torch.tensor([0 if flag else 1], device=device, dtype=torch.int32)
    dist.all_reduce(t)
    return int(t.item()) == 0


def _checkpoint_wrapper(device):
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        return lambda fn, x: tensor_parallel.checkpoint(fn, False, x)
    from torch.utils.checkpoint import checkpoint

    return lambda fn, x: checkpoint(fn, x, use_reentrant=False)


@contextlib.contextmanager
def _no_new_groups():
    """Count torch.distributed.new_group calls (dynamic CP must create none)."""
    calls = []
    orig = dist.new_group

    def spy(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    with mock.patch.object(dist, "new_group", spy), mock.patch(
        "torch.distributed.distributed_c10d.new_group", spy
    ):
        yield calls


def run_matrix(
    rank: int,
    world: int,
    device,
    *,
    emulate: bool = False,
    select: Optional[Callable[[str], bool]] = None,
    log: Callable[[str], None] = lambda s: None,
    patched: bool = True,
    records: Optional[List[dict]] = None,
) -> List[dict]:
    device = torch.device(device)
    select = select or (lambda rid: True)
    stack = contextlib.ExitStack()
    if emulate:
        from fla_emulation import emulated_fla_in_megatron

        stack.enter_context(emulated_fla_in_megatron())
    groups = Groups(world)
    cpu_init = device.type == "cpu"
    records = [] if records is None else records
    refs = {}

    def build(geom, cp, mode, cp_group, via_spec=False, **extra):
        cfg = H.make_config(geom, cp=cp, mode=mode, cpu_init=cpu_init, **extra)
        m = H.build_gdn(cfg, H.make_pg(groups.single, cp_group), via_spec=via_spec).to(device)
        H.set_weights(m)
        return m

    def guarded(rid, kind, fn):
        if not select(rid):
            return
        log(f"[rank {rank}] {rid}")
        try:
            recs = fn()
        except Exception as exc:  # record and continue; ranks fail symmetrically here
            recs = [_record(rid, kind, rank, False, error=repr(exc),
                            traceback=traceback.format_exc()[-4000:])]
        ok = all(r["passed"] for r in recs)
        if not _all_agree(ok, device):
            for r in recs:
                r.setdefault("note", "another rank failed this item")
        records.extend(recs)

    def reference(gname, geom, case):
        key = (gname, case.name)
        if key not in refs:
            x, G = H.global_inputs(case, geom.hidden, seed=11)
            m = build(geom, 1, "headwise" if patched else None, groups.single)
            with H.spy_paths(m) as spy:
                res = H.run_layer(m, x.to(device), G.to(device), H.packed_seq_params(case, device))
            refs[key] = (x.to(device), G.to(device), res, spy)
        return refs[key]

    with stack:
        for gname, geom in H.GEOMETRIES.items():
            case_names = list(H.CASES) if gname == "gqa_dk32_dv64" else ["sbhd", "thd_unequal"]
            for cname in case_names:
                case = H.CASES[cname]

                # CP=1: every mode takes none of the CP paths and gives the reference numbers.
                for mode in H.MODES:
                    rid = f"{gname}/{cname}/cp1/{mode}"

                    def cp1(mode=mode, rid=rid):
                        x, G, ref, spy0 = reference(gname, geom, case)
                        if mode == "headwise":
                            spy, res = spy0, ref
                        else:
                            m = build(geom, 1, mode, groups.single)
                            with H.spy_paths(m) as spy:
                                res = H.run_layer(m, x, G, H.packed_seq_params(case, device))
                        path = H.check_path(spy, H.expected_path(mode, 1, geom, case))
                        checks = H.compare_to_reference(
                            res, ref, torch.arange(case.length, device=device), groups.single,
                            H.GATE_OLD_NEW)
                        return [_record(rid, "cp1_path", rank, path["passed"] and H.all_passed(checks),
                                        checks=checks, path=path)]

                    guarded(rid, "cp1_path", cp1)

                for P in (2, 4):
                    if P > world:
                        continue
                    group = groups.cp(P)
                    for mode in H.MODES:
                        rid = f"{gname}/{cname}/cp{P}/{mode}"
                        if mode == "headwise" and not H.headwise_legal(geom, P):
                            guarded(rid, "expected_error",
                                    lambda geom=geom, P=P, rid=rid: [_headwise_illegal(rid, rank, geom, P)])
                            continue

                        def cp_run(mode=mode, P=P, group=group, rid=rid):
                            x, G, ref, _ = reference(gname, geom, case)
                            r = dist.get_rank(group)
                            idx = H.shard_index(case, P, r).to(device)
                            m = build(geom, P, mode, group)
                            with H.spy_paths(m) as spy:
                                res = H.run_layer(m, x[idx], G[idx],
                                                  H.packed_seq_params(case, device))
                            checks = H.compare_to_reference(res, ref, idx, group, H.GATE_CP)
                            checks["valid_tokens"] = _valid_tokens(case, idx, group, device)
                            path = H.check_path(spy, H.expected_path(mode, P, geom, case))
                            return [_record(rid, "cp_vs_ref", rank,
                                            path["passed"] and H.all_passed(checks),
                                            checks=checks, path=path)]

                        guarded(rid, "cp_vs_ref", cp_run)

        if not patched:
            return records

        geom, case = H.GEOMETRIES["gqa_dk32_dv64"], H.CASES["thd_unequal"]
        if world >= 4:
            # Dynamic CP: one module built for CP=4; micro-batches on CP 1/2/4 subgroups.
            for mode in H.MODES:
                rid = f"dynamic_cp/thd_unequal/{mode}"

                def dyn(mode=mode, rid=rid):
                    x, G, ref, _ = reference("gqa_dk32_dv64", geom, case)
                    m = build(geom, 4, mode, groups.quad)
                    recs = []
                    for size in (1, 2, 4):
                        group = groups.cp(size)
                        r = dist.get_rank(group)
                        idx = H.shard_index(case, size, r).to(device)
                        psp = H.packed_seq_params(case, device, cp_group=group, local_cp_size=size)
                        with _no_new_groups() as created, H.spy_paths(m) as spy:
                            res = H.run_layer(m, x[idx], G[idx], psp)
                        checks = H.compare_to_reference(res, ref, idx, group, H.GATE_CP)
                        checks["no_process_group_created"] = {"passed": not created,
                                                              "new_group_calls": len(created)}
                        path = H.check_path(spy, H.expected_path(mode, size, geom, case))
                        recs.append(_record(f"{rid}/cp{size}", "dynamic_cp", rank,
                                            path["passed"] and H.all_passed(checks),
                                            checks=checks, path=path))
                    return recs

                guarded(rid, "dynamic_cp", dyn)

            # Recompute: the tree's own GDN recompute (if it has one) and a full-layer
            # checkpoint around the layer, each against the same layer without recompute.
            for mode in H.MODES:
                rid = f"recompute/thd_unequal/cp4/{mode}"

                def recompute(mode=mode, rid=rid):
                    x, G, _, _ = reference("gqa_dk32_dv64", geom, case)
                    idx = H.shard_index(case, 4, dist.get_rank(groups.quad)).to(device)
                    psp = H.packed_seq_params(case, device)
                    plain = build(geom, 4, mode, groups.quad)
                    base = H.run_layer(plain, x[idx], G[idx], psp)
                    recs = []
                    ck = H.run_layer(plain, x[idx], G[idx], psp,
                                     recompute_wrapper=_checkpoint_wrapper(device))
                    checks = _compare_same_rank(ck, base)
                    recs.append(_record(f"{rid}/full_layer_checkpoint", "recompute", rank,
                                        H.all_passed(checks), checks=checks))
                    try:
                        m = build(geom, 4, mode, groups.quad, recompute_granularity="selective",
                                  recompute_modules=["gdn"])
                    except Exception as exc:  # noqa: BLE001 - the tree may not know "gdn"
                        recs.append(_record(f"{rid}/selective_gdn", "recompute_unsupported", rank,
                                            True, skipped=f"tree rejects recompute_modules=['gdn']: {exc!r}"))
                        return recs
                    has = bool(getattr(m, "recompute_gdn", False))
                    sel = H.run_layer(m, x[idx], G[idx], psp)
                    checks = _compare_same_rank(sel, base)
                    checks["module_recomputes"] = {"passed": has, "recompute_gdn": has}
                    recs.append(_record(f"{rid}/selective_gdn", "recompute", rank,
                                        H.all_passed(checks), checks=checks))
                    return recs

                guarded(rid, "recompute", recompute)

            # Build through the layer spec (local backend, no transformer_engine).
            rid = "spec_build/thd_unequal/cp4/chunkwise"

            def spec():
                x, G, ref, _ = reference("gqa_dk32_dv64", geom, case)
                idx = H.shard_index(case, 4, dist.get_rank(groups.quad)).to(device)
                m = build(geom, 4, "chunkwise", groups.quad, via_spec=True)
                explicit = build(geom, 4, "chunkwise", groups.quad)
                with H.spy_paths(m) as spy:
                    res = H.run_layer(m, x[idx], G[idx], H.packed_seq_params(case, device))
                checks = H.compare_to_reference(res, ref, idx, groups.quad, H.GATE_CP)
                names = sorted(n for n, _ in m.named_parameters())
                checks["same_parameters_as_explicit_build"] = {
                    "passed": names == sorted(n for n, _ in explicit.named_parameters()),
                    "names": names,
                }
                path = H.check_path(spy, H.expected_path("chunkwise", 4, geom, case))
                return [_record(rid, "spec_build", rank, path["passed"] and H.all_passed(checks),
                                checks=checks, path=path)]

            guarded(rid, "spec_build", spec)
    return records


def _compare_same_rank(got: dict, ref: dict) -> dict:
    checks = {"output": H.compare(got["out"], ref["out"], **H.GATE_OLD_NEW),
              "input_grad": H.compare(got["dx"], ref["dx"], **H.GATE_OLD_NEW)}
    for n in sorted(ref["grads"]):
        checks[f"grad:{n}"] = H.compare(got["grads"][n], ref["grads"][n], **H.GATE_OLD_NEW)
    return checks


def _valid_tokens(case, idx, group, device) -> dict:
    mask = case.valid_mask().to(device)[idx]
    local = torch.tensor([int(mask.sum())], device=device, dtype=torch.int64)
    total = local.clone()
    dist.all_reduce(total, group=group)
    expected = int(case.valid_mask().sum())
    return {"passed": int(total) == expected, "local": int(local), "group_total": int(total),
            "expected": expected}


def _headwise_illegal(rid, rank, geom, P):
    """A headwise config whose heads do not split over CP must fail at construction and name
    the two legal modes."""
    try:
        H.make_config(geom, cp=P, mode="headwise")
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        ok = "chunkwise" in msg and "all_gather" in msg
        return _record(rid, "expected_error", rank, ok, error_type=type(exc).__name__,
                       message=msg[:500])
    return _record(rid, "expected_error", rank, False, error="no error for an illegal geometry")
