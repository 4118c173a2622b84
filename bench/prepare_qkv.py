#!/usr/bin/env python3
"""What decision 7a (Dynamo off ``_prepare_qkv_for_gated_delta_rule``) protects against, and
what it costs, on one GPU at CP=1.

The preserved downstream fix runs ``GatedDeltaNet._prepare_qkv_for_gated_delta_rule`` eagerly
under ``torch.compiler.disable``; the base tree (MCore 85bced0a) compiles it with
``megatron.core.jit.jit_fuser`` (``torch.compile``). The RFC that carried the fix says only that
the helper "triggers a torch.compile/Dynamo failure" on a Qwen3.6 model. This script:

1. ``scenarios``: runs the helper under each compile policy on inputs that differ the way a
   training job's do (many sequence lengths, batch 2, the headwise CP split sizes 1/2/4, many
   layer instances, no-grad then grad, activation checkpointing, the whole layer on packed THD
   with changing ``cu_seqlens``), with Dynamo's default recompile limit, and records for each
   policy: exceptions, the largest difference of outputs and input gradients from the eager
   helper, Dynamo's frame/graph/graph-break/recompile counters and its warnings.
2. ``helper``: times the helper alone (forward+backward) per policy at the benchmark shape and
   lists its CUDA kernels (torch.profiler), so the cost of running it eagerly is attributed.
3. ``layer``: times the whole CP=1 layer (SBHD, batch 1) forward+backward per policy, rounds
   interleaved in one process, plus the base tree's ``GatedDeltaNet`` code loaded beside the
   patched one (``--base-tree``; same FLA, same process): the patch's own cost, same call.

Policies (``--policies``): ``tree`` (as the tree has it), ``eager`` (the helper op by op, as
the patch before ``adapt-gdn-prepare-qkv-fused-copies`` ran it: split, reshape, ``l2norm``,
``repeat_interleave``, ``contiguous``; :func:`eager_reference`), ``jit_fuser``
(``torch.compile`` of that, the base tree's form), ``dynamic`` (``torch.compile(dynamic=True)``),
``l2norm_eager`` (compiled, with FLA's ``l2norm`` excluded from Dynamo so the graph breaks
around it), ``l2norm_eager_dynamic`` (the same with ``dynamic=True``). Scenarios compare every
policy with ``eager``.

Run (one GPU): ``torchrun --nproc_per_node 1 bench/prepare_qkv.py --out X.json``. Writes JSON
after every part. ``--cpu-smoke`` runs tiny shapes on CPU with the FLA stand-ins of
``tests/image/fla_emulation.py`` (plumbing check only).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import statistics
import sys
import time
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gdn_layer  # noqa: E402  (the benchmark's builders and timers)

NAME = "_prepare_qkv_for_gated_delta_rule"
POLICIES = ("tree", "eager", "jit_fuser", "dynamic", "l2norm_eager", "l2norm_eager_dynamic")
PARTS = ("scenarios", "helper", "layer")


def _names(p, flag: str, value: str, known) -> list:
    """``value`` split on commas; a usage error (exit 2) naming the first unknown name."""
    names = [v for v in value.split(",") if v]
    bad = [v for v in names if v not in known]
    if bad or not names:
        what = f"unknown name {bad[0]!r}" if bad else "empty"
        p.error(f"{flag}: {what}; pick from {', '.join(known)} (comma-separated)")
    return names


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", default=os.path.join(ROOT, "build/tree/patched"))
    p.add_argument("--base-tree", default=os.path.join(ROOT, "build/tree/base"),
                   help="tree whose GatedDeltaNet code is timed beside the patched one ('' to skip)")
    p.add_argument("--out", default=os.path.join(ROOT, "results/raw/bench/prepare_qkv.json"))
    p.add_argument("--parts", default="scenarios,helper,layer")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seq", default="65536,32768", help="CP=1 sequence lengths for the timed parts")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds per variant (layer part)")
    p.add_argument("--repeats", type=int, default=8, help="timed steps per variant per round")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--value-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--conv-kernel", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=1e9, help="skip parts that would start after this")
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args(argv)
    _names(p, "--parts", args.parts, PARTS)
    _names(p, "--policies", args.policies, POLICIES)
    seqs = [s for s in args.seq.split(",") if s]
    if not seqs or not all(s.isdigit() and int(s) > 0 for s in seqs):
        p.error(f"--seq {args.seq!r}: give positive token counts, comma-separated (e.g. 65536,32768)")
    for flag in ("rounds", "repeats", "hidden", "key_heads", "value_heads", "head_dim", "conv_kernel"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    return args


class DynamoLog(logging.Handler):
    """Collects Dynamo's warnings (recompile limit, graph-break notices) while installed."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage()[:400])


