#!/usr/bin/env python3
"""Model-level GDN benchmark: a stack of L GDN layers with their MLPs, per micro-batch.

On the GPU host, from the repo root (one GPU; FLA wheels in .whl/fla042 and .whl/fla041)::

    tools/bench-gdn --model --matrix --out "$OUT/model"

which installs the wheels and runs ``python3 bench/gdn_model.py --fla041-site
/tmp/gdn-site-041 --out results/bench/model``. The same, directly, when FLA 0.4.2 is
importable and FLA 0.4.1 is installed (``pip install --target DIR``) in ``DIR``::

    python3 bench/gdn_model.py --out results/bench/model --fla041-site DIR

Each block is ``x + GDN(RMSNorm(x))`` then ``x + MLP(RMSNorm(x))`` (SwiGLU, ``--ffn-hidden``)
at the Qwen3.5-9B GDN geometry (hidden 4096, 16 key / 32 value heads, head dim 128, conv 4),
bf16, TP=1; one micro-batch is forward + backward of the whole stack, with activation
recompute (Megatron's ``tensor_parallel.checkpoint`` around each block) on or off, on packed
THD (``--samples`` equal samples; a new ``PackedSeqParams`` with device ``cu_seqlens`` per
micro-batch, as a data pipeline makes it) or SBHD (batch 1).

Modes: ``chunkwise``, ``headwise``, ``all_gather`` (patched tree, FLA 0.4.2), ``ideal`` (the
patched stack at CP=1 on T/P tokens, no communication) and ``old_headwise`` (the base tree,
the old image's headwise path, FLA 0.4.1 from ``--fla041-site``; skipped, with the reason in
the JSON, when that is not given). Every mode runs with L in ``--layers`` (default 2 and 8).

* CP=1: timings (tokens/s from the median of ``--repeats`` CUDA-event-timed micro-batches),
  peak memory, and host syncs. At CP=1 the three patched modes take the same path.
* CP=2/4 (``--cp``): ranks share one GPU over gloo (NCCL refuses two ranks on one GPU): the
  sync counts are valid there, the timings are not (recorded with ``timings_valid: false``).

Host syncs per micro-batch are counted under ``torch.cuda.set_sync_debug_mode("warn")``, each
attributed to the first stack frame in ``megatron/`` or ``fla/`` (innermost first; ``other:``
or ``unattributed`` otherwise) and to forward or backward; cross-checked by counting the
profiler's synchronising CUDA runtime calls (``cudaStreamSynchronize`` and friends) in another
micro-batch. On the patched THD path they are counted twice: as the layers see a fresh
``PackedSeqParams`` (the first GDN layer builds the micro-batch's metadata: one host copy) and
after the data path finalized it (``megatron.core.context_parallel_layout.
finalize_packed_seq_params(psp)``, upstream dev's call; its own syncs reported apart, and the
metadata builds the layers still made, which must be 0). Trees of issues 24-42 have
``gdn_context_parallel.attach_cu_seqlens_cpu`` instead: it is measured in the same place
(``finalized_by`` names the call).

Writes ``<out>/gdn_model.json`` (every run, plus ``meta``) and ``<out>/parts/*.json`` (one per
worker launch); prints one line per run. ``--cpu-smoke`` runs a tiny geometry on CPU with gloo
and FLA stand-ins (plumbing only: no sync counts, meaningless timings).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import signal
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCHED_MODES = ("chunkwise", "headwise", "all_gather")
MODES = PATCHED_MODES + ("ideal", "old_headwise")
LAYOUTS = ("thd", "sbhd")
# the runtime calls that block the host until the device drains (as bench/profile_attr.py counts them)
SYNC_RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
ATTRIBUTED_ROOTS = ("megatron", "fla")
# --matrix: issue 24's one-GPU matrix in one device call (10 minutes at most). CP=1 timings on the
# full micro-batch in two alternated rounds per tree; every count-only launch on 8192 tokens (the
# counts do not depend on the token count: one host copy per micro-batch, or per segment and
# layer on the old image, with the same 8 segments).
MATRIX_DEFAULTS = {"cp": [1, 2, 4], "modes": list(PATCHED_MODES + ("ideal", "old_headwise")),
                   "layers": [2, 8], "layouts": ["thd", "sbhd"], "timed_layouts": ["thd"],
                   "recompute": ["off", "on"],
                   "rounds": 2, "count_tokens": 8192, "warmup": 2, "repeats": 6, "no_profile": True,
                   "deadline_s": 560, "timeout_s": 240}


def _csv(text, what, allowed=None, cast=str):
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"empty list of {what}")
    try:
        out = [cast(t) for t in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give {what}, comma-separated") from None
    if allowed is not None:
        bad = [t for t in out if t not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(str, bad))}; pick from {', '.join(map(str, allowed))}")
    if cast is int and any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"{text!r}: {what} must be positive")
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"{text!r} names a value twice")
    return out


def parse_args(argv=None):
    """Parse and check the command line; errors exit 2 with a message naming the option."""
    class Fmt(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Fmt)
    p.add_argument("--out", default=os.path.join(ROOT, "results/raw/bench/model"),
                   help="directory for gdn_model.json and parts/")
    p.add_argument("--tree", default=os.path.join(ROOT, "build/tree/patched"))
    p.add_argument("--base-tree", default=os.path.join(ROOT, "build/tree/base"))
    p.add_argument("--fla041-site", default=None,
                   help="directory holding FLA 0.4.1 (pip --target); needed for old_headwise")
    p.add_argument("--modes", default=",".join(MODES), type=lambda t: _csv(t, "modes", MODES))
    p.add_argument("--layers", default="2,8", type=lambda t: _csv(t, "layer counts", cast=int))
    p.add_argument("--cp", default="1,2,4", type=lambda t: _csv(t, "CP sizes", cast=int))
    p.add_argument("--layouts", default="thd,sbhd", type=lambda t: _csv(t, "layouts", LAYOUTS))
    p.add_argument("--timed-layouts", default=None, type=lambda t: _csv(t, "layouts", LAYOUTS),
                   help="layouts of the CP=1 timed launches (default --layouts; count-only launches "
                   "take --layouts)")
    p.add_argument("--recompute", default="off,on",
                   type=lambda t: _csv(t, "recompute settings", ("off", "on")))
    p.add_argument("--tokens", type=int, default=32768, help="global tokens per micro-batch")
    p.add_argument("--samples", type=int, default=8, help="packed THD: equal samples per micro-batch")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--value-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--conv-kernel", type=int, default=4)
    p.add_argument("--ffn-hidden", type=int, default=12288)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10, help="timed micro-batches (CP=1)")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the profiler cross-check of the sync counts")
    p.add_argument("--timeout-s", type=int, default=1800,
                   help="per worker launch; a launch killed at the limit keeps the runs it finished")
    p.add_argument("--rounds", type=int, default=1,
                   help="CP=1 timed launches per tree, alternated between the trees (ABBA...); rounds "
                   "after the first time only (no sync counts)")
    p.add_argument("--count-tokens", type=int, default=None,
                   help="global tokens of the count-only launches (CP>1, and CP=1's headwise/all_gather, "
                   "which take chunkwise's path at CP=1); default --tokens")
    p.add_argument("--deadline-s", type=int, default=0,
                   help="wall-clock budget of the whole call (0: none): each launch gets what is left, "
                   "launches that cannot start are recorded as skipped")
    p.add_argument("--matrix", action="store_true",
                   help="issue 24's whole one-GPU matrix in one call: the defaults become " + ", ".join(
                       f"--{k.replace('_', '-')} {v}" for k, v in MATRIX_DEFAULTS.items()
                       if k not in ("no_profile",)) + " (options given explicitly still win)")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # JSON job (internal)
    # a first pass finds --matrix however it is spelled (argparse takes --matr for it); the
    # preset then becomes the defaults, so options given explicitly still win
    if p.parse_known_args(argv)[0].matrix:
        p.set_defaults(**MATRIX_DEFAULTS)
    args = p.parse_args(argv)
    if args.count_tokens is None:
        args.count_tokens = args.tokens
    if args.timed_layouts is None:
        args.timed_layouts = args.layouts
    for flag in ("tokens", "samples", "hidden", "key_heads", "value_heads", "head_dim",
                 "conv_kernel", "ffn_hidden", "repeats", "rounds", "count_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.deadline_s < 0:
        p.error("--deadline-s must be at least 0")
    if args.cpu_smoke and args.tokens == 32768:
        args.tokens, args.hidden, args.ffn_hidden, args.head_dim = 256, 128, 256, 32
        args.key_heads, args.value_heads = 4, 8
        args.count_tokens = min(args.count_tokens, args.tokens)
    # --tokens feeds the timed launches (--timed-layouts), --count-tokens the count-only ones
    for flag, T, layouts in (("--tokens", args.tokens, args.layouts + args.timed_layouts),
                             ("--count-tokens", args.count_tokens, args.layouts)):
        if "thd" in layouts:
            bad = [P for P in args.cp if T % args.samples or (T // args.samples) % (2 * P)]
            if bad:
                p.error(f"{flag} {T} as --samples {args.samples} does not split into 2*CP chunks "
                        f"per sample for CP {bad}; pick {flag} divisible by samples*2*CP")
        bad = [P for P in args.cp if T % (2 * P)]
        if bad:
            p.error(f"{flag} {T} is not divisible by 2*CP for CP {bad}")
    if os.path.isfile(args.out):
        p.error(f"--out {args.out} is a file; give a directory")
    if os.path.islink(args.out) and not os.path.exists(args.out):
        p.error(f"--out {args.out} is a link to nothing ({os.readlink(args.out)}); give a directory")
    return args


# --------------------------------------------------------------------------------------
# sync attribution (pure functions, unit-tested on CPU)
# --------------------------------------------------------------------------------------


def attribute_frame(frames, roots=ATTRIBUTED_ROOTS):
    """``file:line`` of the first frame (innermost first) inside one of ``roots``.

    Args:
        frames: ``(filename, lineno)`` pairs, outermost first (as ``traceback.extract_stack``).
        roots: top-level package directories to attribute to (``megatron``, ``fla``).

    Returns:
        ``"megatron/core/ssm/gdn_context_parallel.py:301"`` (the path from the last ``/<root>/``
        of the file name), else ``"other:<file>:<line>"`` for the innermost frame outside
        torch, warnings and this script, else ``"unattributed"``.
    """
    frames = [(str(f).replace("\\", "/"), int(n)) for f, n in frames]
    for name, line in reversed(frames):
        cut = max(name.rfind(f"/{r}/") for r in roots)
        if cut >= 0:
            return f"{name[cut + 1:]}:{line}"
    for name, line in reversed(frames):
        if "/torch/" in name or name.endswith(("/warnings.py", "/gdn_model.py")) or name.startswith("<"):
            continue
        return f"other:{os.path.basename(name)}:{line}"
    return "unattributed"


def is_sync_warning(message) -> bool:
    """Whether a warning is torch's sync-debug report of a synchronising CUDA call."""
    return "synchroniz" in str(message).lower()


