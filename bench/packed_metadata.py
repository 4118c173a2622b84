#!/usr/bin/env python3
"""Host cost of a packed micro-batch's CP metadata: built once per micro-batch against per layer.

Issue 43 item 6. On the CPU, with the patched tree (``build/tree/patched``, or ``GDN_TREE``) and
FLA 0.4.2 importable (the project's venv), for packed micro-batches of ``--tokens`` tokens in
``--segments`` equal sequences at each CP size of ``--cp``, it times (median of ``--repeats``,
each on a fresh ``PackedSeqParams``, FLA's tensor cache off so nothing is served from it):

* ``finalize``: ``finalize_packed_seq_params`` on rank 0's view, the once-per-micro-batch cost
  (host boundaries given: no copy); it builds the chunkwise route and FLA's CP context (``fla.ops.cp.context.get_cp_cu_seqlens``, the host work ``build_cp_context``
  does, without a process group) for chunkwise, the index pair for all_gather;
* ``layer_read``: what a GDN layer does with a finalized micro-batch (``packed_seq_metadata``:
  the match check, then the route and context lookups), per layer;
* ``per_layer_build``: what each layer did before (the host boundary checks, then chunkwise's
  route and FLA context, or all_gather's index pair), per layer.

The headwise mode prebuilds nothing (its per-sequence splits are host integers).

So a stack of L layers costs ``finalize + L * layer_read`` now against ``L * per_layer_build``.
Host figures only: no GPU, no collective (the groups are stand-ins with a size and a rank).
Writes ``<out>/packed-metadata.json`` and ``.md``; prints one line per case.

    .venv/bin/python bench/packed_metadata.py --out results/bench/packed-metadata
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from thd_route import _Group  # noqa: E402  (a CP group's shape: size and rank, no collective)


def _median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="4096,16384,65536,131072")
    parser.add_argument("--segments", default="1,8,64")
    parser.add_argument("--cp", default="2,4")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(ROOT, "results", "bench", "packed-metadata"))
    args = parser.parse_args(argv)
    os.environ["FLA_DISABLE_TENSOR_CACHE"] = "1"
    tree = os.environ.get("GDN_TREE", os.path.join(ROOT, "build", "tree", "patched"))
    if not os.path.isdir(os.path.join(tree, "megatron", "core")):
        print(f"error: no patched tree at {tree}\nhint: run `make patch` (or set GDN_TREE)", file=sys.stderr)
        return 2
    sys.path.insert(0, tree)
    import torch
    from fla.ops.cp.context import get_cp_cu_seqlens
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.ssm import gdn_context_parallel as g

    torch.set_num_threads(1)
    rows = []
    for cp in [int(x) for x in args.cp.split(",")]:
        group = _Group(cp, 0)
        for tokens in [int(x) for x in args.tokens.split(",")]:
            for segments, mode in [(int(x), m) for x in args.segments.split(",")
                                   for m in ("chunkwise", "all_gather")]:
                seq = tokens // segments // (2 * cp) * (2 * cp)
                host = torch.arange(segments + 1, dtype=torch.int32) * seq

                def fresh():
                    t = host.clone()
                    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=t, cu_seqlens_kv=t)

                def context(cu, cu_cpu):
                    # the host work build_cp_context does, without a process group
                    return get_cp_cu_seqlens(cu, cu_seqlens_cpu=cu_cpu, world_size=cp, rank=0,
                                             conv1d_kernel_size=4)

                def finalize():
                    # as finalize builds it for `mode` (FLA's context without a process group)
                    psp = fresh()
                    g.finalize_packed_seq_params(psp, cu_seqlens_cpu=host, cp_group=group, linear_cp_modes=(
                        () if mode == "chunkwise" else (mode,)))
                    meta = psp.gdn_packed_metadata
                    if mode == "chunkwise":
                        meta.layout_route()
                        meta._fla_contexts[None] = context(meta.cu_seqlens, meta.cu_seqlens_cpu)
                    return psp

                psp = finalize()

                def layer_read():
                    meta = g.packed_seq_metadata(psp, int(host[-1]), group)
                    if mode == "chunkwise":
                        meta.layout_route()
                        meta._fla_contexts.get(None)
                    else:
                        meta.gather_index()

                def per_layer_build():
                    # what each layer did before: host checks, then its mode's route or indices
                    p = fresh()
                    cu_cpu = p.cu_seqlens_q.clone()
                    g._check_host_cu_seqlens("cu_seqlens_q", cu_cpu, int(host[-1]))
                    if mode == "chunkwise":
                        g.ThdLayoutRoutes(cu_cpu, group, "cpu")
                        context(p.cu_seqlens_q, cu_cpu)
                    else:
                        meta = g.PackedSeqMetadata(p, group, cu_seqlens_cpu=cu_cpu, linear_cp_modes=())
                        meta.gather_index()

                row = {"cp": cp, "mode": mode, "tokens": int(host[-1]), "segments": segments,
                       "finalize_ms": _median_ms(finalize, args.repeats),
                       "layer_read_ms": _median_ms(layer_read, args.repeats * 5),
                       "per_layer_build_ms": _median_ms(per_layer_build, args.repeats)}
                for layers in (2, 8, 48):
                    row[f"L{layers}_now_ms"] = row["finalize_ms"] + layers * row["layer_read_ms"]
                    row[f"L{layers}_before_ms"] = layers * row["per_layer_build_ms"]
                rows.append(row)
                print(f"{mode} cp={cp} tokens={row['tokens']} segments={segments}: finalize {row['finalize_ms']:.3f} ms, "
                      f"layer read {row['layer_read_ms']:.4f} ms, per-layer build before {row['per_layer_build_ms']:.3f} ms",
                      flush=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "threads": 1, "repeats": args.repeats, "tree": os.path.relpath(tree, ROOT),
            "note": "host time on the CPU; median ms; FLA tensor cache off; groups are stand-ins (size, rank)"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "packed-metadata.json"), "w", encoding="utf-8") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1, sort_keys=True)
        fh.write("\n")
    lines = ["| mode | CP | tokens | segments | finalize ms (once) | layer read ms | per-layer build ms (before) | "
             "L=8 now / before ms | L=48 now / before ms |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['cp']} | {r['tokens']} | {r['segments']} | {r['finalize_ms']:.3f} | {r['layer_read_ms']:.4f} | "
                     f"{r['per_layer_build_ms']:.3f} | {r['L8_now_ms']:.2f} / {r['L8_before_ms']:.2f} | "
                     f"{r['L48_now_ms']:.2f} / {r['L48_before_ms']:.2f} |")
    with open(os.path.join(args.out, "table.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