def plain_counters(torch):
    from torch._dynamo.utils import counters

    return {k: {str(kk): vv for kk, vv in sorted(v.items(), key=lambda kv: -kv[1])[:8]}
            for k, v in counters.items() if v}


def eager_reference(gdn):
    """The helper computed op by op, eagerly (the bench's baseline; our own code): returns a
    function ``(self, qkv, gate, beta, alpha, batch, seq_len, cp_size_headwise=1)`` giving
    query, key ``[b, s, h_v, d_k]``, value, gate ``[b, s, h_v, d_v]``, beta, alpha ``[b, s, h_v]``,
    all contiguous. FLA's ``l2norm`` is looked up in ``gdn`` at each call."""
    import torch

    def prepare(self, qkv, gate, beta, alpha, batch, seq_len, cp_size_headwise=1):
        qk_dim = self.qk_dim_local_tp // cp_size_headwise
        qk, v = torch.split(qkv, [2 * qk_dim, self.v_dim_local_tp // cp_size_headwise], dim=-1)
        qk = qk.reshape(batch, seq_len, -1, self.key_head_dim)
        if self.use_qk_l2norm:
            qk = gdn.l2norm(qk.contiguous())
        heads = qk_dim // self.key_head_dim
        q, k = qk[:, :, :heads], qk[:, :, heads:]
        group = self.num_value_heads // self.num_key_heads
        if group > 1:
            q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        v = v.reshape(batch, seq_len, -1, self.value_head_dim)
        return tuple(t.contiguous() for t in (q, k, v, gate, beta, alpha))

    return prepare


def policy_function(torch, raw, policy):
    """The helper as ``policy`` runs it (a plain function taking ``self`` first). Each compiled
    policy gets its own copy of the code object, so Dynamo's caches never mix policies."""
    if policy == "eager":
        return raw
    fn = types.FunctionType(raw.__code__.replace(), raw.__globals__, raw.__name__, raw.__defaults__,
                            raw.__closure__)
    if policy in ("jit_fuser", "l2norm_eager"):
        return torch.compile(fn)
    if policy in ("dynamic", "l2norm_eager_dynamic"):
        return torch.compile(fn, dynamic=True)
    raise ValueError(f"unknown policy {policy!r}: pick one of {', '.join(POLICIES)}")


_POLICY_FNS = {}


@contextlib.contextmanager
def helper_as(gdn, torch, tree_fn, raw, policy):
    """Bind ``GatedDeltaNet._prepare_qkv_for_gated_delta_rule`` to ``policy`` for the block
    (one function object per policy for the process; ``l2norm_eager`` also puts FLA's ``l2norm``
    under ``torch.compiler.disable`` in the module for the block)."""
    if policy == "tree":
        fn = tree_fn
    else:
        fn = _POLICY_FNS.get(policy) or _POLICY_FNS.setdefault(policy, policy_function(torch, raw, policy))
    l2norm = gdn.l2norm
    setattr(gdn.GatedDeltaNet, NAME, fn)
    if policy.startswith("l2norm_eager"):
        gdn.l2norm = _POLICY_FNS.setdefault("l2norm", torch.compiler.disable(l2norm))
    try:
        yield fn
    finally:
        setattr(gdn.GatedDeltaNet, NAME, tree_fn)
        gdn.l2norm = l2norm


def helper_inputs(torch, layer, batch, seq_len, cp, device, dtype, seed):
    """Inputs shaped as ``GatedDeltaNet.forward`` hands them to the helper: ``qkv`` the conv output
    ``[b, s, (2*qk + v)/cp]`` (contiguous), ``gate`` ``[b, s, Hv/cp, dv]``, ``beta``/``alpha``
    ``[b, s, Hv/cp]`` (strided views of one in_proj output, as after the split)."""
    g = torch.Generator(device=device).manual_seed(seed)
    qk, v, hv = layer.qk_dim_local_tp // cp, layer.v_dim_local_tp // cp, layer.num_value_heads // cp
    qkvzba = torch.randn(seq_len, batch, 2 * qk + v + v + 2 * hv, generator=g, device=device, dtype=dtype)
    qkvzba = qkvzba.transpose(0, 1)
    qkv, gate, beta, alpha = torch.split(qkvzba, [2 * qk + v, v, hv, hv], dim=-1)
    qkv = qkv.contiguous()
    gate = gate.reshape(batch, seq_len, -1, layer.value_head_dim)
    leaves = [t.detach().clone().requires_grad_(True) for t in (qkv, gate, beta, alpha)]
    return leaves


def run_helper(layer, leaves, batch, seq_len, cp, grad=True, checkpoint=False):
    import torch

    args = (*leaves, batch, seq_len, cp)
    with torch.set_grad_enabled(grad):
        if checkpoint:
            outs = torch.utils.checkpoint.checkpoint(getattr(layer, NAME), *args, use_reentrant=False)
        else:
            outs = getattr(layer, NAME)(*args)
    if not grad:
        return [o.detach().float() for o in outs], []
    loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))
    grads = torch.autograd.grad(loss, leaves)
    return [o.detach().float() for o in outs], [g.float() for g in grads]


