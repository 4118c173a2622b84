"""Time FLA's GDN kernels alone, at the shapes the CP=1 headwise layer hands them (issue 17).

Owns the kernel-level half of the "patched headwise vs old image at CP=1" comparison: the
layer-level bench (``bench/gdn_layer.py``) cannot tell whether a gap between FLA 0.4.1 (old
image) and 0.4.2 (patched image) is FLA's or the layer's. Run this once per FLA version, each
in its own process (the version is whatever ``import fla`` finds, e.g. ``PYTHONPATH=/tmp/fla041``),
and compare the JSON files with ``--compare``.

Per length T, forward + backward, CUDA events, median of ``--repeats`` after ``--warmup``:

* ``conv``: ``fla.modules.convolution.causal_conv1d`` on the layer's strided view: ``x`` is
  ``[1, T, conv_dim]`` sliced from the in_proj output ``[1, T, in_proj_dim]`` (bf16), weight
  ``[conv_dim, conv_kernel]``, SiLU;
* ``l2norm``: ``fla.modules.l2norm.l2norm`` on ``[1, T, 2 * key_heads, head_dim]`` (bf16);
* ``scan``: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` with q, k, v ``[1, T, value_heads,
  head_dim]`` bf16 (q, k unit rows), g ``[1, T, value_heads]`` float32 (log decay, negative),
  beta ``[1, T, value_heads]`` bf16, no initial or final state, no in-kernel l2norm;
* ``scan_transposed_state`` (FLA >= 0.4.2 only): the same with ``transpose_state_layout=True``
  (the chunk states stored ``[V, K]``; outputs and gradients unchanged at CP=1).

With ``--kernels`` each op is also run under torch.profiler and its CUDA kernels are summed by
name (microseconds per step), so ``--compare`` can say which kernels differ.

Output (``--out``): JSON ``{"meta": {fla, triton, torch, device}, "runs": [{op, T, median_ms,
min_ms, p90_ms}], "kernels": {op: {T: {kernel name: us per step}}}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON result file")
    p.add_argument("--seq", default="65536,32768", help="comma-separated lengths T (tokens)")
    p.add_argument("--ops", default="conv,l2norm,scan,scan_transposed_state")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--value-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--conv-kernel", type=int, default=4)
    p.add_argument("--kernels", action="store_true", help="also sum CUDA kernel time by name")
    p.add_argument("--compare", nargs=2, metavar=("OLD.json", "NEW.json"),
                   help="print the op and kernel tables of two result files (no GPU)")
    args = p.parse_args(argv)
    if not args.compare and not args.out:
        p.error("--out is required unless --compare is given")
    return args


def _supports_transposed_state():
    import inspect

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return "transpose_state_layout" in inspect.signature(chunk_gated_delta_rule).parameters


def make_step(op, T, args, torch):
    """Inputs for one op at length T and a callable running its forward + backward."""
    dev, bf16 = "cuda", torch.bfloat16
    H, Hk, D = args.value_heads, args.key_heads, args.head_dim
    gen = torch.Generator(device=dev).manual_seed(T)

    def rand(*shape, dtype=bf16, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen, dtype=torch.float32) * scale).to(dtype)

    if op == "conv":
        from fla.modules.convolution import causal_conv1d

        conv_dim = 2 * Hk * D + H * D
        in_proj_dim = conv_dim + H * D + 2 * H  # + gate z, beta, alpha
        mixed = rand(1, T, in_proj_dim).requires_grad_(True)
        weight = rand(conv_dim, args.conv_kernel, scale=0.5).requires_grad_(True)
        bias = rand(conv_dim, scale=0.1).requires_grad_(True)
        grad = rand(1, T, conv_dim)

        def step():
            y, _ = causal_conv1d(x=mixed[..., :conv_dim], weight=weight, bias=bias, activation="silu")
            y.backward(grad)
        return step

    if op == "l2norm":
        from fla.modules.l2norm import l2norm

        x = rand(1, T, 2 * Hk, D).requires_grad_(True)
        grad = rand(1, T, 2 * Hk, D)

        def step():
            l2norm(x).backward(grad)
        return step

    if op in ("scan", "scan_transposed_state"):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        extra = {}
        if op == "scan_transposed_state":
            if not _supports_transposed_state():
                return None
            extra["transpose_state_layout"] = True
        q = torch.nn.functional.normalize(rand(1, T, H, D).float(), dim=-1).to(bf16).requires_grad_(True)
        k = torch.nn.functional.normalize(rand(1, T, H, D).float(), dim=-1).to(bf16).requires_grad_(True)
        v = rand(1, T, H, D).requires_grad_(True)
        g = (-torch.nn.functional.softplus(rand(1, T, H, dtype=torch.float32))).requires_grad_(True)
        beta = torch.sigmoid(rand(1, T, H, dtype=torch.float32)).to(bf16).requires_grad_(True)
        grad = rand(1, T, H, D)

        def step():
            o, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None,
                                          output_final_state=False, use_qk_l2norm_in_kernel=False,
                                          **extra)
            o.backward(grad)
        return step
    raise SystemExit(f"fla_kernels: unknown op {op!r}; use conv, l2norm, scan, scan_transposed_state")


def time_step(step, args, torch):
    """Median, min, p90 of one forward+backward, ms (CUDA events, one event pair per step)."""
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return {"median_ms": round(statistics.median(times), 4), "min_ms": round(times[0], 4),
            "p90_ms": round(times[int(0.9 * (len(times) - 1))], 4)}


def kernel_table(step, torch, steps=5):
    """CUDA kernel time by kernel name, microseconds per step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    table = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            table[evt.name] = table.get(evt.name, 0.0) + evt.device_time / steps
    return {name: round(us, 2) for name, us in sorted(table.items())}


