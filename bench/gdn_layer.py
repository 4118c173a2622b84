#!/usr/bin/env python3
"""Benchmark the patched MCore ``GatedDeltaNet`` layer under context parallelism.

Run with torchrun on a multi-GPU host (see ``tools/bench-gdn``)::

    torchrun --nproc_per_node 4 bench/gdn_layer.py --out results.json

For every CP size P (default 2 and 4; the world is split into world/P CP groups that run
concurrently, TP=1), every global sequence length T and every mode in
headwise/all_gather/chunkwise, one layer runs forward+backward in bf16 on its rank's
zigzag shard ``[T/P, 1, hidden]`` (SBHD, batch 1; or, with ``--samples N``, packed THD of N
equal samples, which makes the chunkwise path rebuild its route and ``cp_context`` from
device-resident ``cu_seqlens`` every step). "ideal" is the CP=1 layer on T/P
tokens with no communication. Per configuration: warm-ups, then repeats timed with CUDA
events around fwd+bwd (ranks aligned by a barrier before each repeat); the per-repeat
time is the max over ranks. Peak allocated/reserved memory (max over ranks) is measured
over the timed repeats after ``reset_peak_memory_stats``.

Autotuning (``--autotune``): FLA's ``causal_conv1d`` and ``l2norm`` kernels autotune with
``NB`` (number of 1024-token blocks, i.e. the sequence length) in their key, so every new
(mode, T) re-ran ~50 s of compile-and-benchmark on 4x H200 (measured, FLA 0.4.2). The default
``per-width`` drops ``NB`` from those keys: each kernel is tuned once per channel width, at the
first (largest) length the sweep meets (lengths run in descending order), and that config is
reused at other lengths (compiled once per length). ``full`` keeps FLA's keys. The GDN scan
kernels are unaffected (their keys have no sequence length).

Baseline (the old image's path): ``--tree build/tree/base --modes headwise --label old_headwise``
with FLA 0.4.1 first on ``PYTHONPATH``; the base ``TransformerConfig`` has no
``linear_cp_mode`` and only the headwise path, so the option is left out there.

``--cpu-smoke`` runs a tiny geometry on CPU with gloo and the FLA CPU stand-ins of
``tests/image/fla_emulation.py`` (plumbing check only; timings meaningless).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SEQ = "8192,16384,32768,65536,131072"
MODES = ("headwise", "all_gather", "chunkwise", "chunkwise_upstream_layout")


def parse_args(argv=None):
    class Fmt(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Fmt)
    p.add_argument("--tree", default=os.environ.get("GDN_TREE", os.path.join(ROOT, "build/tree/patched")))
    p.add_argument("--out", default=os.path.join(ROOT, "results/raw/bench/gdn_layer.json"))
    p.add_argument("--cp", default="2,4", help="comma-separated CP sizes")
    p.add_argument("--seq", default=None,
                   help="global sequence lengths, run longest first (default 8192,...,131072; "
                        "with --cpu-smoke 512)")
    p.add_argument("--modes", default="headwise,all_gather,chunkwise,ideal",
                   help="comma-separated: headwise, all_gather, chunkwise, chunkwise_upstream_layout "
                        "(chunkwise converting the layout where upstream does, on the wider in_proj "
                        "output and normalised output), ideal (the CP=1 layer on T/P tokens)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--value-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--conv-kernel", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=1e9,
                   help="stop starting new configurations after this many seconds")
    p.add_argument("--profile", type=int, default=0,
                   help="global length T (one of --seq, e.g. 32768) at which one step of each of "
                        "headwise, chunkwise and chunkwise_upstream_layout (those in --modes) is "
                        "profiled right after its timing runs and attributed part by part "
                        "(bench/profile_attr.py); stored under 'profiles' in --out")
    p.add_argument("--label", default="", help="record the runs of --modes under this mode name "
                   "(e.g. old_headwise for the base tree)")
    p.add_argument("--autotune", choices=["per-width", "full"], default="per-width",
                   help="FLA conv/l2norm autotuning: once per channel width, or FLA's per-length keys")
    p.add_argument("--prepare-qkv", choices=["tree", "jit_fuser", "eager"], default="tree",
                   help="how GatedDeltaNet._prepare_qkv_for_gated_delta_rule runs: as the tree has it "
                        "(base: @jit_fuser, patched: @torch.compiler.disable), under megatron.core.jit."
                        "jit_fuser, or eager (the old/new headwise split experiment)")
    p.add_argument("--samples", type=int, default=1,
                   help="1: SBHD batch 1; N > 1: packed THD of N equal samples of T/N tokens each "
                        "(cu_seqlens on the device, so the chunkwise route and cp_context are rebuilt "
                        "every step, host syncs included); T/N must divide by 2*CP")
    p.add_argument("--cpu-smoke", action="store_true")
    return p.parse_args(argv)


def log(rank, *a):
    if rank == 0:
        print(*a, flush=True)


_NORM = None


def _harness():
    """``tests/image/gdn_harness`` (the suite's GDN config and builders), imported from the repo."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "image")
    if here not in sys.path:
        sys.path.append(here)
    import gdn_harness

    return gdn_harness


def make_norm_class(torch):
    """One module-level torch RMSNorm class (TE is absent); one type keeps Dynamo's guards stable."""
    global _NORM
    if _NORM is None:
        class TorchRMSNorm(torch.nn.Module):
            def __init__(self, config=None, hidden_size=None, eps=1e-6):
                super().__init__()
                self.norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)

            def forward(self, x):
                return self.norm(x)
        _NORM = TorchRMSNorm
    return _NORM