def max_diff(a, b):
    return max((float((x - y).abs().max()) for x, y in zip(a, b)), default=0.0)


def part_scenarios(ctx, policies):
    """Each policy against the eager helper on the scenarios of the module docstring."""
    torch, gdn, args = ctx["torch"], ctx["gdn"], ctx["args"]
    dev, dtype = ctx["device"], ctx["dtype"]
    small = gdn_layer.argparse.Namespace(**vars(args))
    small.hidden, small.key_heads, small.value_heads, small.head_dim = 256, 4, 8, 32
    layers = [gdn_layer.build_layer(small, "headwise", 1, ctx["pg"], torch, dtype) for _ in range(12)]
    lengths = [256, 320, 512, 520, 1000, 1024, 1536, 2048, 2112, 4096, 128, 777]
    cases = {
        "lengths": [(layers[0], 1, s, 1, True, False) for s in lengths],
        "batch2": [(layers[0], 2, s, 1, True, False) for s in (512, 1024)],
        "headwise_cp": [(layers[0], 1, 1024, c, True, False) for c in (1, 2, 4, 2, 1)],
        "layers": [(lay, 1, 1024, 1, True, False) for lay in layers],
        "no_grad_then_grad": [(layers[0], 1, 1024, 1, False, False), (layers[0], 1, 1024, 1, True, False)],
        "checkpoint": [(layers[0], 1, 1024, 1, True, True), (layers[0], 1, 2048, 1, True, True)],
    }
    out = {}
    root = logging.getLogger("torch._dynamo")
    for policy in policies:
        torch._dynamo.reset()
        _POLICY_FNS.clear()
        from torch._dynamo.utils import counters

        counters.clear()
        rec, handler = {}, DynamoLog()
        root.addHandler(handler)
        t0 = time.time()
        try:
            for name, calls in cases.items():
                worst, err = 0.0, None
                for i, (lay, b, s, c, grad, ckpt) in enumerate(calls):
                    leaves = helper_inputs(torch, lay, b, s, c, dev, dtype, seed=i)
                    with helper_as(gdn, torch, ctx["tree_fn"], ctx["raw"], "eager"):
                        ref_o, ref_g = run_helper(lay, leaves, b, s, c, grad, ckpt)
                    try:
                        with helper_as(gdn, torch, ctx["tree_fn"], ctx["raw"], policy):
                            o, g = run_helper(lay, leaves, b, s, c, grad, ckpt)
                        worst = max(worst, max_diff(o, ref_o), max_diff(g, ref_g))
                    except Exception as e:  # the failure this part looks for: record, go on
                        err = f"call {i} (b={b} s={s} cp={c}): {type(e).__name__}: {str(e)[:700]}"
                        break
                rec[name] = {"calls": len(calls), "ok": err is None, "max_abs_diff": worst, "error": err}
            rec["layer_thd"] = scenario_layer_thd(ctx, layers[0], policy)
        finally:
            root.removeHandler(handler)
        rec["dynamo_counters"] = plain_counters(torch)
        rec["dynamo_warnings"] = handler.lines[:20]
        rec["seconds"] = round(time.time() - t0, 1)
        out[policy] = rec
        gdn_layer.log(0, f"scenarios {policy}: " + ", ".join(
            f"{k}={'ok' if v['ok'] else 'ERROR'}({v['max_abs_diff']:.2e})" for k, v in rec.items()
            if isinstance(v, dict) and "ok" in v) + f" [{rec['seconds']} s]")
    return out


