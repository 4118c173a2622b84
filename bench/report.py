#!/usr/bin/env python3
"""Ratios, RFC gates and plots from bench/gdn_layer.py output (CPU, matplotlib).

    python bench/report.py RUN.json [MORE.json ...] [--outdir DIR] [--no-plots]

DIR defaults to the first input's folder and is created if missing.

Several inputs are merged (e.g. the patched-tree sweep and the base-tree ``old_headwise``
baseline); a later file's run replaces an earlier one of the same (CP, mode, T). Writes
<outdir>/gdn_layer_summary.json, gdn_layer_summary.md (ratio table) and gdn_layer_time.png /
gdn_layer_memory.png (one line per mode, one panel per CP size). Configurations missing from
the inputs are reported as not measured, never filled in.

The headwise split experiment (old image's path against the new headwise) is reported beside
the ratio table when its runs are present: ``old_headwise`` (base tree, FLA 0.4.1),
``base_fla042`` (base tree, FLA 0.4.2: the dependency upgrade alone), ``headwise`` (patched
tree, FLA 0.4.2) and ``headwise_qkv_compiled`` (the same with ``--prepare-qkv jit_fuser``).
``--no-plots`` skips matplotlib.
"""
import argparse
import json
import os
import sys

MODES = ("headwise", "all_gather", "chunkwise", "ideal", "old_headwise")
# labelled runs of the headwise split experiment (bench/gdn_layer.py --label ...), old to new
SPLIT = ("old_headwise", "base_fla042", "headwise", "headwise_qkv_compiled")
PLOTTED = tuple(dict.fromkeys(MODES + SPLIT))
GATES = {
    "chunkwise_vs_all_gather": "throughput ratio >= 1.10 OR peak-memory ratio <= 0.90",
    "chunkwise_vs_headwise": "throughput ratio >= 0.95 AND peak-memory ratio <= 1.05",
}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+")
    ap.add_argument("--outdir", default=None)
    ap.add_argument("--no-plots", action="store_true", help="write the JSON and Markdown only")
    a = ap.parse_args(argv)
    outdir = a.outdir or os.path.dirname(os.path.abspath(a.json[0]))
    os.makedirs(outdir, exist_ok=True)
    docs = [json.load(open(f)) for f in a.json]
    runs = {(r["cp"], r["mode"], r["T"]): r for doc in docs for r in doc.get("runs", [])}
    layouts = sorted({r.get("samples", 1) for r in runs.values()})
    if len(layouts) > 1:
        raise SystemExit(f"bench/report.py: the inputs mix layouts (samples per run: {layouts}; 1 = SBHD, "
                         "N > 1 = THD of N samples); report one layout at a time")
    unknown = sorted({k[1] for k in runs} - set(PLOTTED))
    if unknown:
        print(f"bench/report.py: runs labelled {', '.join(unknown)} are not part of any table or plot; "
              f"known modes: {', '.join(PLOTTED)}", file=sys.stderr)
    cps = sorted({k[0] for k in runs} | {2, 4})
    seqs = sorted({k[2] for k in runs} | {8192, 16384, 32768, 65536})
    rows, missing = [], []
    for P in cps:
        for T in seqs:
            g = {m: runs.get((P, m, T)) for m in PLOTTED}
            missing += [f"P={P} {m} T={T}" for m in MODES if g[m] is None]
            c, ag, hw, idl = g["chunkwise"], g["all_gather"], g["headwise"], g["ideal"]
            row = {"cp": P, "T": T}

            def ratio(x, y, key):
                if not (x and y) or x.get(key) is None or not y.get(key):
                    return None
                return round(x[key] / y[key], 4)
            row["chunkwise/all_gather throughput"] = ratio(c, ag, "tokens_per_s")
            row["chunkwise/all_gather peak_alloc"] = ratio(c, ag, "peak_alloc_mib")
            row["chunkwise/headwise throughput"] = ratio(c, hw, "tokens_per_s")
            row["chunkwise/headwise peak_alloc"] = ratio(c, hw, "peak_alloc_mib")
            row["chunkwise efficiency vs ideal"] = ratio(idl, c, "median_ms")
            row["chunkwise/old_headwise throughput"] = ratio(c, g["old_headwise"], "tokens_per_s")
            row["chunkwise/old_headwise peak_alloc"] = ratio(c, g["old_headwise"], "peak_alloc_mib")
            row["headwise/old_headwise throughput"] = ratio(hw, g["old_headwise"], "tokens_per_s")
            for m, r in g.items():
                row[f"{m} median_ms"] = r["median_ms"] if r else None
            row["headwise/old_headwise time"] = ratio(hw, g["old_headwise"], "median_ms")
            row["base_fla042/old_headwise time"] = ratio(g["base_fla042"], g["old_headwise"], "median_ms")
            row["headwise/base_fla042 time"] = ratio(hw, g["base_fla042"], "median_ms")
            row["headwise_qkv_compiled/headwise time"] = ratio(g["headwise_qkv_compiled"], hw, "median_ms")
            t1, m1 = row["chunkwise/all_gather throughput"], row["chunkwise/all_gather peak_alloc"]
            row["gate chunkwise_vs_all_gather"] = (
                None if t1 is None else bool(t1 >= 1.10 or (m1 is not None and m1 <= 0.90)))
            t2, m2 = row["chunkwise/headwise throughput"], row["chunkwise/headwise peak_alloc"]
            row["gate chunkwise_vs_headwise"] = (
                None if t2 is None or m2 is None else bool(t2 >= 0.95 and m2 <= 1.05))
            rows.append(row)
    profile = [_profile_summary(pr) for doc in docs for pr in doc.get("profile_chunkwise") or []]
    summary = {"sources": [os.path.basename(f) for f in a.json], "gates": GATES, "rows": rows,
               "samples": layouts[0] if layouts else None,
               "not_measured": missing, "not_reported_modes": unknown, "meta": [doc.get("meta", {}) for doc in docs],
               "errors": [e for doc in docs for e in doc.get("errors", [])],
               "profile_chunkwise": profile}
    with open(os.path.join(outdir, "gdn_layer_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)

    print(_write_markdown(os.path.join(outdir, "gdn_layer_summary.md"), rows), end="")
    print(f"not measured: {len(missing)} configurations (listed in gdn_layer_summary.json)")
    if a.no_plots:
        return summary
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("bench/report.py: matplotlib is missing, so no plots were drawn (the JSON and "
                         "Markdown summaries were written); install it: pip install -e '.[bench]'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for what, key, ylabel in (("time", "median_ms", "fwd+bwd median ms (max over ranks)"),
                              ("memory", "peak_alloc_mib", "peak allocated MiB (max over ranks)")):
        fig, axes = plt.subplots(1, len(cps), figsize=(6 * len(cps), 4.2), squeeze=False)
        for ax, P in zip(axes[0], cps):
            for m in PLOTTED:
                pts = sorted((T, runs[(P, m, T)][key]) for T in seqs if (P, m, T) in runs)
                if pts:
                    ax.plot([p[0] // 1024 for p in pts], [p[1] for p in pts], marker="o", label=m)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("global sequence length (K tokens)")
            ax.set_ylabel(ylabel)
            lay = "SBHD b=1" if not layouts or layouts[0] == 1 else f"THD {layouts[0]} samples"
            ax.set_title(f"GatedDeltaNet layer, CP={P}, bf16, {lay}")
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
            else:
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        fig.savefig(os.path.join(outdir, f"gdn_layer_{what}.png"), dpi=110)
        plt.close(fig)
    return summary


def _profile_summary(pr):
    """Device ms of one profiled chunkwise step (one rank), collectives counted once.

    Earlier bench versions also counted the profiler's ``nccl:*`` annotations as kernels, which
    doubled the collective time; here the collectives are re-summed from the kernel list
    (``ncclDevKernel_*`` only) and the total is corrected by the annotations' time.
    """
    top = pr.get("top_kernels", [])
    notes = sum(k["ms"] for k in top if k["name"].startswith("nccl:"))
    coll = {}
    for k in top:
        if k["name"].startswith("ncclDevKernel_"):
            kind = k["name"].split("(")[0].replace("ncclDevKernel_", "")
            coll[kind] = round(coll.get(kind, 0.0) + k["ms"], 4)
    return {"rank": pr["rank"], "cp": pr["cp"], "T": pr["T"],
            "total_kernel_ms": round(pr["total_kernel_ms"] - notes, 4),
            "collectives_ms": coll,
            "ranges_device_ms": {k.replace("gdn::", ""): v["device_ms"] for k, v in pr["ranges"].items()
                                 if v.get("device_ms")}}


def _write_markdown(path, rows):
    """The ratio table of the closing note: one line per (CP, T) with every measured ratio.
    Writes it to ``path`` and returns the text."""
    cols = ["chunkwise/all_gather throughput", "chunkwise/all_gather peak_alloc",
            "chunkwise/headwise throughput", "chunkwise/headwise peak_alloc",
            "chunkwise efficiency vs ideal", "chunkwise/old_headwise throughput",
            "gate chunkwise_vs_all_gather", "gate chunkwise_vs_headwise"]
    fmt = lambda v: "n/a" if v is None else ("pass" if v is True else "FAIL" if v is False  # noqa: E731
                                            else f"{v:.4f}")
    lines = ["| CP | T | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 2)]
    for r in rows:
        if all(r[c] is None for c in cols):
            continue
        lines.append(f"| {r['cp']} | {r['T'] // 1024}K | " + " | ".join(fmt(r[c]) for c in cols) + " |")
    split_cols = [f"{m} median_ms" for m in SPLIT] + [
        "headwise/old_headwise time", "base_fla042/old_headwise time", "headwise/base_fla042 time",
        "headwise_qkv_compiled/headwise time"]
    # only where a split run exists: old_headwise + headwise alone is the ratio table's business
    split_rows = [r for r in rows if r["base_fla042 median_ms"] is not None
                  or r["headwise_qkv_compiled median_ms"] is not None]
    if split_rows:
        lines += ["", "Headwise split (median ms; time ratios > 1 mean slower): old image's path -> "
                  "FLA upgrade -> patch -> patch with _prepare_qkv compiled", "",
                  "| CP | T | " + " | ".join(split_cols) + " |", "|" + " --- |" * (len(split_cols) + 2)]
        for r in split_rows:
            lines.append(f"| {r['cp']} | {r['T'] // 1024}K | " + " | ".join(
                (f"{r[c]:.2f}" if c.endswith("median_ms") and r[c] is not None else fmt(r[c]))
                for c in split_cols) + " |")
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    main()
