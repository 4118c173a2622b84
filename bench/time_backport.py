#!/usr/bin/env python3
"""Time tools/backport cold (fresh cache) and warm (same cache), N runs each.

Writes results/pipeline/backport-timings.json. Uses the local mirrors.
"""
import json, os, platform, re, shutil, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the CLI's "time" row: total and per-step seconds (backport.engine.build timings)
TIME_ROW = re.compile(r"time\W+([\d.]+) s \((\w+): sources ([\d.]+), tree ([\d.]+), "
                      r"recipe ([\d.]+), verify ([\d.]+)(?:, write [\d.]+)?\)")
MLM = "/work/.mirror/NVIDIA+Megatron-LM/repo"
BRIDGE = "/work/.mirror/NVIDIA-NeMo+Megatron-Bridge/repo"


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    py = os.path.join(ROOT, ".venv/bin/python")
    if not os.path.exists(py):
        py = "/tmp/venv/bin/python"
    runs = {"cold": [], "warm": []}
    logs = []
    for i in range(n):
        cache = tempfile.mkdtemp(prefix="bp-cache-")
        for phase in ("cold", "warm"):
            out = tempfile.mkdtemp(prefix="bp-out-")
            cmd = [py, os.path.join(ROOT, "tools/backport"), "--megatron-lm", MLM,
                   "--megatron-bridge", BRIDGE, "--cache-dir", cache, "--out", out,
                   "--python", py]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            dt = time.perf_counter() - t0
            m = TIME_ROW.search(p.stdout)
            steps = (dict(zip(("engine_total", "sources", "tree", "recipe", "verify"),
                              (float(m.group(k)) for k in (1, 3, 4, 5, 6)))) if m else None)
            runs[phase].append({"run": i, "seconds": round(dt, 3), "rc": p.returncode,
                                "engine_cache": m.group(2) if m else None, "steps_s": steps})
            logs.append(f"[{phase} {i}] rc={p.returncode} {dt:.1f}s\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
            shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    summ = {}
    for ph, rs in runs.items():
        s = [r["seconds"] for r in rs]
        summ[ph] = {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s)}
        steps = [r["steps_s"] for r in rs if r["steps_s"]]
        if steps:
            summ[ph]["median_steps_s"] = {k: statistics.median(st[k] for st in steps) for k in steps[0]}
    res = {
        "command": "tools/backport --megatron-lm <local mirror> --megatron-bridge <local mirror> "
                   "--cache-dir <fresh tmp per cold run, reused for warm> --out <fresh tmp>",
        "python": py, "host": platform.node(), "cpu_count": os.cpu_count(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": runs, "summary": summ,
        "note": "cold = empty cache dir (clones from local mirrors); warm = second run on the same cache. "
                "seconds = wall time of the whole command (interpreter start included); steps_s = the "
                "engine's own split (verify = patch apply on the pristine tree, determinism rebuild, "
                "byte-compile and the import check in a fresh interpreter).",
    }
    os.makedirs(os.path.join(ROOT, "results/pipeline"), exist_ok=True)
    with open(os.path.join(ROOT, "results/pipeline/backport-timings.json"), "w") as f:
        json.dump(res, f, indent=2)
    print("\n".join(logs)[-6000:])
    print(json.dumps(summ, indent=2))


if __name__ == "__main__":
    main()
