"""FLA's GDN scan, forward and backward, at the image's head dims against the float64 oracle.

Every other GPU check compares FLA with FLA (CP against CP=1, old tree against new tree), so a
fault in a kernel that both sides run cancels out. This one compares
``chunk_gated_delta_rule`` without CP (the CP=1 and headwise path) with the eager float64
oracle of ``gdn_reference.gdn_chunked``: the output and all five input gradients (dq, dk,
dv, dg, dbeta) at the head dims of the benchmark and of Qwen3-Next (K = V = 128), on a
single sequence and on a packed batch, in the dtypes the layer feeds it (bf16 q/k/v/beta
with float32 g, and float32 throughout).

Why: FLA issue fla-org/flash-linear-attention#640 reports wrong dk/dg from
``chunk_bwd_kernel_dqkwg`` on Hopper with Triton 3.4 to 3.7.0 when its K block is 64 (FLA
0.4.1 picks 64 on Hopper; 0.4.2 picks 128), and the image runs Triton 3.6.0 on H200. The
kernel-matrix oracle (``kernel_matrix._oracle_check``) checks the forward only, at K = 32.

The oracle gets the very values FLA gets (bf16 inputs upcast exactly), so the figure is
FLA's own rounding and nothing else. Gates (normalized RMS, ``||fla - oracle|| / ||oracle||``):
2e-3 in float32 (the kernel matrix's GDN gate); 5e-2 in bf16, where FLA rounds its
intermediates to bf16 (its own tests allow up to 2e-2 on dg and dbeta); the fault above
gives 0.5-0.7 on dk.

Cases are spread over the ranks of the job (each rank runs its share alone; no collective
touches the checked tensors). With ``gating="probe"`` (the old tree's FLA 0.4.1) records say
what they measured and pass, so the old image's figures are on record without gating the
patched one's run.
"""

from __future__ import annotations

import traceback
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

import gdn_harness as H

HEADS, HEAD_K, HEAD_V = 4, 128, 128
GATE = {torch.float32: 2e-3, torch.bfloat16: 5e-2}
# name -> (dtype of q, k, v, beta; global cu_seqlens)
CASES = {
    "bf16_single_T512": (torch.bfloat16, [0, 512]),
    "bf16_packed_130_190_192": (torch.bfloat16, [0, 130, 320, 512]),
    "fp32_single_T512": (torch.float32, [0, 512]),
    "fp32_packed_130_190_192": (torch.float32, [0, 130, 320, 512]),
}
GRADS = ("q", "k", "v", "g", "beta")


def case_ids():
    return [f"kernel/gdn/oracle_k{HEAD_K}_v{HEAD_V}/{name}" for name in CASES]


def _inputs(T: int, dtype, seed: int, device, heads: int = HEADS, head_k: int = HEAD_K, head_v: int = HEAD_V):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    x = {
        "q": r(1, T, heads, head_k),
        "k": F.normalize(r(1, T, heads, head_k), dim=-1),
        "v": r(1, T, heads, head_v),
        "g": F.logsigmoid(r(1, T, heads) + 2.0),
        "beta": torch.sigmoid(r(1, T, heads)),
        "G": r(1, T, heads, head_v),
    }
    # FLA takes g in float32 whatever the other dtypes (as GatedDeltaNet hands it over).
    return {n: t.to(device=device, dtype=torch.float32 if n == "g" else dtype) for n, t in x.items()}


def _fla(chunk_gated_delta_rule, x, cu):
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in GRADS}
    o, _ = chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], g=leaves["g"],
                                  beta=leaves["beta"], cu_seqlens=cu)
    (o.float() * x["G"].float()).sum().backward()
    return {"out": o.detach(), **{f"d{n}": leaves[n].grad for n in GRADS}}