def scenario_layer_thd(ctx, layer, policy):
    """The whole layer, forward+backward, on packed THD whose cu_seqlens change every step."""
    torch, gdn, dev, dtype = ctx["torch"], ctx["gdn"], ctx["device"], ctx["dtype"]
    from megatron.core.packed_seq_params import PackedSeqParams

    packings = [[512, 512], [256, 768], [128, 128, 768], [1024], [384, 384, 256], [64, 960]]
    worst = 0.0
    for i, lens in enumerate(packings):
        cu = torch.tensor([0] + list(__import__("itertools").accumulate(lens)), dtype=torch.int32, device=dev)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                              cu_seqlens_kv_padded=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
        g = torch.Generator(device=dev).manual_seed(100 + i)
        x = torch.randn(sum(lens), 1, layer.config.hidden_size, generator=g, device=dev, dtype=dtype)
        results = []
        for pol in ("eager", policy):
            xi = x.clone().requires_grad_(True)
            try:
                with helper_as(gdn, torch, ctx["tree_fn"], ctx["raw"], pol):
                    y, _ = layer(xi, None, packed_seq_params=psp)
                    (gx,) = torch.autograd.grad(y.float().sum(), xi)
            except Exception as e:
                return {"calls": i + 1, "ok": False, "max_abs_diff": worst,
                        "error": f"packing {lens}: {type(e).__name__}: {str(e)[:700]}"}
            results.append((y.detach().float(), gx.float()))
        worst = max(worst, max_diff(results[0], results[1]))
    return {"calls": len(packings), "ok": True, "max_abs_diff": worst, "error": None}


def cuda_ms(torch, fn, repeats, cpu):
    times = []
    for _ in range(repeats):
        with gdn_layer.Timer(torch, cpu) as t:
            fn()
        times.append(t.ms)
    return times


def kernel_table(torch, fn, cpu, top=12):
    """CUDA kernels of one ``fn()`` call: [(name, calls, total us)], largest first."""
    if cpu:
        return []
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dev_us and ev.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((ev.key[:120], ev.count, round(dev_us, 1)))
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


