#!/usr/bin/env python3
"""Tables and a plot from the model-level benchmark's results (bench/gdn_model.py).

    python bench/model_report.py results/bench/model/raw/*.json \
        --lines results/bench/model/raw/*.lines --outdir results/bench/model

Reads ``gdn_model.json`` files and, for runs a worker finished after its last save (the device
tool's time limit cut the merge short), the one-line-per-run logs (``*.lines``, the lines
``bench/gdn_model.py`` prints). Writes ``summary.md`` (host syncs per micro-batch against L for
every mode, CP size, layout and recompute setting, fresh ``PackedSeqParams`` and attached; CP=1
tokens/s and peak memory, patched against the old image) and ``model.png`` (tokens/s and syncs
against L). Later inputs replace earlier runs of the same configuration.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

LINE = re.compile(
    r"^(?P<mode>\w+)\s+cp=(?P<cp>\d+) L=(?P<layers>\d+) (?P<layout>\w+) recompute=(?P<recompute>\w+)\s+"
    r"(?P<tps>[\d.]+) tok/s(?P<na> \(timing n/a\))? peak (?P<peak>\d+) MiB syncs (?P<total>\d+) "
    r"\(fwd (?P<fwd>\d+), bwd (?P<bwd>\d+)\)(?: attached (?P<att>\d+) \+ attach (?P<attach>\d+))?(?: (?P<sites>\{.*\}))?$")


def _key(r: dict) -> tuple:
    return (r["tree"], r["mode"], r["cp"], r["layout"], r["recompute"], r["layers"])


def from_line(line: str) -> dict | None:
    """One run record from a printed result line (None for other lines)."""
    m = LINE.match(line.strip())
    if not m:
        return None
    g = m.groupdict()
    rec = {"tree": "base" if g["mode"] == "old_headwise" else "patched", "mode": g["mode"], "cp": int(g["cp"]),
           "layers": int(g["layers"]), "layout": g["layout"], "recompute": g["recompute"],
           "tokens_per_s": float(g["tps"]), "timings_valid": not g["na"], "peak_alloc_mib": float(g["peak"]),
           "host_syncs": {"total": int(g["total"]), "forward": int(g["fwd"]), "backward": int(g["bwd"]),
                          "sites": ast.literal_eval(g["sites"]) if g["sites"] else {}},
           "source": "log line"}
    if g["att"] is not None:
        rec["host_syncs_attached"] = {"total": int(g["att"])}
        rec["attach_syncs"] = int(g["attach"])
    return rec


def load(jsons: list, lines: list) -> list:
    runs: dict = {}
    for path in jsons:
        for r in json.loads(Path(path).read_text())["runs"]:
            runs[_key(r)] = r
    for path in lines:
        for line in Path(path).read_text().splitlines():
            r = from_line(line)
            if r is not None and _key(r) not in runs:
                runs[_key(r)] = r
    return sorted(runs.values(), key=lambda r: (r["cp"], r["layout"], r["mode"], r["recompute"], r["layers"]))


def _syncs(r: dict) -> str:
    s = r.get("host_syncs") or {}
    return f"{s.get('total')} ({s.get('forward')}/{s.get('backward')})"


def tables(runs: list) -> str:
    out = ["# Model-level benchmark: a stack of L GDN layers with their MLPs", "",
           "Qwen3.5-9B GDN geometry (hidden 4096, 16 key / 32 value heads, head dim 128, conv 4), SwiGLU MLP "
           "12288, bf16, TP=1, one H200; 32768 tokens per micro-batch (THD: 8 packed samples), forward + "
           "backward. CP>1 ranks share the GPU over gloo: their sync counts are valid, their timings are not.",
           "", "## Host syncs per micro-batch", "",
           "`fresh`: the layers get a new `PackedSeqParams` (the first GDN layer makes the host copy); "
           "`attached`: the data pipeline attached it first (`attach_cu_seqlens_cpu`, its own sync in "
           "`attach`). Counts are total (forward/backward).", ""]
    out += ["| tree | mode | CP | layout | recompute | L | fresh | attached | attach | sites |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        att = r.get("host_syncs_attached")
        sites = ", ".join(f"`{k}` {v}" for k, v in sorted((r.get("host_syncs") or {}).get("sites", {}).items()))
        out.append(f"| {r['tree']} | {r['mode']} | {r['cp']} | {r['layout']} | {r['recompute']} | {r['layers']} | "
                   f"{_syncs(r)} | {att['total'] if att else '-'} | {r.get('attach_syncs', '-')} | {sites} |")
    out += ["", "## CP=1 tokens/s and peak memory (one call, medians; not alternated processes)", "",
            "| layout | recompute | L | patched tok/s | old image tok/s | patched / old | patched peak MiB | old peak MiB |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = {_key(r): r for r in runs}
    for r in runs:
        if r["cp"] != 1 or r["tree"] != "patched":
            continue
        old = by.get(("base", "old_headwise", 1, r["layout"], r["recompute"], r["layers"]))
        ratio = f"{r['tokens_per_s'] / old['tokens_per_s']:.3f}" if old else "-"
        out.append(f"| {r['layout']} | {r['recompute']} | {r['layers']} | {r['tokens_per_s']:.0f} | "
                   f"{old['tokens_per_s']:.0f} | {ratio} | {r.get('peak_alloc_mib', 0):.0f} | "
                   f"{old.get('peak_alloc_mib', 0):.0f} |" if old else
                   f"| {r['layout']} | {r['recompute']} | {r['layers']} | {r['tokens_per_s']:.0f} | - | - | "
                   f"{r.get('peak_alloc_mib', 0):.0f} | - |")
    return "\n".join(out) + "\n"


def plot(runs: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict = {}
    for r in runs:
        series.setdefault((r["tree"], r["mode"], r["cp"], r["layout"], r["recompute"]), []).append(r)
    for (tree, mode, cp, layout, rc), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["layers"])
        label = f"{mode} cp{cp} {layout} rc={rc}"
        xs = [r["layers"] for r in rs]
        if cp == 1:
            a.plot(xs, [r["tokens_per_s"] for r in rs], marker="o", label=label)
        b.plot(xs, [(r.get("host_syncs") or {}).get("total", 0) for r in rs], marker="o", label=label)
    a.set(xlabel="GDN layers L", ylabel="tokens/s (CP=1)", title="throughput, CP=1")
    b.set(xlabel="GDN layers L", ylabel="host syncs per micro-batch", yscale="symlog", title="host syncs (fresh)")
    a.legend(fontsize=6)
    b.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jsons", nargs="+")
    ap.add_argument("--lines", nargs="*", default=[])
    ap.add_argument("--outdir", type=Path, required=True)
    args = ap.parse_args(argv)
    runs = load(args.jsons, args.lines)
    args.outdir.mkdir(parents=True, exist_ok=True)
    (args.outdir / "summary.md").write_text(tables(runs))
    plot(runs, args.outdir / "model.png")
    print(f"{len(runs)} runs -> {args.outdir}/summary.md, model.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