def set_prepare_qkv(policy):
    """Rebind ``GatedDeltaNet._prepare_qkv_for_gated_delta_rule`` for the split experiment.

    ``tree`` leaves the tree's decorator (base tree, MCore 85bced0a: ``@jit_fuser``, i.e. torch.compile;
    patched: ``@torch.compiler.disable``, the preserved downstream fix). ``eager`` runs the
    undecorated function, ``jit_fuser`` wraps it in ``megatron.core.jit.jit_fuser``.
    Raises ValueError when the method carries no decorator to strip (nothing to compare).
    """
    if policy == "tree":
        return
    import inspect

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    name = "_prepare_qkv_for_gated_delta_rule"
    decorated = GatedDeltaNet.__dict__.get(name)
    if decorated is None:
        raise ValueError(f"GatedDeltaNet defines no {name} in this tree; --prepare-qkv needs it: "
                         "use --prepare-qkv tree")
    raw = inspect.unwrap(decorated)
    if raw is decorated:
        raise ValueError(f"GatedDeltaNet.{name} has no decorator in this tree; --prepare-qkv "
                         f"{policy} would measure the tree as is: use --prepare-qkv tree")
    if policy == "jit_fuser":
        from megatron.core.jit import jit_fuser

        raw = jit_fuser(raw)
    setattr(GatedDeltaNet, name, raw)


def build_layer(args, mode, cp_size, pg_collection, torch, dtype):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    Norm = make_norm_class(torch)

    import dataclasses

    has_mode = "linear_cp_mode" in {f.name for f in dataclasses.fields(TransformerConfig)}
    if not has_mode and mode != "headwise":
        raise ValueError(f"this tree has no linear_cp_mode, so only headwise runs (asked: {mode}); "
                         "use the patched tree for other modes")
    # One config builder for the benchmark and the regression suite (tests/image/gdn_harness.py).
    H = _harness()
    geom = H.Geometry(hidden=args.hidden, k_heads=args.key_heads, v_heads=args.value_heads,
                      dk=args.head_dim, dv=args.head_dim, conv=args.conv_kernel)
    config = H.make_config(geom, cp=cp_size, mode=mode if has_mode else None, dtype=dtype,
                           cpu_init=args.cpu_smoke, num_attention_heads=args.key_heads,
                           perform_initialization=not args.cpu_smoke)
    sub = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=Norm, out_proj=RowParallelLinear)
    layer = GatedDeltaNet(config, sub, layer_number=1, pg_collection=pg_collection)
    layer = layer.to(device=dev(torch, args), dtype=dtype)
    if args.cpu_smoke:  # no CUDA RNG tracker on CPU: initialise by hand
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            layer.A_log.fill_(0.5)
            layer.dt_bias.fill_(1.0)
    return layer


def dev(torch, args):
    return torch.device("cpu") if args.cpu_smoke else torch.device("cuda", torch.cuda.current_device())


def init_mpu(cp_size, args):
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=cp_size)
    if not args.cpu_smoke:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    return ProcessGroupCollection(tp=ps.get_tensor_model_parallel_group(), cp=ps.get_context_parallel_group())