def part_helper(ctx, policies, seqs):
    """The helper alone, forward+backward, per policy: median ms and its CUDA kernels."""
    torch, gdn, args = ctx["torch"], ctx["gdn"], ctx["args"]
    layer = gdn_layer.build_layer(args, "headwise", 1, ctx["pg"], torch, ctx["dtype"])
    out = []
    for T in seqs:
        leaves = helper_inputs(torch, layer, 1, T, 1, ctx["device"], ctx["dtype"], seed=T)
        for policy in policies:
            torch._dynamo.reset()
            _POLICY_FNS.clear()
            with helper_as(gdn, torch, ctx["tree_fn"], ctx["raw"], policy):
                step = lambda: run_helper(layer, leaves, 1, T, 1)  # noqa: E731
                for _ in range(3):
                    step()
                times = cuda_ms(torch, step, 3 * args.repeats, args.cpu_smoke)
                table = kernel_table(torch, step, args.cpu_smoke)
            rec = {"T": T, "policy": policy, "median_ms": round(statistics.median(times), 4),
                   "min_ms": round(min(times), 4), "kernels": table}
            out.append(rec)
            gdn_layer.log(0, f"helper T={T} {policy:12s}: median {rec['median_ms']:.3f} ms "
                             f"({len(table)} kernel kinds)")
    return out


