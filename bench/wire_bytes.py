#!/usr/bin/env python3
"""Bytes on the wire per GDN layer step, per mode and CP size (CPU, gloo; no GPU needed).

    .venv/bin/python bench/wire_bytes.py [--tree build/tree/patched] [--label NAME]
        [--cp 2 4 8] [--tokens 64] [--out results/bench/wire-bytes/NAME.json]

Runs one bf16 forward + backward of GatedDeltaNet at CP = each ``--cp`` in a gloo world on
this machine, for the benchmark shape and a Qwen3-Next-like shape (``tests/image/wire_bytes``
says what is counted and what is not), and writes the JSON plus a Markdown table beside it
(bytes per global token sent by rank 0; every rank sends the same for SBHD). The figures are
exact counts, not timings: they scale linearly with ``--tokens``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=str(REPO / "build" / "tree" / "patched"), help="Megatron tree (default: %(default)s)")
    ap.add_argument("--label", default="patched", help="name of this run in the table (default: %(default)s)")
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8], help="CP sizes (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=64, help="global SBHD tokens, a multiple of 2*CP (default: %(default)s)")
    ap.add_argument("--out", help="JSON path (default: results/bench/wire-bytes/<label>.json)")
    args = ap.parse_args(argv)
    if not Path(args.tree, "megatron", "core", "ssm", "gated_delta_net.py").is_file():
        ap.error(f"--tree {args.tree} holds no megatron/core/ssm/gated_delta_net.py: build the patched tree "
                 "first (`make patch`, README) or pass --tree")
    os.environ["GDN_TREE"] = str(Path(args.tree).resolve())
    sys.path.insert(0, str(REPO / "tests" / "image"))
    import _image_env  # noqa: F401  (puts the tree first on sys.path)
    import wire_bytes
    from _world import run_world

    out = Path(args.out or REPO / "results" / "bench" / "wire-bytes" / f"{args.label}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    shapes = tuple(wire_bytes.SHAPES)
    runs = {}
    for cp in args.cp:
        ranks = run_world(_worker, cp, (shapes, args.tokens), timeout=1800)
        runs[str(cp)] = ranks[0]
        print(f"CP={cp}: done", file=sys.stderr)
    data = {"label": args.label, "tree": str(Path(args.tree).resolve()), "tokens": args.tokens,
            "shapes": {k: dict(zip(("hidden", "k_heads", "v_heads", "dk", "dv"), v)) for k, v in wire_bytes.SHAPES.items()},
            "unit": "bytes sent by rank 0 per step (fwd+bwd), bf16", "runs": runs}
    out.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    md = render(data)
    out.with_suffix(".md").write_text(md, encoding="utf-8")
    print(md)
    return 0


def _worker(rank, world, spec):
    import wire_bytes

    shapes, tokens = spec
    return wire_bytes.table(rank, world, shapes, tokens)


def render(data: dict) -> str:
    """Markdown table: bytes per global token per mode, and chunkwise / headwise."""
    lines = [f"# Bytes on the wire per GDN step: {data['label']}", "",
             f"{data['unit']}, divided by the {data['tokens']} global tokens; the FLA stand-ins' "
             "own gathers are excluded (tests/image/wire_bytes.py).", "",
             "| shape | CP | headwise B/token | chunkwise B/token | all_gather B/token | chunkwise / headwise |",
             "| --- | --- | --- | --- | --- | --- |"]
    for cp, by_shape in sorted(data["runs"].items(), key=lambda kv: int(kv[0])):
        for shape, modes in sorted(by_shape.items()):
            def per(mode):
                return modes[mode]["per_token"] if mode in modes else None
            h, c, a = per("headwise"), per("chunkwise"), per("all_gather")
            fmt = lambda v: "-" if v is None else f"{v:,.0f}"  # noqa: E731
            ratio = "-" if not (h and c) else f"{c / h:.3f}"
            lines.append(f"| {shape} | {cp} | {fmt(h)} | {fmt(c)} | {fmt(a)} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
