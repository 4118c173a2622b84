#!/usr/bin/env python3
"""Ratios, RFC gates and plots from bench/gdn_layer.py output (CPU, matplotlib).

    python bench/report.py results/bench/gdn_layer.json [--outdir results/bench]

Writes <outdir>/gdn_layer_summary.json and gdn_layer_time.png / gdn_layer_memory.png
(one line per mode, one panel per CP size). Configurations missing from the input are
reported as not measured, never filled in.
"""
import argparse
import json
import os

GATES = {
    "chunkwise_vs_all_gather": "throughput ratio >= 1.10 OR peak-memory ratio <= 0.90",
    "chunkwise_vs_headwise": "throughput ratio >= 0.95 AND peak-memory ratio <= 1.05",
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--outdir", default=None)
    a = ap.parse_args()
    outdir = a.outdir or os.path.dirname(os.path.abspath(a.json))
    d = json.load(open(a.json))
    runs = {(r["cp"], r["mode"], r["T"]): r for r in d["runs"]}
    cps = sorted({k[0] for k in runs} | {2, 4})
    seqs = sorted({k[2] for k in runs} | {8192, 16384, 32768, 65536})
    rows, missing = [], []
    for P in cps:
        for T in seqs:
            g = {m: runs.get((P, m, T)) for m in ("headwise", "all_gather", "chunkwise", "ideal")}
            for m, r in g.items():
                if r is None:
                    missing.append(f"P={P} {m} T={T}")
            c, ag, hw, idl = g["chunkwise"], g["all_gather"], g["headwise"], g["ideal"]
            row = {"cp": P, "T": T}

            def ratio(x, y, key):
                return round(x[key] / y[key], 4) if x and y else None
            row["chunkwise/all_gather throughput"] = ratio(c, ag, "tokens_per_s")
            row["chunkwise/all_gather peak_alloc"] = ratio(c, ag, "peak_alloc_mib")
            row["chunkwise/headwise throughput"] = ratio(c, hw, "tokens_per_s")
            row["chunkwise/headwise peak_alloc"] = ratio(c, hw, "peak_alloc_mib")
            row["chunkwise efficiency vs ideal"] = ratio(idl, c, "median_ms")
            for m in ("headwise", "all_gather", "chunkwise", "ideal"):
                row[f"{m} median_ms"] = g[m]["median_ms"] if g[m] else None
            t1, m1 = row["chunkwise/all_gather throughput"], row["chunkwise/all_gather peak_alloc"]
            row["gate chunkwise_vs_all_gather"] = (
                None if t1 is None else bool(t1 >= 1.10 or m1 <= 0.90))
            t2, m2 = row["chunkwise/headwise throughput"], row["chunkwise/headwise peak_alloc"]
            row["gate chunkwise_vs_headwise"] = (
                None if t2 is None else bool(t2 >= 0.95 and m2 <= 1.05))
            rows.append(row)
    summary = {"source": os.path.basename(a.json), "gates": GATES, "rows": rows,
               "not_measured": missing, "meta": d.get("meta", {})}
    with open(os.path.join(outdir, "gdn_layer_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for what, key, ylabel in (("time", "median_ms", "fwd+bwd median ms (max over ranks)"),
                              ("memory", "peak_alloc_mib", "peak allocated MiB (max over ranks)")):
        fig, axes = plt.subplots(1, len(cps), figsize=(6 * len(cps), 4.2), squeeze=False)
        for ax, P in zip(axes[0], cps):
            for m in ("headwise", "all_gather", "chunkwise", "ideal"):
                pts = sorted((T, runs[(P, m, T)][key]) for T in seqs if (P, m, T) in runs)
                if pts:
                    ax.plot([p[0] // 1024 for p in pts], [p[1] for p in pts], marker="o", label=m)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("global sequence length (K tokens)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"GatedDeltaNet layer, CP={P}, bf16, SBHD b=1")
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
            else:
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        fig.savefig(os.path.join(outdir, f"gdn_layer_{what}.png"), dpi=110)
        plt.close(fig)
    for r in rows:
        print(r)
    print("not measured:", len(missing))


if __name__ == "__main__":
    main()