def load_base_gdn(base_tree, torch):
    """The base tree's ``gated_delta_net`` module, loaded under another name beside the patched
    one (its ``megatron.core`` imports resolve to the patched tree, which the GDN code uses the
    same way)."""
    path = os.path.join(base_tree, "megatron/core/ssm/gated_delta_net.py")
    spec = importlib.util.spec_from_file_location("gdn_base_tree_code", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_base_layer(ctx, mod):
    """The base tree's ``GatedDeltaNet`` built by the patched builder (the class swapped in)."""
    from unittest import mock

    import megatron.core.ssm.gated_delta_net as gdn

    with mock.patch.object(gdn, "GatedDeltaNet", mod.GatedDeltaNet):
        layer = gdn_layer.build_layer(ctx["args"], "headwise", 1, ctx["pg"], ctx["torch"], ctx["dtype"])
    assert type(layer) is mod.GatedDeltaNet
    return layer


def part_layer(ctx, policies, seqs):
    """Whole CP=1 layer, forward+backward, variants interleaved round by round (one record per
    entry of ``seqs``, in order)."""
    torch, gdn, args = ctx["torch"], ctx["gdn"], ctx["args"]
    variants = [(p, None) for p in policies]
    base_mod = None
    if args.base_tree:
        base_mod = load_base_gdn(args.base_tree, torch)
        if ctx["cpu"]:
            import fla_emulation

            for name in ("causal_conv1d", "chunk_gated_delta_rule", "l2norm"):
                setattr(base_mod, name, getattr(fla_emulation, name))
        variants.append(("base_code", base_mod))
    out = []
    # One Dynamo reset for the whole part: a later length recompiles the jit_fuser code (then with
    # dynamic shapes, as in a job whose lengths change), so list a length twice to see that.
    torch._dynamo.reset()
    for T in seqs:
        layers = {}
        for name, mod in variants:
            layers[name] = build_base_layer(ctx, mod) if mod else gdn_layer.build_layer(
                args, "headwise", 1, ctx["pg"], torch, ctx["dtype"])
        x = torch.randn(T, 1, args.hidden, device=ctx["device"], dtype=ctx["dtype"], requires_grad=True)
        gy = torch.randn_like(x)
        samples = {name: [] for name, _ in variants}
        syncs = {}
        for r in range(args.rounds):
            for name, mod in variants:
                lay = layers[name]
                policy = "tree" if mod else name
                with helper_as(gdn, torch, ctx["tree_fn"], ctx["raw"], policy):
                    def step():
                        x.grad = None
                        for p in lay.parameters():
                            p.grad = None
                        y, _ = lay(x, None)
                        y.backward(gy)
                    for _ in range(2 if r else 3):
                        step()
                    samples[name] += cuda_ms(torch, step, args.repeats, args.cpu_smoke)
                    if r == 0 and not args.cpu_smoke:
                        syncs[name] = gdn_layer.count_host_syncs(torch, step)
        ref = statistics.median(samples["tree"]) if "tree" in samples else None
        for name, _ in variants:
            med = statistics.median(samples[name])
            rec = {"T": T, "variant": name, "median_ms": round(med, 4), "min_ms": round(min(samples[name]), 4),
                   "n": len(samples[name]), "host_syncs_per_step": syncs.get(name),
                   "vs_tree": round(med / ref, 4) if ref else None}
            out.append(rec)
            gdn_layer.log(0, f"layer CP=1 T={T} {name:12s}: median {med:.3f} ms ({rec['vs_tree']} x tree) "
                             f"syncs {rec['host_syncs_per_step']}")
        del layers, x, gy
        if not args.cpu_smoke:
            torch.cuda.empty_cache()
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.cpu_smoke:
        args.hidden, args.key_heads, args.value_heads, args.head_dim = 256, 4, 8, 32
        args.seq, args.rounds, args.repeats = "256", 1, 2
    sys.path.insert(0, args.tree)
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    ctx_exit = contextlib.ExitStack()
    if args.cpu_smoke:
        sys.path.insert(0, os.path.join(ROOT, "tests/image"))
        from _world import install_cpu_device_shim

        install_cpu_device_shim()
        dist.init_process_group("gloo")
        dtype, device = torch.float32, torch.device("cpu")
        import fla_emulation

        ctx_exit.enter_context(fla_emulation.emulated_fla_in_megatron())
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
        dtype, device = torch.bfloat16, torch.device("cuda", 0)
        gdn_layer.install_autotune_policy("per-width")
    import megatron.core.ssm.gated_delta_net as gdn

    tree_fn = gdn.GatedDeltaNet.__dict__[NAME]
    raw = eager_reference(gdn)
    policies = [p for p in args.policies.split(",") if p]
    seqs = [int(s) for s in args.seq.split(",") if s]
    ctx = {"torch": torch, "gdn": gdn, "args": args, "device": device, "dtype": dtype, "cpu": args.cpu_smoke,
           "pg": gdn_layer.init_mpu(1, args), "tree_fn": tree_fn, "raw": raw}
    result = {"meta": {"torch": torch.__version__, "tree": args.tree, "base_tree": args.base_tree,
                       "gpu": torch.cuda.get_device_name() if not args.cpu_smoke else "cpu",
                       "tree_decorator": type(tree_fn).__name__ if not callable(tree_fn) else repr(tree_fn)[:120],
                       "recompile_limit": torch._dynamo.config.recompile_limit,
                       "argv": sys.argv[1:], "patch_sha256": gdn_layer._patch_sha256()}}
    try:
        import fla

        result["meta"]["fla"] = fla.__version__
    except Exception:
        pass
    t_start = time.time()

    def dump():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    parts = {"scenarios": lambda: part_scenarios(ctx, [p for p in policies if p != "eager"]),
             "helper": lambda: part_helper(ctx, policies, seqs),
             "layer": lambda: part_layer(ctx, policies, seqs)}
    for part in [p for p in args.parts.split(",") if p]:
        if time.time() - t_start > args.budget_s:
            result[part] = {"skipped": "time budget"}
            continue
        t0 = time.time()
        try:
            result[part] = parts[part]()
        except Exception as e:
            result[part] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
            traceback.print_exc()
        result.setdefault("seconds", {})[part] = round(time.time() - t0, 1)
        dump()
    ctx_exit.close()
    dist.destroy_process_group()
    failed = sorted(k for k, v in result.items() if isinstance(v, dict) and "error" in v)
    if failed:
        sys.stderr.write(f"error: part(s) {', '.join(failed)} failed (traceback above; {args.out} records them)\n"
                         "hint: fix the cause named in the traceback and run those parts again with --parts.\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
