#!/usr/bin/env python3
"""Tables and a plot from the model-level benchmark's results (bench/gdn_model.py).

    python bench/model_report.py results/bench/model/raw/*.json \
        --lines results/bench/model/raw/*.lines --outdir results/bench/model

Reads ``gdn_model.json`` files and, for runs a worker finished after its last save (the device
tool's time limit cut the merge short), the one-line-per-run logs (``*.lines``, the lines
``bench/gdn_model.py`` prints). Writes ``summary.md`` (host syncs per micro-batch against L for
every mode, CP size, layout and recompute setting, fresh ``PackedSeqParams`` and finalized; CP=1
tokens/s and peak memory, patched against the old image) and ``model.png`` (tokens/s and syncs
against L). Later inputs replace earlier runs of the same configuration.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
from pathlib import Path

LINE = re.compile(
    r"^(?P<mode>\w+)\s+cp=(?P<cp>\d+) L=(?P<layers>\d+) (?P<layout>\w+) recompute=(?P<recompute>\w+)\s+"
    r"(?P<tps>[\d.]+) tok/s(?P<na> \(timing n/a\))? peak (?P<peak>\d+) MiB syncs (?P<total>\d+) "
    r"\(fwd (?P<fwd>\d+), bwd (?P<bwd>\d+)\)"
    r"(?: (?:attached|finalized) (?P<att>\d+) \+ (?:attach|finalize) (?P<attach>\d+))?"
    r"(?: before (?P<before>\d+))?(?: (?P<sites>\{.*\}))?$")


def _key(r: dict) -> tuple:
    return (r["tree"], r["mode"], r["cp"], r["layout"], r["recompute"], r["layers"], r.get("round", 1),
            r.get("ideal_for_cp", 0))


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
        rec["host_syncs_finalized"] = {"total": int(g["att"])}
        rec["finalize_syncs"] = int(g["attach"])
    if g["before"] is not None:
        rec["host_syncs_before"] = {"total": int(g["before"])}
    return rec


def load(jsons: list, lines: list, round_offsets: dict | None = None) -> list:
    """Runs of every input, keyed by configuration and round (a later input replaces an earlier
    run of the same key). ``round_offsets``: ``{json path: N}`` adds N to the rounds of that
    file's runs (a round whose second process ran in a later call)."""
    runs: dict = {}
    for path in jsons:
        off = (round_offsets or {}).get(str(path), 0)
        for r in json.loads(Path(path).read_text())["runs"]:
            if off:
                r = dict(r, round=r.get("round", 1) + off, round_offset=off)
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


def _median(xs: list) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def cp1_timings(runs: list) -> list:
    """CP=1 patched (chunkwise) against the old image, per (layout, recompute, L):
    ``{"layout", "recompute", "layers", "rounds": [[patched, old, ratio], ...], "median_ratio",
    "patched_peak_mib", "old_peak_mib"}``; a round counts when both trees ran it."""
    cells: dict = {}
    for r in runs:
        if r["cp"] != 1 or not r.get("timings_valid") or r["mode"] not in ("chunkwise", "old_headwise"):
            continue
        c = cells.setdefault((r["layout"], r["recompute"], r["layers"]), {})
        c.setdefault(r.get("round", 1), {})[r["tree"]] = r
    out = []
    for (layout, rc, L), by_round in sorted(cells.items()):
        rounds = [[b["patched"]["tokens_per_s"], b["base"]["tokens_per_s"],
                   b["patched"]["tokens_per_s"] / b["base"]["tokens_per_s"]]
                  for _, b in sorted(by_round.items()) if "patched" in b and "base" in b]
        first = by_round[min(by_round)]
        out.append({"layout": layout, "recompute": rc, "layers": L, "rounds": rounds,
                    "median_ratio": _median([x[2] for x in rounds]) if rounds else None,
                    "patched_peak_mib": (first.get("patched") or {}).get("peak_alloc_mib"),
                    "old_peak_mib": (first.get("base") or {}).get("peak_alloc_mib")})
    return out