def run(args):
    import torch

    import fla
    import triton

    seqs = [int(s) for s in args.seq.split(",")]
    result = {"meta": {"fla": getattr(fla, "__version__", "?"), "triton": triton.__version__,
                       "torch": torch.__version__, "device": torch.cuda.get_device_name(),
                       "args": vars(args)}, "runs": [], "kernels": {}}
    for op in args.ops.split(","):
        for T in seqs:
            step = make_step(op, T, args, torch)
            if step is None:
                print(f"{op} T={T}: not in FLA {result['meta']['fla']}", file=sys.stderr)
                continue
            rec = {"op": op, "T": T, **time_step(step, args, torch)}
            result["runs"].append(rec)
            print(f"FLA {result['meta']['fla']} {op:22s} T={T:6d}: median {rec['median_ms']:.3f} ms "
                  f"min {rec['min_ms']:.3f}", flush=True)
            if args.kernels:
                result["kernels"].setdefault(op, {})[str(T)] = kernel_table(step, torch)
            step = None
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)


def compare(old_path, new_path):
    """Markdown tables: op medians (new/old) and, per op and T, kernels by |new - old|."""
    old, new = (json.load(open(p)) for p in (old_path, new_path))
    lines = [f"old: FLA {old['meta']['fla']} ({old_path}); new: FLA {new['meta']['fla']} ({new_path})",
             "", "| op | T | old ms | new ms | new / old |", "| --- | --- | --- | --- | --- |"]
    olds = {(r["op"], r["T"]): r for r in old["runs"]}
    for r in new["runs"]:
        o = olds.get((r["op"], r["T"]))
        if o is None and r["op"] == "scan_transposed_state":  # old FLA: against its only scan
            o = olds.get(("scan", r["T"]))
        if o:
            lines.append(f"| {r['op']} | {r['T']} | {o['median_ms']:.3f} | {r['median_ms']:.3f} | "
                         f"{r['median_ms'] / o['median_ms']:.3f} |")
    for op, by_t in sorted(new.get("kernels", {}).items()):
        for T, kn in sorted(by_t.items()):
            old_op = "scan" if op == "scan_transposed_state" and op not in old.get("kernels", {}) else op
            ko = old.get("kernels", {}).get(old_op, {}).get(T, {})
            names = sorted(set(kn) | set(ko), key=lambda n: -abs(kn.get(n, 0) - ko.get(n, 0)))
            lines += ["", f"{op}, T={T}: kernel us per step (largest differences first)", "",
                      "| kernel | old us | new us | new - old |", "| --- | --- | --- | --- |"]
            for n in names[:12]:
                a, b = ko.get(n, 0.0), kn.get(n, 0.0)
                lines.append(f"| `{n[:70]}` | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
            lines.append(f"| total | {sum(ko.values()):.1f} | {sum(kn.values()):.1f} | "
                         f"{sum(kn.values()) - sum(ko.values()):+.1f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.compare:
        print(compare(*args.compare))
        return
    run(args)


if __name__ == "__main__":
    main()
