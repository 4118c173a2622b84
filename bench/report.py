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

Inputs with ``profiles`` (bench/gdn_layer.py ``--profile T``) also give gdn_layer_profile.md:
one attribution table per (CP, T, samples), a column per profiled mode (see
``_write_profile``); the tables' data goes under ``profiles`` in gdn_layer_summary.json.
"""
import argparse
import json
import os
import sys

MODES = ("headwise", "all_gather", "chunkwise", "ideal", "old_headwise")
# labelled runs of the headwise split experiment (bench/gdn_layer.py --label ...), old to new
SPLIT = ("old_headwise", "base_fla042", "headwise", "headwise_qkv_compiled")
PLOTTED = tuple(dict.fromkeys(MODES + SPLIT + ("chunkwise_upstream_layout",)))
PROFILE_ORDER = ("headwise", "chunkwise", "chunkwise_upstream_layout")  # columns, others after
LAYOUT_RANGES = ("zigzag_to_contiguous_chunks", "contiguous_to_zigzag_chunks")
TOP_SCOPES = 10
SPREAD = 0.05  # max over ranks shown when it exceeds rank 0's value by more than this share
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
    docs = [_read_input(f) for f in a.json]
    runs = {(r["cp"], r["mode"], r["T"]): r for doc in docs for r in doc.get("runs", [])}
    layouts = sorted({r.get("samples", 1) for r in runs.values()})
    if len(layouts) > 1:
        _refuse(f"the inputs mix layouts (samples per run: {layouts}; 1 = SBHD, N > 1 = THD of N samples); "
                "report one layout at a time")
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
    profiles = {(p["cp"], p["T"], p.get("samples", 1), p["mode"]): p
                for doc in docs for p in doc.get("profiles") or []}  # a later file's replaces
    if profiles:
        tables = _profile_tables(profiles)
        summary["profiles"] = tables
        _write_profile(os.path.join(outdir, "gdn_layer_profile.md"), tables)
        print(f"profile attribution: {len(tables)} table(s) in gdn_layer_profile.md")
    with open(os.path.join(outdir, "gdn_layer_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)

    print(_write_markdown(os.path.join(outdir, "gdn_layer_summary.md"), rows, runs, a.json), end="")
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


def _refuse(msg):
    """Exit 2 (bad input, argparse's status) with one ``bench/report.py: <msg>`` line on stderr."""
    print(f"bench/report.py: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _read_input(path):
    """One bench/gdn_layer.py ``--out`` document; refuses (exit 2) what is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        _refuse(f"cannot read {path}: {e.strerror or e}; pass the JSON files bench/gdn_layer.py --out wrote")
    except ValueError as e:
        _refuse(f"{path} is not JSON ({e}); pass the JSON files bench/gdn_layer.py --out wrote")
    if not isinstance(doc, dict) or not isinstance(doc.get("runs", []), list) or not isinstance(
            doc.get("profiles") or [], list):
        _refuse(f"{path} is not a bench/gdn_layer.py result (an object with a 'runs' list); pass the "
                "JSON files bench/gdn_layer.py --out wrote")
    return doc


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


# (row label, meaning, how to read it from one rank's profile_attr.attribute() dict)
PROFILE_ROWS = (
    ("CUDA-event median ms (timed runs)", "median of the timed fwd+bwd repeats (max over ranks, "
     "CUDA events, not profiled)", None),
    ("profiled step wall ms", "one profiled fwd+bwd: from each phase's host start to its last GPU "
     "activity, both phases summed", lambda r: r["total"]["wall_ms"]),
    ("of which GPU busy", "union of GPU activity over all streams (concurrent kernels count once)",
     lambda r: r["total"]["busy_ms"]),
    ("GPU idle (host-bound)", "wall minus busy: the GPU waits for the host (Python, launches, "
     "syncs, the other rank)", lambda r: r["total"]["idle_ms"]),
)
PROFILE_TAIL = (
    ("minus overlap of streams", "kernel ms that ran beside other kernels (NCCL beside compute): "
     "the categories above minus this row add up to GPU busy", lambda r: r["overlap_ms"]),
    ("host syncs (count)", "CUDA calls inside the phases' host ranges that block the host until "
     "the GPU drains", lambda r: r["total"]["host_syncs"]),
    ("host ms in syncs", "host time spent inside those calls", lambda r: r["total"]["host_sync_ms"]),
    ("host ms build_cp_context", "host time of the gdn::build_cp_context ranges (n/a: not run "
     "in this mode)", lambda r: r["host_ranges_ms"].get("build_cp_context")),
    ("host ms layout conversion", "host time of the gdn::" + " and gdn::".join(LAYOUT_RANGES)
     + " ranges (n/a: not run in this mode)",
     lambda r: (None if not any(k in r["host_ranges_ms"] for k in LAYOUT_RANGES)
                else round(sum(r["host_ranges_ms"].get(k, 0.0) for k in LAYOUT_RANGES), 4))),
    ("scope coverage", "share of kernel ms whose launching host range was found (scopes "
     "table below); categories do not depend on it", lambda r: r["scope_coverage"]),
)
CATEGORY_MEANING = "kernel ms of this category of kernel name, forward and backward summed"


def _profile_tables(profiles):
    """One table per (CP, T, samples) from ``{(cp, T, samples, mode): profile record}``.

    A cell is ``{"rank0": v, "max": m}`` (``max`` over the ranks, None where it is within
    ``SPREAD`` of rank 0's value); the ``chunkwise - headwise`` column holds rank 0's
    difference. Times in ms."""
    tables = []
    for cp, T, samples in sorted({k[:3] for k in profiles}):
        got = {k[3]: p for k, p in profiles.items() if k[:3] == (cp, T, samples)}
        modes = [m for m in PROFILE_ORDER if m in got] + sorted(set(got) - set(PROFILE_ORDER))
        ranks = {m: sorted(got[m]["ranks"], key=lambda r: r["rank"]) for m in modes}
        # a rank whose step was not attributed (gdn_layer.py stores its error and an empty total)
        # gives n/a cells; the table lists it under not_attributed
        not_attributed = {m: [f"rank {r['rank']} ({r.get('error', 'no attribution')})" for r in ranks[m]
                              if not r.get("total")] or ([] if ranks[m] else ["no rank recorded"])
                          for m in modes}
        not_attributed = {m: v for m, v in not_attributed.items() if v}
        first = {m: (ranks[m][:1] or [{}])[0] for m in modes}
        cats = {c for m in modes for r in ranks[m] for c in r.get("category_ms", {})}
        cats = sorted(cats, key=lambda c: (-max(first[m].get("category_ms", {}).get(c, 0.0) for m in modes), c))
        specs = list(PROFILE_ROWS) + [(c, CATEGORY_MEANING, lambda r, c=c: r["category_ms"].get(c, 0.0))
                                      for c in cats] + list(PROFILE_TAIL)
        rows = []
        for label, meaning, get in specs:
            cells = {}
            for m in modes:
                if get is None:
                    cells[m] = {"rank0": got[m]["median_ms"], "max": None}
                    continue
                vals = [get(r) if r.get("total") else None for r in ranks[m]]
                v0 = vals[0] if vals else None
                vmax = max((v for v in vals if v is not None), default=None)
                spread = vmax is not None and (v0 is None or vmax > v0 + SPREAD * abs(v0))
                cells[m] = {"rank0": v0, "max": vmax if spread else None}
            row = {"row": label, "meaning": meaning, "values": cells}
            a, b = cells.get("chunkwise"), cells.get("headwise")
            if a and b and label != "scope coverage":
                row["chunkwise - headwise"] = (None if a["rank0"] is None or b["rank0"] is None
                                               else round(a["rank0"] - b["rank0"], 4))
            rows.append(row)
        top = {m: [list(kv) for kv in sorted(first[m].get("scope_ms", {}).items(),
                                             key=lambda kv: (-kv[1], kv[0]))[:TOP_SCOPES]]
               for m in modes}
        tables.append({"cp": cp, "T": T, "samples": samples, "modes": modes,
                       "ranks": max(len(ranks[m]) for m in modes), "rows": rows, "top_scopes": top,
                       "not_attributed": not_attributed})
    return tables


def _write_profile(path, tables):
    """gdn_layer_profile.md: the attribution tables of ``_profile_tables``, each followed by the
    top scopes by kernel ms. Writes ``path`` and returns the text."""
    def num(label, v):
        if v is None:
            return "n/a"
        if label == "scope coverage":
            return f"{v:.1%}"
        if label == "host syncs (count)":
            return f"{v:g}"
        return f"{v:.3f}"

    lines = ["# GatedDeltaNet layer: one profiled step, attributed (bench/profile_attr.py)", "",
             "Each cell is rank 0's value; `[max X]` follows where the largest value over the ranks "
             f"exceeds rank 0's by more than {SPREAD:.0%}. `chunkwise - headwise` is rank 0's "
             "difference (negative: chunkwise spends less). Times in ms. Kernel categories are listed "
             "largest first.", "", "Rows:", ""]
    for label, meaning, _ in PROFILE_ROWS:
        lines.append(f"- **{label}**: {meaning}")
    lines.append(f"- **each kernel category** (after GPU idle): {CATEGORY_MEANING}")
    for label, meaning, _ in PROFILE_TAIL:
        lines.append(f"- **{label}**: {meaning}")
    for t in tables:
        modes = t["modes"]
        diff = any("chunkwise - headwise" in r for r in t["rows"])
        cols = modes + (["chunkwise - headwise"] if diff else [])
        lay = "SBHD b=1" if t["samples"] == 1 else f"THD {t['samples']} samples"
        lines += ["", f"## CP={t['cp']}, T={t['T'] // 1024}K, {lay} ({t['ranks']} ranks)", "",
                  "| row | " + " | ".join(cols) + " |", "| --- |" + " ---: |" * len(cols)]
        for r in t["rows"]:
            cells = []
            for m in modes:
                c = r["values"][m]
                cells.append(num(r["row"], c["rank0"]) + (
                    f" [max {num(r['row'], c['max'])}]" if c["max"] is not None else ""))
            if diff:
                d = r.get("chunkwise - headwise")
                cells.append("" if "chunkwise - headwise" not in r else
                             "n/a" if d is None else f"{d:+g}" if r["row"] == "host syncs (count)"
                             else f"{d:+.3f}")
            lines.append(f"| {r['row']} | " + " | ".join(cells) + " |")
        if t.get("not_attributed"):
            lines += ["", "n/a where a rank's step was not attributed; not attributed: " + "; ".join(
                f"{m} {w}" if w.startswith("rank ") else f"{m}: {w}"
                for m, ws in t["not_attributed"].items() for w in ws)]
        lines += ["", f"Top scopes by kernel ms (rank 0): `gdn::` ranges of the forward, autograd "
                  "nodes `(backward)`; `unattributed`: no launch found.", "",
                  "| # | " + " | ".join(modes) + " |", "| ---: |" + " --- |" * len(modes)]
        for i in range(max(len(t["top_scopes"][m]) for m in modes)):
            cells = [f"{s[0]} {s[1]:.3f}" if i < len(t["top_scopes"][m]) and (s := t["top_scopes"][m][i])
                     else "" for m in modes]
            lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


def _write_markdown(path, rows, runs=None, sources=()):
    """The ratio table of the closing note: one line per (CP, T) with every measured ratio,
    then every run the ratios come from (``runs``: (CP, mode, T) -> run record, after merging)
    and the input files in merge order. Writes it to ``path`` and returns the text."""
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
    if runs:
        lines += ["", "Runs (median / min / p90 ms, max over ranks; peak allocated MiB; host syncs per step):", "",
                  "| CP | mode | T | median | min | p90 | peak alloc | host syncs |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for (P, mode, T), r in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2])):
            cells = [("n/a" if r.get(k) is None else f"{r[k]:.{d}f}")
                     for k, d in (("median_ms", 2), ("min_ms", 2), ("p90_ms", 2), ("peak_alloc_mib", 0))]
            syncs = r.get("host_syncs_per_step")
            lines.append(f"| {P} | {mode} | {T // 1024}K | " + " | ".join(cells)
                         + f" | {'n/a' if syncs is None else syncs} |")
    if sources:
        lines += ["", "Inputs, in merge order (a later file's run replaces an earlier one of the same CP, mode "
                  "and T): " + ", ".join(f"`{f}`" for f in sources)]
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    main()