def _oracle(x, cu):
    import gdn_reference as O

    leaves = {n: x[n].detach().double().cpu().requires_grad_(True) for n in GRADS}
    o, _ = O.gdn_chunked(*(leaves[n] for n in GRADS), cu_seqlens=cu.cpu())
    (o * x["G"].double().cpu()).sum().backward()
    return {"out": o.detach(), **{f"d{n}": leaves[n].grad for n in GRADS}}


def run_oracle(rank: int, world: int, device, *, chunk_gated_delta_rule=None,
               gating: str = "gate", select: Optional[Callable[[str], bool]] = None,
               log: Callable[[str], None] = lambda s: None) -> List[dict]:
    """This rank's share of :data:`CASES` (case i runs on rank i % world): one record each,
    ``{"id", "kind": "kernel_oracle", "rank", "gating", "dtype", "cu_seqlens", "checks":
    {out, dq, dk, dv, dg, dbeta: compare_nrms}, "passed"}``; an exception becomes a failed
    record with its message (a passed note under ``gating="probe"``)."""
    if chunk_gated_delta_rule is None:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    select = select or (lambda rid: True)
    records = []
    for i, (rid, (name, (dtype, cu_list))) in enumerate(zip(case_ids(), CASES.items())):
        if i % world != rank or not select(rid):
            continue
        log(f"[rank {rank}] {rid}")
        rec = {"id": rid, "kind": "kernel_oracle", "rank": rank, "gating": gating,
               "dtype": str(dtype).replace("torch.", ""), "cu_seqlens": cu_list,
               "heads": HEADS, "head_k": HEAD_K, "head_v": HEAD_V}
        try:
            cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
            x = _inputs(cu_list[-1], dtype, seed=700 + i, device=device)
            got, want = _fla(chunk_gated_delta_rule, x, cu), _oracle(x, cu)
            rec["checks"] = {n: H.compare_nrms(got[n], want[n], GATE[dtype]) for n in want}
            rec["matched"] = H.all_passed(rec["checks"])
            rec["error"] = None
        except Exception as exc:  # noqa: BLE001 - recorded, the job goes on
            rec.update(checks={}, matched=False, error=f"{type(exc).__name__}: {exc}"[:600],
                       traceback=traceback.format_exc()[-2000:])
        if gating == "probe":
            worst = max((c.get("nrms") or 0.0 for c in rec["checks"].values()), default=None)
            rec["passed"] = True
            rec["note"] = "probe only, not gated: " + (
                f"matched the oracle (worst nrms {worst:.2e})" if rec["matched"] else
                f"did NOT match the oracle ({rec['error'] or f'worst nrms {worst:.3g}'})")
        else:
            rec["passed"] = rec["matched"]
        records.append(rec)
    return records


def check_case(chunk_gated_delta_rule, *, dtype, cu_list, head_k: int, head_v: int, heads: int = HEADS,
               seed: int = 700, device="cuda", packed: bool = True) -> dict:
    """One oracle comparison at any head dims (the FLA-set sweep, ``tests/image/gpu/fla_sweep.py``).

    ``dtype``: of q, k, v, beta (g stays float32); ``cu_list``: global ``cu_seqlens``, passed to
    FLA only when ``packed`` (else one sequence of ``cu_list[-1]`` tokens, no ``cu_seqlens``).
    Returns ``{"checks": {out, dq, dk, dv, dg, dbeta: compare_nrms at GATE[dtype]}, "matched",
    "error"}``; an exception (FLA refusing the combination, say) is returned as ``error``.
    """
    try:
        cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
        x = _inputs(cu_list[-1], dtype, seed=seed, device=device, heads=heads, head_k=head_k, head_v=head_v)
        got = _fla(chunk_gated_delta_rule, x, cu if packed else None)
        want = _oracle(x, cu)
        checks = {n: H.compare_nrms(got[n], want[n], GATE[dtype]) for n in want}
        return {"checks": checks, "matched": H.all_passed(checks), "error": None}
    except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
        return {"checks": {}, "matched": False, "error": f"{type(exc).__name__}: {exc}"[:600],
                "traceback": traceback.format_exc()[-2000:]}