def tables(runs: list) -> str:
    out = ["# Model-level benchmark: a stack of L GDN layers with their MLPs", "",
           "Qwen3.5-9B GDN geometry (hidden 4096, 16 key / 32 value heads, head dim 128, conv 4), SwiGLU MLP "
           "12288, bf16, TP=1, one H200; CP=1 timings on 32768 tokens per micro-batch (THD: 8 packed samples), "
           "forward + backward; the `tokens` column gives each count's micro-batch. CP>1 ranks share the GPU "
           "over gloo: their sync counts are valid, their timings are not.",
           "", "## Host syncs per micro-batch", "",
           "`fresh`: the layers get a new `PackedSeqParams` (the first GDN layer makes the host copy); "
           "`finalized`: the data path finalized it first (`finalize_packed_seq_params`; results before "
           "issue 43: `attach_cu_seqlens_cpu`), its own syncs in `finalize`; `before`: every GDN layer gets a `PackedSeqParams` of its own, as the patched tree "
           "made one host copy per layer before issue 24 (emulated on this tree). Counts are total "
           "(forward/backward).", ""]
    out += ["| tree | mode | CP | layout | recompute | L | round | tokens | fresh | finalized | finalize | before | sites |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        if r.get("host_syncs") is None or r["mode"] == "ideal":
            continue
        att = r.get("host_syncs_finalized") or r.get("host_syncs_attached")  # the latter: before issue 43
        bef = r.get("host_syncs_before")
        sites = ", ".join(f"`{k}` {v}" for k, v in sorted((r.get("host_syncs") or {}).get("sites", {}).items()))
        out.append(f"| {r['tree']} | {r['mode']} | {r['cp']} | {r['layout']} | {r['recompute']} | {r['layers']} | "
                   f"{r.get('round', 1)} | {r.get('tokens', '-')} | {_syncs(r)} | {att['total'] if att else '-'} | "
                   f"{r.get('finalize_syncs', r.get('attach_syncs', '-'))} | {bef['total'] if bef else '-'} | "
                   f"{sites} |")
    out += ["", "## CP=1 tokens/s and peak memory, patched (chunkwise) against the old image", "",
            "Each round is one process per tree, the rounds alternating which tree runs first; tokens/s "
            "from the median of the round's timed micro-batches.", "",
            "| layout | recompute | L | rounds: patched / old tok/s (ratio) | median ratio | patched peak MiB | "
            "old peak MiB |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in cp1_timings(runs):
        rounds = "; ".join(f"{p:.0f} / {o:.0f} ({x:.3f})" for p, o, x in c["rounds"]) or "-"
        med = f"{c['median_ratio']:.3f}" if c["median_ratio"] is not None else "-"
        out.append(f"| {c['layout']} | {c['recompute']} | {c['layers']} | {rounds} | {med} | "
                   f"{c['patched_peak_mib'] or '-'} | {c['old_peak_mib'] or '-'} |")
    ideal = [r for r in runs if r["mode"] == "ideal" and r.get("timings_valid")]
    if ideal:
        out += ["", "## Ideal: the patched stack at CP=1 on tokens/CP (what CP ranks reach with no "
                "communication), one GPU", "", "| for CP | layout | recompute | L | tokens | tok/s per GPU | peak MiB |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in sorted(ideal, key=lambda r: (r.get("ideal_for_cp", 0), r["layout"], r["recompute"], r["layers"])):
            out.append(f"| {r.get('ideal_for_cp')} | {r['layout']} | {r['recompute']} | {r['layers']} | "
                       f"{r['tokens']} | {r['tokens_per_s']:.0f} | {r.get('peak_alloc_mib', '-')} |")
    return "\n".join(out) + "\n"


_MODE_COLOR = {"old_headwise": "tab:red", "chunkwise": "tab:blue", "headwise": "tab:green",
               "all_gather": "tab:purple"}


def _join(values) -> str:
    return "/".join(str(v) for v in sorted(set(values)))


def sync_series(runs: list) -> list:
    """Host-sync curves for the plot, identical curves merged: ``[{"ys": {L: syncs}, "before":
    bool, "label"}]``, one per distinct curve, labelled with the trees, modes, CP sizes, layouts
    and recompute settings that gave it (``before``: the emulated count before issue 24)."""
    curves: dict = {}
    for r in runs:
        if r["mode"] == "ideal" or r.get("host_syncs") is None:
            continue
        k = (r["tree"], r["mode"], r["cp"], r["layout"], r["recompute"])
        curves.setdefault((k, False), {})[r["layers"]] = r["host_syncs"]["total"]
        if r.get("host_syncs_before"):
            curves.setdefault((k, True), {})[r["layers"]] = r["host_syncs_before"]["total"]
    merged: dict = {}
    for (k, before), ys in curves.items():
        if len(ys) < 2:  # one L only: no curve to draw
            continue
        merged.setdefault((tuple(sorted(ys.items())), before, k[0] == "base"), []).append(k)
    out = []
    for (ys, before, base), keys in sorted(merged.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        modes = _join("old image headwise" if m == "old_headwise" else m for _, m, _, _, _ in keys)
        label = (f"{modes}{' (before issue 24)' if before else ''}, CP {_join(k[2] for k in keys)}, "
                 f"{_join(k[3] for k in keys)}, recompute {_join(k[4] for k in keys)}")
        out.append({"ys": dict(ys), "before": before, "base": base, "label": label})
    return out


def plot(runs: list, path: Path) -> None:
    """``model.png``: CP=1 tokens/s (median over rounds; colour: mode, dashed: recompute on,
    squares: SBHD) and host syncs per micro-batch against L (identical curves merged into one,
    labelled with every configuration that gave it; dashed: before issue 24, emulated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(15, 5.2))
    tps: dict = {}
    for r in runs:
        if r["mode"] != "ideal" and r["cp"] == 1 and r.get("timings_valid"):
            tps.setdefault((r["tree"], r["mode"], r["layout"], r["recompute"]), {}).setdefault(
                r["layers"], []).append(r["tokens_per_s"])
    for (tree, mode, layout, rc), by_l in sorted(tps.items()):
        xs = sorted(by_l)
        name = "old image headwise" if mode == "old_headwise" else mode
        a.plot(xs, [_median(by_l[x]) for x in xs], color=_MODE_COLOR.get(mode, "tab:gray"),
               ls="--" if rc == "on" else "-", marker="s" if layout == "sbhd" else "o",
               label=f"{name}, {layout}, recompute {rc}")
    # the old image in reds, the patched tree in the other colours (red reads "old")
    patched_colors = iter([c for i, c in enumerate(plt.cm.tab10.colors * 3) if i % 10 != 3])
    base_colors = iter(["tab:red", "darkred", "salmon"] * 4)
    for c in sync_series(runs):
        xs = sorted(c["ys"])
        b.plot(xs, [c["ys"][x] for x in xs], marker="o", ls="--" if c["before"] else "-",
               color=next(base_colors) if c["base"] else next(patched_colors), label=c["label"])
    a.set(xlabel="GDN layers L", ylabel="tokens/s (CP=1, median over rounds)", yscale="log",
          title="throughput, CP=1, one H200")
    b.set(xlabel="GDN layers L", ylabel="host syncs per micro-batch", yscale="symlog",
          title="host syncs per micro-batch (CP>1: ranks sharing one GPU)")
    a.legend(fontsize=7)
    b.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jsons", nargs="+")
    ap.add_argument("--lines", nargs="*", default=[])
    ap.add_argument("--outdir", type=Path, required=True)
    ap.add_argument("--round-offset", action="append", default=[], metavar="JSON=N",
                    help="add N to the CP=1 rounds of the runs in JSON (one of the inputs)")
    args = ap.parse_args(argv)
    offsets = {}
    inputs = {os.path.realpath(j): j for j in args.jsons}  # any spelling of an input's path
    for item in args.round_offset:
        path, _, n = item.rpartition("=")
        try:
            n = int(n)
        except ValueError:
            n = None
        if n is None or os.path.realpath(path) not in inputs or not path:
            ap.error(f"--round-offset {item!r}: give JSON=N with JSON one of the inputs "
                     f"({', '.join(args.jsons)}) and N an integer")
        offsets[inputs[os.path.realpath(path)]] = n
    runs = load(args.jsons, args.lines, offsets)
    args.outdir.mkdir(parents=True, exist_ok=True)
    (args.outdir / "summary.md").write_text(tables(runs))
    plot(runs, args.outdir / "model.png")
    print(f"{len(runs)} runs -> {args.outdir}/summary.md, model.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