def summarize_syncs(records):
    """Per micro-batch sync summary from ``[{"site", "phase"}]`` records.

    Returns ``{"total", "forward", "backward", "sites": {site: n}}`` (sites sorted by count,
    then name, so the JSON is deterministic).
    """
    sites = {}
    for r in records:
        sites[r["site"]] = sites.get(r["site"], 0) + 1
    return {
        "total": len(records),
        "forward": sum(r["phase"] == "forward" for r in records),
        "backward": sum(r["phase"] == "backward" for r in records),
        "sites": dict(sorted(sites.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def growth_per_layer(runs):
    """Syncs per extra GDN layer: for each (tree mode, cp, layout, recompute), the slope of the
    total sync count between the smallest and the largest L. ``0.0`` means the count does not
    grow with L (the goal). Returns ``[{"mode", "cp", "layout", "recompute", "layers",
    "syncs", "per_extra_layer"}]`` sorted."""
    groups = {}
    for r in runs:
        if r.get("host_syncs") is None:
            continue
        key = (r["mode"], r["cp"], r["layout"], r["recompute"])
        groups.setdefault(key, {})[r["layers"]] = r["host_syncs"]["total"]
    out = []
    for key in sorted(groups):
        by_l = groups[key]
        if len(by_l) < 2:
            continue
        lo, hi = min(by_l), max(by_l)
        out.append({"mode": key[0], "cp": key[1], "layout": key[2], "recompute": key[3],
                    "layers": [lo, hi], "syncs": [by_l[lo], by_l[hi]],
                    "per_extra_layer": round((by_l[hi] - by_l[lo]) / (hi - lo), 3)})
    return out


def plan_jobs(args):
    """Worker launches, in the order they run (most wanted first, so a ``--deadline-s`` cuts
    the least wanted): ``[{"name", "tree", "world", "cp", "modes",
    "tokens", "timed", "counts", "round"}]`` (``ideal_for`` on the ideal launches), plus
    ``skipped`` reasons.

    CP=1: one timed launch per tree and round; rounds alternate which tree goes first (patched,
    base; base, patched; ...) so a drift of the GPU's clocks over the call shows in both. Only
    round 1 counts syncs. At CP=1 the three patched modes take the same path: chunkwise is
    timed, headwise and all_gather are counted (``patched-cp1-modes``, ``--count-tokens``).
    CP>1: count-only launches on ``--count-tokens`` tokens (ranks share one GPU). ``ideal`` for
    CP=P: the patched stack at CP=1 on ``--tokens``/P tokens, timed."""
    jobs, skipped = [], []
    patched = [m for m in args.modes if m in PATCHED_MODES]
    old = "old_headwise" in args.modes
    if old and not args.fla041_site:
        skipped.append({"mode": "old_headwise", "why": "no --fla041-site (FLA 0.4.1) given"})
        old = False

    def job(name, tree, P, modes, tokens, timed, counts=True, rnd=1, **extra):
        return dict({"name": name, "tree": tree, "world": P, "cp": P,
                     "modes": modes, "tokens": tokens, "timed": timed, "counts": counts, "round": rnd},
                    **extra)

    def cp1_round(rnd):
        pair = []
        suffix = "" if rnd == 1 else f"-r{rnd}"
        if patched:
            pair.append(job(f"patched-cp1{suffix}", "patched", 1, patched[:1], args.tokens, True,
                            counts=rnd == 1, rnd=rnd))
        if old:
            pair.append(job(f"base-cp1{suffix}", "base", 1, ["old_headwise"], args.tokens, True,
                            counts=rnd == 1, rnd=rnd))
        return pair if rnd % 2 else pair[::-1]

    if 1 in args.cp:
        for rnd in range(1, args.rounds + 1):
            jobs += cp1_round(rnd)
        if patched[1:]:
            jobs.append(job("patched-cp1-modes", "patched", 1, patched[1:], args.count_tokens, False))
    for P in args.cp:
        if P == 1:
            continue
        if patched:
            jobs.append(job(f"patched-cp{P}", "patched", P, patched, args.count_tokens, False))
        if old:
            jobs.append(job(f"base-cp{P}", "base", P, ["old_headwise"], args.count_tokens, False))
    for P in args.cp:
        if "ideal" in args.modes and P > 1:
            jobs.append(job(f"ideal-p{P}", "patched", 1, ["ideal"], args.tokens // P, True, ideal_for=P))
    return jobs, skipped


# --------------------------------------------------------------------------------------
# the worker (one process per rank)
# --------------------------------------------------------------------------------------


def _import_layer_bench():
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import gdn_layer

    return gdn_layer


class _Stack:
    """L blocks ``x + GDN(norm(x))``, ``x + MLP(norm(x))``; GDN from the tree under test."""

    def __init__(self, torch, args, gdn_layers, device, dtype):
        nn = torch.nn
        self.torch, self.blocks = torch, []
        gen = torch.Generator().manual_seed(7)
        for gdn in gdn_layers:
            blk = nn.ModuleDict({
                "norm1": nn.RMSNorm(args.hidden, eps=1e-6), "gdn": gdn,
                "norm2": nn.RMSNorm(args.hidden, eps=1e-6),
                "fc1": nn.Linear(args.hidden, 2 * args.ffn_hidden, bias=False),
                "fc2": nn.Linear(args.ffn_hidden, args.hidden, bias=False)})
            with torch.no_grad():
                for name in ("fc1", "fc2"):
                    w = blk[name].weight
                    w.copy_(torch.randn(w.shape, generator=gen) / w.shape[1] ** 0.5)
            for name in ("norm1", "norm2", "fc1", "fc2"):
                blk[name].to(device=device, dtype=dtype)
            self.blocks.append(blk)

    def block_fn(self, blk, psp):
        F = self.torch.nn.functional

        def fn(x):
            y, _ = blk["gdn"](blk["norm1"](x), None, packed_seq_params=psp)
            x = x + y
            a, b = blk["fc1"](blk["norm2"](x)).chunk(2, dim=-1)
            return x + blk["fc2"](F.silu(a) * b)
        return fn

    def zero_grad(self):
        for blk in self.blocks:
            blk.zero_grad(set_to_none=True)


def _checkpoint(torch, cpu):
    if cpu:
        from torch.utils.checkpoint import checkpoint

        return lambda fn, x: checkpoint(fn, x, use_reentrant=False)
    from megatron.core import tensor_parallel

    return lambda fn, x: tensor_parallel.checkpoint(fn, False, x)


def _make_psp(torch, layout, tokens, samples, device):
    if layout == "sbhd":
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    n = tokens // samples
    cu = torch.arange(samples + 1, dtype=torch.int32, device=device) * n
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=n, max_seqlen_kv=n)


def count_syncs(torch, fn, phase):
    """Run ``fn()`` under ``set_sync_debug_mode("warn")``; ``phase`` is a dict whose ``"now"``
    ``fn`` sets to ``forward``/``backward``. Returns ``[{"site", "phase"}]``, one per
    synchronising call (see :func:`attribute_frame`)."""
    import traceback as tb
    import warnings

    records = []

    def hook(message, category, filename, lineno, file=None, line=None):
        if is_sync_warning(message):
            frames = [(f.filename, f.lineno) for f in tb.extract_stack()[:-1]]
            records.append({"site": attribute_frame(frames), "phase": phase["now"]})

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return records


def count_runtime_syncs(torch, fn):
    """Synchronising CUDA runtime calls made by ``fn()``, counted by name with torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    counts = {}
    for e in prof.events():
        if e.name in SYNC_RUNTIME_CALLS:
            counts[e.name] = counts.get(e.name, 0) + 1
    return dict(sorted(counts.items()))


def _worker(args, job):
    import torch
    import torch._dynamo
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(ROOT, "tests", "image"))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    lb = _import_layer_bench()
    cpu = args.cpu_smoke
    if cpu:
        from _world import install_cpu_device_shim

        install_cpu_device_shim()
        backend, device, dtype = "gloo", torch.device("cpu"), torch.float32
    else:
        lb.install_autotune_policy("per-width")
        ngpu = torch.cuda.device_count()
        device = torch.device("cuda", rank % ngpu)
        torch.cuda.set_device(device)
        backend, dtype = ("nccl" if world <= ngpu else "gloo"), torch.bfloat16
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world, **kw)
    meta = {"backend": backend, "world": world, "torch": torch.__version__}
    try:
        import fla

        meta["fla"] = fla.__version__
        if backend == "gloo" and not cpu and fla.__version__ == "0.4.2":
            import fla_gloo

            meta["fla_gloo_shim"] = fla_gloo.install()
    except Exception as exc:  # noqa: BLE001 - recorded
        meta["fla"] = f"unavailable: {exc!r}"
    stack_ctx = None
    if cpu:
        import fla_emulation

        stack_ctx = fla_emulation.emulated_fla_in_megatron()
        stack_ctx.__enter__()
    pg = lb.init_mpu(job["cp"], args)
    ckpt = _checkpoint(torch, cpu)
    runs, errors = [], []

    def dump():  # after every run, so a launch killed at its time limit keeps what it measured
        if rank == 0:
            with open(job["part"] + ".tmp", "w") as f:
                json.dump({"job": job, "meta": meta, "runs": runs, "errors": errors, "rank": rank}, f,
                          indent=1, sort_keys=True)
            os.replace(job["part"] + ".tmp", job["part"])

    T, P = job["tokens"], job["cp"]
    local = T // P
    for mode in job["modes"]:
        layer_mode = "headwise" if mode in ("ideal", "old_headwise") else mode
        torch._dynamo.reset()
        try:
            gdns = [lb.build_layer(args, layer_mode, P, pg, torch, dtype) for _ in range(max(args.layers))]
            stack = _Stack(torch, args, gdns, device, dtype)
        except Exception as exc:  # noqa: BLE001 - recorded, next mode
            errors.append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            traceback.print_exc()
            continue
        for layout in (args.timed_layouts if job["timed"] else args.layouts):
            for recompute in args.recompute:
                for L in args.layers:
                    if job.get("stop_at") and time.time() > job["stop_at"]:
                        # the launch's time limit is near: start nothing more (a run the driver
                        # kills mid-way would leave its GPU work running into the next launch)
                        errors.append({"mode": mode, "layout": layout, "recompute": recompute, "layers": L,
                                       "error": "not started: the launch's time limit was near"})
                        continue
                    rec = {"mode": mode, "cp": P, "layers": L, "layout": layout, "recompute": recompute,
                           "tokens": T, "local_tokens": local, "samples": args.samples if layout == "thd" else 1,
                           "tree": job["tree"], "timings_valid": bool(job["timed"]) and not cpu,
                           "round": job.get("round", 1)}
                    if "ideal_for" in job:
                        rec["ideal_for_cp"] = job["ideal_for"]
                    try:
                        rec.update(_measure(torch, dist, args, stack, L, layout, recompute == "on", ckpt,
                                            T, local, device, dtype, job, cpu))
                        runs.append(rec)
                        if rank == 0:
                            print(_line(rec), flush=True)
                    except Exception as exc:  # noqa: BLE001 - recorded (e.g. OOM), next run
                        errors.append(dict(rec, error=f"{type(exc).__name__}: {exc}"[:2000]))
                        if rank == 0:
                            traceback.print_exc()
                    finally:
                        if not cpu:
                            torch.cuda.empty_cache()
                        dump()
        del stack, gdns
    dump()
    if stack_ctx is not None:
        stack_ctx.__exit__(None, None, None)
    dist.barrier()
    dist.destroy_process_group()
    return {"job": job, "meta": meta, "runs": runs, "errors": errors, "rank": rank}


def _measure(torch, dist, args, stack, L, layout, recompute, ckpt, T, local, device, dtype, job, cpu):
    gen = torch.Generator().manual_seed(11)
    x0 = torch.randn(local, 1, args.hidden, generator=gen).to(device=device, dtype=dtype)
    gy = torch.randn(local, 1, args.hidden, generator=gen).to(device=device, dtype=dtype)
    blocks = stack.blocks[:L]
    phase = {"now": "forward"}

    def micro_batch(psp, per_layer=False):
        stack.zero_grad()
        phase["now"] = "forward"
        h = x0.detach().requires_grad_(True)
        for blk in blocks:
            fn = stack.block_fn(blk, fresh() if per_layer else psp)
            h = ckpt(fn, h) if recompute else fn(h)
        phase["now"] = "backward"
        h.backward(gy)

    def fresh():
        return _make_psp(torch, layout, T, args.samples, device)

    for _ in range(args.warmup):
        micro_batch(fresh())
    out = {}
    if not cpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats if job["timed"] else 1):
        psp = fresh()
        dist.barrier()
        t = lb_timer(torch, cpu)
        with t:
            micro_batch(psp)
        times.append(t.ms)
    med = statistics.median(times)
    out.update(median_ms=round(med, 3), min_ms=round(min(times), 3), tokens_per_s=round(T / (med / 1e3), 1),
               times_ms=[round(v, 3) for v in times])
    if cpu:
        out["host_syncs"] = None
        return out
    out["peak_alloc_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    out["peak_reserved_mib"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
    if not job.get("counts", True):
        out["host_syncs"] = None
        return out
    psp = fresh()
    out["host_syncs"] = summarize_syncs(count_syncs(torch, lambda: micro_batch(psp), phase))
    gcp = sys.modules.get("megatron.core.ssm.gdn_context_parallel")
    # issue 43's finalize_packed_seq_params, else the attach of issues 24-42 (older trees: neither)
    by = next((n for n in ("finalize_packed_seq_params", "attach_cu_seqlens_cpu") if hasattr(gcp, n)), None)
    if layout == "thd" and by is not None:
        psp = fresh()
        finalize = count_syncs(torch, lambda: getattr(gcp, by)(psp), phase)
        out["finalized_by"] = by
        out["finalize_syncs"] = len(finalize)
        counts = getattr(gcp, "PACKED_METADATA_COUNTS", None)
        built = counts["layer_built"] if counts is not None else None
        out["host_syncs_finalized"] = summarize_syncs(count_syncs(torch, lambda: micro_batch(psp), phase))
        if counts is not None:  # the layers must only read a finalized micro-batch's metadata
            out["layer_builds_finalized"] = counts["layer_built"] - built
        if by == "finalize_packed_seq_params":
            # a loader that has the boundaries on the host (Bridge's Qwen3-VL repack, a user loop):
            # finalize_packed_seq_params(psp, cu_seqlens_cpu=...) makes no copy at all
            psp = fresh()
            host = torch.arange(args.samples + 1, dtype=torch.int32) * (T // args.samples)
            finalize = count_syncs(torch, lambda: gcp.finalize_packed_seq_params(psp, cu_seqlens_cpu=host), phase)
            out["finalize_host_syncs"] = len(finalize)
            built = counts["layer_built"]
            out["host_syncs_finalized_host"] = summarize_syncs(count_syncs(torch, lambda: micro_batch(psp), phase))
            out["layer_builds_finalized_host"] = counts["layer_built"] - built
        # "before": the patched tree as it was before issue 24 made one host copy per GDN layer;
        # a PackedSeqParams of its own per layer gives every layer that copy again (emulated)
        out["host_syncs_before"] = summarize_syncs(count_syncs(torch, lambda: micro_batch(None, True), phase))
    if not args.no_profile:
        psp = fresh()
        out["runtime_sync_calls"] = count_runtime_syncs(torch, lambda: micro_batch(psp))
    return out


def lb_timer(torch, cpu):
    return _import_layer_bench().Timer(torch, cpu)


def _line(r):
    s = r.get("host_syncs") or {}
    a = r.get("host_syncs_finalized") or r.get("host_syncs_attached")  # the latter: results before issue 43
    b = r.get("host_syncs_before")
    return (f"{r['mode']:12s} cp={r['cp']} L={r['layers']} {r['layout']} recompute={r['recompute']:3s} "
            f"{r['tokens_per_s']:>12.1f} tok/s{'' if r['timings_valid'] else ' (timing n/a)'} "
            f"peak {r.get('peak_alloc_mib', 0):.0f} MiB syncs {s.get('total')} "
            f"(fwd {s.get('forward')}, bwd {s.get('backward')})"
            + (f" finalized {a['total']} + finalize {r.get('finalize_syncs', r.get('attach_syncs'))}" if a else "")
            + (f" before {b['total']}" if b else "")
            + (f" {s.get('sites')}" if s.get("sites") else ""))


# --------------------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------------------


def _launch(args, job, part, argv, timeout):
    """Run one worker launch (``job["world"]`` ranks) in a fresh process group and session;
    returns its exit code, 124 when it ran past ``timeout`` seconds (the whole session is then
    killed, so no rank is left holding the GPU for the next launch)."""
    tree = args.tree if job["tree"] == "patched" else args.base_tree
    env = dict(os.environ)
    # the tree (and for the base tree FLA 0.4.1) first, ahead of whatever FLA the environment has
    first = [args.fla041_site, tree] if job["tree"] == "base" else [tree]
    env["PYTHONPATH"] = os.pathsep.join(first + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if args.cpu_smoke:  # plumbing only: keep the jit_fuser helpers eager (Inductor on CPU takes minutes)
        env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(job["world"]), os.path.abspath(__file__), *argv, "--worker", json.dumps(dict(job, part=part))]
    print(f"gdn_model: launch {job['name']} ({job['world']} rank(s), at most {timeout:.0f} s)",
          file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:  # a driver SIGTERM'd by its host ends the launch first (below), then exits 143
        prev = signal.signal(signal.SIGTERM, _sigterm_exits)
    except ValueError:  # not the main thread: no handler of ours
        prev = None
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_session(proc)
        return 124
    except BaseException:
        # Ctrl-C or SIGTERM on the driver: its own session keeps the launch out of the
        # terminal's signals, so end it here rather than leave ranks running on the GPU
        _end_session(proc)
        raise
    finally:
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)


def _sigterm_exits(signum, frame):
    raise SystemExit(128 + signum)


def _killpg(pgid, sig):
    """``os.killpg`` that ignores a group already gone (it exited as its limit passed)."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _end_session(proc):
    """SIGTERM to the launch's process group (torchrun passes it on to its workers), 20 s to
    exit, then SIGKILL to whatever of the group is left (a rank torchrun left behind)."""
    _killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    _killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        sys.path.insert(0, args.tree if job["tree"] == "patched" else args.base_tree)
        _worker(args, job)
        return 0
    for what, tree in (("--tree", args.tree), ("--base-tree", args.base_tree)):
        if not os.path.isfile(os.path.join(tree, "megatron", "core", "ssm", "gated_delta_net.py")):
            if what == "--base-tree" and "old_headwise" not in args.modes:
                continue
            print(f"gdn_model.py: {what} {tree} holds no megatron/core/ssm/gated_delta_net.py; build the "
                  "trees with `make patch` (or tools/backport --upstream 5139086e)", file=sys.stderr)
            return 2
    jobs, skipped = plan_jobs(args)
    os.makedirs(os.path.join(args.out, "parts"), exist_ok=True)
    result = {"meta": {"argv": argv, "started": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "geometry": {
            "hidden": args.hidden, "key_heads": args.key_heads, "value_heads": args.value_heads,
            "head_dim": args.head_dim, "conv_kernel": args.conv_kernel, "ffn_hidden": args.ffn_hidden},
        "tokens": args.tokens, "samples": args.samples, "warmup": args.warmup, "repeats": args.repeats,
        "patch_sha256": _import_layer_bench()._patch_sha256(), "workers": {}},
        "runs": [], "errors": [], "skipped": skipped}
    rc = 0
    t0 = time.monotonic()
    for job in jobs:
        part = os.path.join(os.path.abspath(args.out), "parts", f"{job['name']}.json")
        if os.path.exists(part):
            os.remove(part)
        timeout = float(args.timeout_s)
        if args.deadline_s:
            left = args.deadline_s - (time.monotonic() - t0)
            if left < 30:
                result["skipped"].append({"job": job["name"], "why": f"--deadline-s {args.deadline_s} "
                                          f"reached ({left:.0f} s left); give a longer deadline or fewer jobs"})
                rc = 1
                continue
            timeout = min(timeout, left)
        started = time.monotonic()
        # the workers start no run later than this (wall clock: they are other processes); the
        # margin is one L=8 micro-batch set at 32768 tokens, at most a quarter of a short limit
        # (a limit under 45 s would otherwise start nothing at all)
        job = dict(job, stop_at=time.time() + timeout - min(45.0, timeout / 4))
        code = _launch(args, job, part, argv, timeout)
        result["meta"].setdefault("launch_s", {})[job["name"]] = round(time.monotonic() - started, 1)
        if code:
            result["errors"].append({"job": job["name"], "error": f"worker launch exited {code} (124: "
                                     f"its time limit of {timeout:.0f} s); its runs so far are kept"})
            rc = 1
        if not os.path.exists(part):
            continue
        with open(part) as f:
            res = json.load(f)
        result["meta"]["workers"][job["name"]] = res["meta"]
        result["runs"].extend(res["runs"])
        result["errors"].extend(dict(e, job=job["name"]) for e in res["errors"])
    result["growth_per_layer"] = growth_per_layer(result["runs"])
    with open(os.path.join(args.out, "gdn_model.json"), "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
        f.write("\n")
    for g in result["growth_per_layer"]:
        print(f"growth {g['mode']:12s} cp={g['cp']} {g['layout']} recompute={g['recompute']}: syncs "
              f"{g['syncs'][0]} (L={g['layers'][0]}) -> {g['syncs'][1]} (L={g['layers'][1]}), "
              f"{g['per_extra_layer']} per extra layer")
    print(os.path.join(args.out, "gdn_model.json"))
    return rc or (1 if result["errors"] else 0)


if __name__ == "__main__":
    sys.exit(main())