class Timer:
    def __init__(self, torch, cpu):
        self.torch, self.cpu = torch, cpu

    def __enter__(self):
        if self.cpu:
            self.t0 = time.perf_counter()
        else:
            self.e0 = self.torch.cuda.Event(enable_timing=True)
            self.e1 = self.torch.cuda.Event(enable_timing=True)
            self.e0.record()
        return self

    def __exit__(self, *exc):
        if self.cpu:
            self.ms = (time.perf_counter() - self.t0) * 1e3
        else:
            self.e1.record()
            self.e1.synchronize()
            self.ms = self.e0.elapsed_time(self.e1)


def packed_params(torch, T, samples, device):
    """``PackedSeqParams`` for ``samples`` equal sequences of ``T // samples`` tokens (THD), or
    None for ``samples == 1`` (SBHD). ``cu_seqlens`` are int32 on ``device``: [samples + 1]."""
    if samples == 1:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    n = T // samples
    cu = torch.arange(samples + 1, dtype=torch.int32, device=device) * n
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=n, max_seqlen_kv=n)


def check_samples(T, P, samples):
    """Raise ValueError unless ``samples`` sequences of T/samples tokens each split into 2*P
    zigzag chunks (the layout the patched GDN requires)."""
    if samples < 1 or T % samples or (T // samples) % (2 * P):
        raise ValueError(f"T={T} as {samples} samples does not split into 2*CP={2 * P} chunks per "
                         "sample; pick --samples so that T/samples divides by 2*CP")


def run_config(args, torch, dist, layer, local_len, repeats, warmup, dtype, psp=None):
    d = dev(torch, args)
    x = torch.randn(local_len, 1, args.hidden, device=d, dtype=dtype, requires_grad=True)
    gy = torch.randn(local_len, 1, args.hidden, device=d, dtype=dtype)

    def step():
        out, _ = layer(x, None, packed_seq_params=psp)
        out.backward(gy)

    for _ in range(warmup):
        step()
    if not args.cpu_smoke:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_alloc = torch.cuda.memory_allocated() if not args.cpu_smoke else 0
    times = []
    for _ in range(repeats):
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        dist.barrier()
        with Timer(torch, args.cpu_smoke) as t:
            step()
        times.append(t.ms)
    if args.cpu_smoke:
        mem = [0.0, 0.0, 0.0]
    else:
        mem = [torch.cuda.max_memory_allocated() / 2**20, torch.cuda.max_memory_reserved() / 2**20,
               base_alloc / 2**20]
    # one more step, untimed, counting the host syncs it makes (CUDA only)
    syncs = -1.0 if args.cpu_smoke else float(count_host_syncs(torch, step))
    # max over ranks, per repeat, for memory and for the sync count
    tt = torch.tensor(times + mem + [syncs], dtype=torch.float64, device=d if not args.cpu_smoke else "cpu")
    dist.all_reduce(tt, op=dist.ReduceOp.MAX)
    vals = tt.tolist()
    times, mem, syncs = vals[:repeats], vals[repeats:-1], vals[-1]
    del x, gy
    return times, mem, (int(syncs) if syncs >= 0 else None)


def count_host_syncs(torch, step):
    """Run ``step()`` once under ``torch.cuda.set_sync_debug_mode("warn")`` and return how many
    synchronizing CUDA calls it made (D2H copies, ``.item()``, boolean-mask indexing, ...).

    Every such call stalls the host until the GPU queue drains; on the chunkwise THD path they
    come from rebuilding the zigzag route and FLA's ``cp_context`` each step, which PR #5664's
    route cache would avoid. Returns an int >= 0. Measured on 2x H200, session 20:
    results/bench/cp2-s20/ (packed THD at CP=2: 64 per step before the host route, 2 after).
    """
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def summarize(times, mem, tokens, host_syncs=None):
    s = sorted(times)
    med = statistics.median(s)
    p90 = s[min(len(s) - 1, int(math.ceil(0.9 * len(s))) - 1)]
    return {
        "median_ms": round(med, 4), "min_ms": round(s[0], 4), "p90_ms": round(p90, 4),
        "tokens_per_s": round(tokens / (med / 1e3), 1),
        "peak_alloc_mib": round(mem[0], 1), "peak_reserved_mib": round(mem[1], 1),
        "steady_alloc_mib": round(mem[2], 1),
        "host_syncs_per_step": host_syncs,
        "times_ms": [round(t, 4) for t in times],
    }


# Functions the profiled step wraps in ``gdn::<name>`` ranges: module globals of
# megatron/core/ssm/gated_delta_net.py (looked up at call time, so rebinding them takes effect),
# then gdn_context_parallel's, then the layer's own methods and submodules. Missing names are
# skipped (the base tree lacks the CP ones).
PROFILED_GLOBALS = ("zigzag_to_contiguous_chunks", "contiguous_to_zigzag_chunks", "build_cp_context",
                    "causal_conv1d", "l2norm", "_split_query_key_value", "_expand_query_key_heads",
                    "tensor_a2a_cp2hp", "tensor_a2a_hp2cp")
PROFILED_CP_HELPERS = ("plan_linear_cp", "packed_seq_metadata", "check_sequence_lengths",
                       "check_kernel_extent", "gather_zigzag_sequence", "scatter_zigzag_sequence")
PROFILED_METHODS = ("_prepare_qkv_for_gated_delta_rule", "_compute_g_and_beta", "_apply_gated_norm",
                    "gated_delta_rule")
PROFILED_SUBMODULES = ("in_proj", "out_proj")  # out_norm runs inside the compiled _apply_gated_norm
PROFILED_MODES = ("headwise", "chunkwise", "chunkwise_upstream_layout")


class _UpstreamLayoutSP(int):
    """``sp_size`` of 1 that is not ``== 1``: the patched layer then converts zigzag <->
    contiguous on the in_proj output and the normalised output (upstream 5139086e's placement)
    instead of on the narrower hidden states, which it does only when ``self.sp_size == 1``.
    Every other use of ``sp_size`` multiplies by it, so nothing else changes. Bench-only lever
    for the same-call comparison of the two placements (mode ``chunkwise_upstream_layout``)."""

    def __eq__(self, other):
        return False

    def __ne__(self, other):
        return True

    __hash__ = int.__hash__


def _wrapped_in_ranges(layer):
    """Rebind the functions above to ``record_function("gdn::<name>")`` wrappers; returns the
    undo callable."""
    import importlib

    import megatron.core.ssm.gated_delta_net as gdn
    from torch.profiler import record_function

    try:  # the base tree (old image) has no gdn_context_parallel: its helpers are not wrapped
        cpx = importlib.import_module("megatron.core.ssm.gdn_context_parallel")
    except ImportError:
        cpx = None

    def ranged(fn, name):
        def w(*a, **k):
            with record_function(f"gdn::{name}"):
                return fn(*a, **k)
        return w
    undo = []
    for owner, names in ((gdn, PROFILED_GLOBALS), (cpx, PROFILED_CP_HELPERS)):
        if owner is None:
            continue
        for name in names:
            fn = getattr(owner, name, None)
            if callable(fn):
                setattr(owner, name, ranged(fn, name))
                undo.append(lambda o=owner, n=name, f=fn: setattr(o, n, f))
    for name in PROFILED_METHODS:
        if callable(getattr(layer, name, None)):
            had = name in vars(layer)
            old = vars(layer).get(name)
            setattr(layer, name, ranged(getattr(layer, name), name))
            undo.append(lambda n=name, h=had, o=old: setattr(layer, n, o) if h else delattr(layer, n))
    for name in PROFILED_SUBMODULES:
        mod = getattr(layer, name, None)
        if mod is not None:
            mod.forward = ranged(mod.forward, name)
            undo.append(lambda m=mod: delattr(m, "forward"))

    def restore():
        for u in reversed(undo):
            u()
    return restore


def profile_step(args, torch, dist, layer, local_len, dtype, psp=None, trace_out=None):
    """One forward+backward of ``layer`` under torch.profiler, attributed part by part.

    ``layer`` is already warm (the timing runs of the same mode and length ran just before);
    the input is this rank's zigzag shard ``[local_len, 1, hidden]`` in ``dtype`` (bf16 on the
    GPU), with ``psp`` for packed THD. Returns ``bench/profile_attr.attribute``'s dict for this
    rank (times in ms). On CPU (``--cpu-smoke``) only host activity is recorded."""
    import profile_attr
    from torch.profiler import ProfilerActivity, profile, record_function

    d = dev(torch, args)
    x = torch.randn(local_len, 1, args.hidden, device=d, dtype=dtype, requires_grad=True)
    gy = torch.randn(local_len, 1, args.hidden, device=d, dtype=dtype)
    sync = (lambda: None) if args.cpu_smoke else torch.cuda.synchronize
    restore = _wrapped_in_ranges(layer)
    try:
        for _ in range(2):
            out, _ = layer(x, None, packed_seq_params=psp)
            out.backward(gy)
        sync()
        dist.barrier()
        acts = [ProfilerActivity.CPU] + ([] if args.cpu_smoke else [ProfilerActivity.CUDA])
        with profile(activities=acts) as prof:
            with record_function("gdn::forward"):
                out, _ = layer(x, None, packed_seq_params=psp)
            sync()
            with record_function("gdn::backward"):
                out.backward(gy)
            sync()
    finally:
        restore()
    # The Chrome trace is kept beside --out (gzip) so that a step can be re-attributed offline.
    import gzip
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f:
            raw = f.read()
    if trace_out:
        os.makedirs(os.path.dirname(os.path.abspath(trace_out)) or ".", exist_ok=True)
        with gzip.open(trace_out, "wb", compresslevel=6) as f:
            f.write(raw)
    return profile_attr.attribute(profile_attr.events_from_chrome_trace(json.loads(raw)))


def install_autotune_policy(policy):
    """``per-width``: drop ``NB`` (sequence-length blocks) from every Triton autotune key.

    Must run before FLA is imported (its ``@triton.autotune`` decorators build the tuners at
    import). Returns the policy applied. Source of the keys: FLA 0.4.2
    ``fla/modules/conv/triton/kernels.py`` and ``fla/modules/l2norm.py`` (``key=[..., 'NB']``).
    """
    if policy != "per-width":
        return policy
    from triton.runtime import autotuner as at

    if getattr(at.Autotuner, "_gdn_per_width", False):
        return policy
    orig_init = at.Autotuner.__init__

    def __init__(self, *a, **k):
        orig_init(self, *a, **k)
        self.keys = [key for key in self.keys if key != "NB"]

    at.Autotuner.__init__ = __init__
    at.Autotuner._gdn_per_width = True
    return policy


def _patch_sha256():
    """sha256 of patches/latest/megatron.patch (the patch the measured tree was built from), or None."""
    import hashlib

    path = os.path.join(ROOT, "patches", "latest", "megatron.patch")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _refuse(msg):
    """Exit 2 (argparse's status for bad arguments) with ``gdn_layer.py: <msg>`` on stderr."""
    print(f"gdn_layer.py: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _positive_ints(flag, text, what, example):
    items = [t.strip() for t in (text or "").split(",") if t.strip()]
    if not items or not all(t.isdigit() and int(t) > 0 for t in items):
        _refuse(f"{flag} {text!r}: give positive {what}, comma-separated (e.g. {flag} {example})")
    return [int(t) for t in items]


def check_label(args):
    """Refuse bad arguments, and runs that report.py would merge under a name they do not deserve,
    before any work (no torch, no process group).

    Checks the numbers (--seq, --cp, --modes, counts), that --out is not a directory, and:
    ``--label`` names exactly one mode's runs and no ``ideal`` (an ideal run of another tree or
    policy would replace the patched tree's CP=1 baseline); a ``--prepare-qkv`` other than
    ``tree`` needs a label (it would replace the as-is runs). Raises SystemExit(2) after one
    ``gdn_layer.py: ...`` line on stderr that says what to change.
    """
    seqs = _positive_ints("--seq", args.seq or DEFAULT_SEQ, "token counts", "32768,65536")
    _positive_ints("--cp", args.cp, "CP sizes", "2,4")
    modes = [m for m in args.modes.split(",") if m]
    if not modes:
        _refuse(f"--modes is empty; pick from {', '.join(MODES + ('ideal',))}")
    unknown = [m for m in modes if m not in MODES + ("ideal",)]
    if unknown:
        _refuse(f"unknown mode(s) {', '.join(unknown)} in --modes; pick from "
                f"{', '.join(MODES + ('ideal',))}")
    twice = sorted({m for m in modes if modes.count(m) > 1})
    if twice:
        _refuse(f"--modes names {', '.join(twice)} twice; name each mode once")
    for flag, least in (("repeats", 1), ("warmup", 0), ("samples", 1), ("hidden", 1), ("key_heads", 1),
                        ("value_heads", 1), ("head_dim", 1), ("conv_kernel", 1)):
        if getattr(args, flag) < least:
            _refuse(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least {least}")
    if os.path.isdir(args.out):
        _refuse(f"--out {args.out} is a directory; give the path of the JSON file to write")
    if args.profile and (args.profile not in seqs or not set(modes) & set(PROFILED_MODES)):
        _refuse(f"--profile {args.profile} profiles a length of --seq ({args.seq}) in one of the modes "
                f"{', '.join(PROFILED_MODES)}; add it to --seq and --modes, or drop --profile")
    if args.label and (len(modes) != 1 or modes[0] == "ideal"):
        _refuse("--label names one mode's runs; pass exactly one mode and no ideal in --modes "
                "(e.g. --modes headwise --label old_headwise)")
    if args.prepare_qkv != "tree" and not args.label:
        _refuse(f"--prepare-qkv {args.prepare_qkv} changes the layer, so its runs need their own name: "
                "add --label (e.g. --label headwise_qkv_compiled)")


def main(argv=None):
    args = parse_args(argv)
    if args.seq is None:  # --cpu-smoke runs the full geometry, so keep its sequence tiny
        args.seq = "512" if args.cpu_smoke else DEFAULT_SEQ
    check_label(args)
    if not os.path.isfile(os.path.join(args.tree, "megatron", "core", "ssm", "gated_delta_net.py")):
        _refuse(f"--tree {args.tree} holds no megatron/core/ssm/gated_delta_net.py; build it with "
                "tools/backport --upstream 5139086e, or pass --tree build/tree/base")
    if not args.cpu_smoke:
        install_autotune_policy(args.autotune)
    sys.path.insert(0, args.tree)
    import torch
    import torch.distributed as dist
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 64  # @jit_fuser norm sees every shape of the sweep
    if args.cpu_smoke:
        sys.path.insert(0, os.path.join(ROOT, "tests/image"))
        from _world import install_cpu_device_shim

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        install_cpu_device_shim()
        dist.init_process_group("gloo")
        dtype = torch.float32
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        dtype = torch.bfloat16
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = None
    if args.cpu_smoke:
        import fla_emulation

        ctx = fla_emulation.emulated_fla_in_megatron()
        ctx.__enter__()

    set_prepare_qkv(args.prepare_qkv)
    cps = [int(c) for c in args.cp.split(",") if c]
    seqs = sorted((int(s) for s in args.seq.split(",") if s), reverse=True)
    modes = [m for m in args.modes.split(",") if m]
    t_start = time.time()
    result = {
        "meta": {
            "layer": "megatron.core.ssm.gated_delta_net.GatedDeltaNet",
            "tree": os.path.relpath(args.tree, ROOT) if args.tree.startswith(ROOT) else args.tree,
            "world_size": world, "dtype": str(dtype), "layout": ("SBHD, batch 1" if args.samples == 1 else
                                                     f"THD, {args.samples} equal samples") + ", zigzag shard per rank",
            "geometry": {"hidden": args.hidden, "key_heads": args.key_heads, "value_heads": args.value_heads,
                         "head_dim": args.head_dim, "conv_kernel": args.conv_kernel, "tp": 1},
            "warmup": args.warmup, "repeats": args.repeats, "autotune": args.autotune,
            "label": args.label or None, "prepare_qkv": args.prepare_qkv,
            "method": "CUDA events around forward+backward, barrier before each repeat, per-repeat max "
                      "over ranks; memory = max over ranks of torch.cuda.max_memory_allocated/"
                      "max_memory_reserved over the timed repeats (after empty_cache + reset). "
                      "World split into world/P concurrent CP groups. ideal = CP=1 layer on T/P tokens.",
            "torch": torch.__version__, "cpu_smoke": args.cpu_smoke,
            "host": platform.node(), "samples": args.samples, "argv": sys.argv[1:],
            "patch_sha256": _patch_sha256(),
            "gpu": (torch.cuda.get_device_name() if not args.cpu_smoke else "cpu"),
        },
        "runs": [], "skipped": [], "errors": [],
    }
    try:
        import fla
        result["meta"]["fla"] = getattr(fla, "__version__", "?")
        import triton
        result["meta"]["triton"] = triton.__version__
    except Exception:
        pass

    def dump():
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    for P in cps:
        if world % P:
            result["skipped"].append({"cp": P, "why": f"world {world} not divisible by P"})
            continue
        pg_cp = init_mpu(P, args)
        pg_1 = None
        for mode in modes:
            # Each mode compiles the layer's jit_fuser functions afresh, as in a process of its
            # own: Dynamo's automatic dynamic shapes would otherwise carry the previous mode's
            # head counts into this one's kernels, and a function that has seen two head counts
            # runs shape-generic kernels (chunkwise after headwise in one process: 4-9x slower
            # prepare_qkv copies, about +1 ms per step at 32K and CP=2; session 21, call 2).
            torch._dynamo.reset()
            for T in seqs:
                if time.time() - t_start > args.budget_s:
                    result["skipped"].append({"cp": P, "mode": mode, "T": T, "why": "time budget"})
                    dump()
                    continue
                if mode == "ideal":
                    if pg_1 is None:
                        pg_1 = init_mpu(1, args)
                    pg, layer_mode, layer_cp = pg_1, "headwise", 1
                else:
                    if pg_1 is not None:  # ideal ran before: restore the CP groups
                        pg_cp, pg_1 = init_mpu(P, args), None
                    pg, layer_mode, layer_cp = pg_cp, mode, P
                    if mode == "chunkwise_upstream_layout":
                        layer_mode = "chunkwise"
                t0 = time.time()
                try:
                    layer = build_layer(args, layer_mode, layer_cp, pg, torch, dtype)
                    if mode == "chunkwise_upstream_layout":
                        layer.sp_size = _UpstreamLayoutSP(1)
                    check_samples(T, P, args.samples)
                    psp = packed_params(torch, T // (P if mode == "ideal" else 1), args.samples, dev(torch, args))
                    times, mem, syncs = run_config(args, torch, dist, layer, T // P, args.repeats, args.warmup,
                                                   dtype, psp)
                    rec = {"cp": P, "mode": args.label if args.label and mode != "ideal" else mode, "T": T,
                           "local_tokens": T // P, "samples": args.samples}
                    rec.update(summarize(times, mem, T, syncs))
                    result["runs"].append(rec)
                    log(rank, f"P={P} {mode:10s} T={T:6d}: median {rec['median_ms']:.3f} ms "
                              f"min {rec['min_ms']:.3f} p90 {rec['p90_ms']:.3f} "
                              f"alloc {rec['peak_alloc_mib']:.0f} MiB res {rec['peak_reserved_mib']:.0f} MiB "
                              f"({time.time() - t0:.1f}s)")
                    if T == args.profile and mode in PROFILED_MODES:
                        t1 = time.time()
                        stem = os.path.splitext(os.path.abspath(args.out))[0]
                        trace = f"{stem}.trace-{args.label or mode}-cp{P}-T{T}-rank{rank}.json.gz"
                        try:
                            mine = profile_step(args, torch, dist, layer, T // P, dtype, psp, trace)
                        except Exception as e:  # not attributable: keep the trace, say why, and
                            # still join the other ranks' all_gather_object below
                            mine = {"error": (str(e) if isinstance(e, ValueError)
                                              else f"{type(e).__name__}: {e}")[:2000], "total": {}}
                        allp = [None] * world
                        dist.all_gather_object(allp, dict(mine, rank=rank))
                        name = args.label or mode
                        result.setdefault("profiles", []).append(
                            {"cp": P, "mode": name, "T": T, "samples": args.samples,
                             "median_ms": rec["median_ms"], "ranks": allp})
                        tot = mine["total"]
                        log(rank, f"P={P} {mode:10s} T={T:6d}: profiled (rank 0) " + (
                            f"wall {tot['wall_ms']:.2f} ms, GPU busy {tot['busy_ms']:.2f}, idle "
                            f"{tot['idle_ms']:.2f}, host syncs {tot['host_syncs']}" if tot else
                            f"NOT ATTRIBUTED: {mine.get('error', '')[:400]}") + f" ({time.time() - t1:.1f}s)")
                except Exception as e:  # record and continue (e.g. OOM)
                    msg = f"{type(e).__name__}: {e}"
                    result["errors"].append({"cp": P, "mode": args.label if args.label and mode != "ideal"
                                             else mode, "T": T, "error": msg[:2000]})
                    log(rank, f"P={P} {mode} T={T}: ERROR {msg[:300]}")
                    if rank == 0:
                        traceback.print_exc()
                finally:
                    layer = None
                    if not args.cpu_smoke:
                        torch.cuda.empty_cache()
                dump()
    result["meta"]["elapsed_s"] = round(time.time() - t_start, 1)
    dump()
    if ctx is not None:
        ctx.__exit__(None, None, None)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
