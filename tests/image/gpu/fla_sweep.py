"""The float64 kernel oracle across head dims, for one FLA set (FLA issue #640; ``tools/gpu-fla-sweep``).

``chunk_gated_delta_rule`` without CP against ``gdn_reference``'s eager float64 oracle
(``kernel_oracle.check_case``): the output and every input gradient (dq, dk, dv, dg, dbeta),
for each key/value head-dim pair of ``--dims`` (``D`` means K = V = D, ``KxV`` a pair), in
float32 and bf16 (g in float32), on one sequence (no ``cu_seqlens``) and on a packed batch.
Gates: ``kernel_oracle.GATE`` (normalized RMS 2e-3 float32, 5e-2 bf16; the #640 fault gives
0.5-0.7 on dk). Shapes are small (4 heads, T = 256) so that compilation, not the kernels,
sets the time; each case runs in its own process (``--procs`` at a time, all on GPU 0) with
the suite's autotune policy (``autotune_policy``: first config that runs). With
``TRITON_INTERPRET=1 GDN_FLA_SWEEP_DEVICE=cpu`` the same cases run on CPU under Triton's
interpreter (``fla_interpret``'s shims), a dry run of the harness with tiny ``--dims`` (the
interpreter's bf16 is not FLA's: only its float32 figures mean anything there).

    python tests/image/gpu/fla_sweep.py --out DIR [--dims "32 64 100 128 256 64x128"] [--procs N]

Writes ``DIR/fla-sweep-<fla digits>.json`` (host, versions, one record per case) and ``.md``
(one table; each case's log stays in ``$GDN_FLA_SWEEP_WORK/logs``, default /tmp/gdn-fla-sweep). Exit 0 when every case matched the oracle, 1 when one did not or raised (FLA's own
refusal, e.g. #640's RuntimeError, is recorded as ``refused``), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
IMAGE = HERE.parent
T = 256
PACKED = [0, 100, 256]
DTYPES = ("float32", "bfloat16")
GRADS = ("out", "dq", "dk", "dv", "dg", "dbeta")


def parse_dims(text: str) -> list:
    """``"32 64x128"`` -> ``[(32, 32), (64, 128)]``; raises ``ValueError`` on anything else."""
    out = []
    for item in text.split():
        k, _, v = item.partition("x")
        out.append((int(k), int(v or k)))
    if not out:
        raise ValueError("no head dims given")
    return out


def case_list(dims, layouts=("single", "packed")) -> list:
    """One case per (K x V, dtype, layout); ``layouts``: of ``single`` (no cu_seqlens) and ``packed``."""
    bad = [x for x in layouts if x not in ("single", "packed")]
    if bad or not layouts:
        raise ValueError(f"layouts {list(layouts)}: each must be 'single' or 'packed'")
    return [{"id": f"k{k}_v{v}/{dt}/{layout}", "head_k": k, "head_v": v, "dtype": dt, "packed": layout == "packed"}
            for k, v in dims for dt in DTYPES for layout in layouts]


def run_one(case: dict) -> dict:
    """In a child process: one case on GPU 0."""
    sys.path[:0] = [str(IMAGE), str(HERE)]
    import torch

    import kernel_oracle

    device = os.environ.get("GDN_FLA_SWEEP_DEVICE", "cuda:0")
    if os.environ.get("TRITON_INTERPRET") == "1":  # CPU dry run of the harness (slow; small --dims)
        import fla_interpret

        fla_interpret.install()
    else:
        import autotune_policy

        autotune_policy.install()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    t0 = time.time()
    cu = PACKED if case["packed"] else [0, T]
    res = kernel_oracle.check_case(chunk_gated_delta_rule, dtype=getattr(torch, case["dtype"]), cu_list=cu,
                                   head_k=case["head_k"], head_v=case["head_v"], packed=case["packed"],
                                   device=device)
    res["seconds"] = round(time.time() - t0, 1)
    return res


def _child(case: dict, timeout: float, log_dir: Path) -> dict:
    t0 = time.time()
    log = log_dir / (case["id"].replace("/", "_") + ".log")
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)], capture_output=True,
                              text=True, timeout=timeout)
        log.write_text(proc.stdout + proc.stderr)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        res = json.loads(line[-1][7:]) if line else {
            "checks": {}, "matched": False, "error": f"child exited {proc.returncode}: {proc.stderr[-600:]}"}
    except subprocess.TimeoutExpired:
        res = {"checks": {}, "matched": False, "error": f"timed out after {timeout:.0f} s"}
    res["wall_s"] = round(time.time() - t0, 1)
    err = res.get("error") or ""
    res["verdict"] = ("matched" if res["matched"] else
                      "refused" if "#640" in err or "Triton >= 3.4.0 and < 3.7.1" in err else
                      "error" if err else "MISMATCH")
    return {**case, **res}


def host_info() -> dict:
    import torch
    import triton

    import fla

    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().splitlines()
    except OSError:
        smi = []
    cap = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None
    if os.environ.get("TRITON_INTERPRET") == "1":
        smi = ["CPU, Triton interpreter (dry run of the harness; not GPU figures)"]
    return {"gpus": smi, "capability": list(cap) if cap else None, "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__, "fla": fla.__version__,
            "python": sys.version.split()[0], "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT"),
            "autotune": os.environ.get("GDN_SUITE_AUTOTUNE", "first"),
            "tilelang": __import__("importlib.util").util.find_spec("tilelang") is not None,
            "flash_qla": __import__("importlib.util").util.find_spec("flash_qla") is not None}


def markdown(summary: dict) -> str:
    h = summary["host"]
    lines = [f"# FLA {h['fla']} + triton {h['triton']}: kernel oracle across head dims",
             "",
             f"Covers `chunk_gated_delta_rule` (no CP) against the float64 oracle on {', '.join(h['gpus']) or 'no GPU'} "
             f"({'sm' + ''.join(map(str, h['capability'])) if h['capability'] else 'no GPU'}), torch {h['torch']}, FLA {h['fla']}, triton {h['triton']}, "
             f"float32 dots {h['triton_f32_default']}, autotune {h['autotune']}; 4 heads, T = {T}, packed = {PACKED}; "
             f"normalized RMS, gates 2e-3 (float32) and 5e-2 (bf16). Date {summary['date']}.",
             "",
             "| K x V | dtype | layout | verdict | " + " | ".join(GRADS) + " | s |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in GRADS) + " | --- |"]
    for r in summary["cases"]:
        cells = [f"{r['checks'][g]['nrms']:.2e}" if g in r.get("checks", {}) and r["checks"][g].get("nrms") is not None
                 else "-" for g in GRADS]
        lines.append(f"| {r['head_k']} x {r['head_v']} | {r['dtype']} | {'packed' if r['packed'] else 'single'} | "
                     f"{r['verdict']} | " + " | ".join(cells) + f" | {r['wall_s']} |")
    errs = [r for r in summary["cases"] if r.get("error")]
    if errs:
        lines += ["", "Errors:"] + [f"- `{r['id']}`: {r['error'][:300]}" for r in errs]
    c = summary["counts"]
    lines += ["", f"{c['matched']} of {c['cases']} cases matched the oracle; {c['refused']} refused by FLA, "
                  f"{c['mismatch']} mismatched, {c['error']} errors; {summary['wall_s']} s."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for fla-sweep-<set>.json and .md")
    ap.add_argument("--dims", default=os.environ.get("GDN_FLA_SWEEP_DIMS", "32 64 100 128 256 64x128"))
    ap.add_argument("--layouts", default=os.environ.get("GDN_FLA_SWEEP_LAYOUTS", "single packed"))
    ap.add_argument("--procs", type=int, default=int(os.environ.get("GDN_FLA_SWEEP_PROCS", "0")) or None)
    ap.add_argument("--timeout", type=float, default=float(os.environ.get("GDN_FLA_SWEEP_TIMEOUT", "400")),
                    help="seconds per case process")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_one(json.loads(args.child))), flush=True)
        return 0
    if not args.out:
        ap.error("--out is required")
    try:
        cases = case_list(parse_dims(args.dims), tuple(args.layouts.split()))
    except ValueError as exc:
        print(f"fla_sweep: --dims {args.dims!r} --layouts {args.layouts!r}: {exc}\n"
              "hint: e.g. --dims \"32 64 100 128 256 64x128\" --layouts \"single packed\"", file=sys.stderr)
        return 2
    out = Path(args.out)
    logs = Path(os.environ.get("GDN_FLA_SWEEP_WORK", "/tmp/gdn-fla-sweep")) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    host = host_info()
    # one wave: compilation is CPU-bound, the kernels tiny (each process holds a CUDA context)
    procs = args.procs or min(len(cases), 2 * (os.cpu_count() or 4), 32)
    t0 = time.time()
    with ThreadPoolExecutor(procs) as pool:
        results = list(pool.map(lambda c: _child(c, args.timeout, logs), cases))
    counts = {"cases": len(results)}
    for v in ("matched", "refused", "mismatch", "error"):
        counts[v] = sum(r["verdict"].lower() == v for r in results)
    summary = {"what": "FLA chunk_gated_delta_rule vs the float64 oracle across head dims (FLA issue #640)",
               "date": time.strftime("%Y-%m-%d", time.gmtime()), "host": host, "counts": counts,
               "wall_s": round(time.time() - t0, 1), "procs": procs, "T": T, "packed": PACKED, "cases": results}
    name = f"fla-sweep-{host['fla'].replace('.', '')}"
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    (out / f"{name}.md").write_text(markdown(summary))
    print(markdown(summary))
    return 0 if counts["matched"] == counts["cases"] else 1


if __name__ == "__main__":
    sys.exit(main())
