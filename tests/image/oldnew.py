"""Old vs new: base tree + FLA 0.4.1 against patched tree + FLA 0.4.2, same weights/inputs.

``dump(...)`` runs inside a 4-rank world of one tree and returns, per rank, the layer's
output, input gradient and parameter gradients (summed over the CP group) for CP=1 and for
headwise CP=2 / CP=4 on SBHD and packed THD inputs (``gdn_harness.CASES``, geometry
``gqa_dk32_dv64``, float32). The base tree has no ``linear_cp_mode``; its only CP path is
headwise, which the patched tree runs by default and is told explicitly here.
``compare(old, new)`` applies the frozen gate (atol 2e-4, rtol 2e-3, cosine >= 0.99999)
rank by rank. Each tree runs in its own processes (both are named ``megatron``).
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

import gdn_harness as H

CASE_NAMES = ("sbhd", "thd_unequal", "thd_padding")


def dump(rank: int, world: int, device, *, patched: bool, emulate: bool = False) -> Dict[str, dict]:
    import contextlib

    device = torch.device(device)
    stack = contextlib.ExitStack()
    if emulate:
        from fla_emulation import emulated_fla_in_megatron

        stack.enter_context(emulated_fla_in_megatron())
    singles = [dist.new_group([r]) for r in range(world)]
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
    groups = {1: singles[rank], 2: pairs[rank // 2], 4: dist.group.WORLD}
    geom = H.GEOMETRIES["gqa_dk32_dv64"]
    out: Dict[str, dict] = {}
    with stack:
        for cname in CASE_NAMES:
            case = H.CASES[cname]
            x, G = H.global_inputs(case, geom.hidden, seed=11)
            for P in (1, 2, 4):
                if P > world:
                    continue
                group = groups[P]
                idx = H.shard_index(case, P, dist.get_rank(group))
                cfg = H.make_config(geom, cp=P, mode="headwise" if patched else None,
                                    cpu_init=device.type == "cpu")
                m = H.build_gdn(cfg, H.make_pg(singles[rank], group)).to(device)
                H.set_weights(m)
                res = H.run_layer(m, x[idx].to(device), G[idx].to(device),
                                  H.packed_seq_params(case, device))
                out[f"{cname}/cp{P}"] = {
                    "out": res["out"].cpu(),
                    "dx": res["dx"].cpu(),
                    "grads": {n: g.cpu() for n, g in H.reduce_grads(res["grads"], group).items()},
                }
    return out


def compare(old: List[Dict[str, dict]], new: List[Dict[str, dict]]) -> List[dict]:
    records = []
    for rank, (o_r, n_r) in enumerate(zip(old, new)):
        for key in sorted(set(o_r) | set(n_r)):
            rid = f"old_vs_new/{key}"
            if key not in o_r or key not in n_r:
                records.append({"id": rid, "kind": "old_vs_new", "rank": rank, "passed": False,
                                "error": "missing on one side"})
                continue
            o, n = o_r[key], n_r[key]
            checks = {"output": H.compare(n["out"], o["out"], **H.GATE_OLD_NEW),
                      "input_grad": H.compare(n["dx"], o["dx"], **H.GATE_OLD_NEW)}
            for name in sorted(set(o["grads"]) | set(n["grads"])):
                if name not in o["grads"] or name not in n["grads"]:
                    checks[f"grad:{name}"] = {"passed": False, "missing": True}
                    continue
                checks[f"grad:{name}"] = H.compare(n["grads"][name], o["grads"][name],
                                                   **H.GATE_OLD_NEW)
            records.append({"id": rid, "kind": "old_vs_new", "rank": rank,
                            "passed": H.all_passed(checks), "checks": checks})
    return records
