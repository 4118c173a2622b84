"""Spread Triton compilation over processes before the matrix runs.

Every rank of a job would otherwise compile the same FLA kernels at the same moment.
``tools/gpu-suite`` runs the union of every job's list once, before the jobs, in plain
processes (``warmup.py --set all --shard r/N``, no process group), so that the jobs find
Triton's on-disk cache filled. Inside a job, rank ``r`` runs items ``r, r + world, ...`` of a list (one forward + backward of FLA's
``chunk_gated_delta_rule`` / ``causal_conv1d`` / ``l2norm`` without CP, at the head counts,
head dims, dtypes and varlen-ness the job will use), filling Triton's on-disk kernel and
autotune caches that the other ranks then read. Nothing here is compared.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

F32, BF16 = torch.float32, torch.bfloat16

# ("gdn", dtype, heads, dk, dv, varlen) | ("conv", dtype, channels, varlen[, width=4])
# | ("l2", dtype, d)
KERNEL_ITEMS = [("gdn", F32, 8, 32, 64, True), ("conv", F32, 256, True)]
# module-a: geometry gqa_dk32_dv64, all cases, CP 1/2/4, every mode
MODULE_A_ITEMS = (
    [("gdn", F32, h, 32, 64, v) for h in (8, 4, 2) for v in (True, False)]
    + [("conv", F32, d, v) for d in (768, 384, 192) for v in (True, False)]
    + [("l2", F32, 32)]
)
# module-b / module-c: the headwise-illegal geometry (dk = dv = 64, 6 value heads; 3 on the
# headwise CP=2 path), SBHD (module-b) or THD (module-c), CP 1/2/4, every mode
MODULE_B_ITEMS = (
    [("gdn", F32, h, 64, 64, False) for h in (6, 3)]
    + [("conv", F32, d, False) for d in (640, 320)]
    + [("l2", F32, 64)]
)
MODULE_C_ITEMS = (
    [("gdn", F32, h, 64, 64, True) for h in (6, 3)]
    + [("conv", F32, d, True) for d in (640, 320)]
    + [("l2", F32, 64)]
)
# module-d (4 GPUs): dynamic CP, recompute and the spec build, all THD on the gqa geometry
MODULE_D_ITEMS = (
    [("gdn", F32, h, 32, 64, True) for h in (8, 4, 2)]
    + [("conv", F32, d, True) for d in (768, 384, 192)]
    + [("l2", F32, 32)]
)
# module-e (tests/image/gpu/module_extra.py): TP=2 x CP=2 (SBHD and THD) and dynamic CP on the
# gqa geometry: TP halves the heads and channels, so the keys are module-a's
MODULE_E_ITEMS = MODULE_A_ITEMS
# module-f: the gqa geometry with conv width 2 (SBHD and THD, CP 1/2/4)
MODULE_F_ITEMS = (
    [("gdn", F32, h, 32, 64, v) for h in (8, 4, 2) for v in (True, False)]
    + [("conv", F32, d, v, 2) for d in (768, 384, 192) for v in (True, False)]
    + [("l2", F32, 32)]
)
# empty segments (issue 12): H=4, K=V=64, THD, float32 and bfloat16, heads 4/2/1 (headwise)
EMPTY_ITEMS = (
    [("gdn", dt, h, 64, 64, True) for dt in (F32, BF16) for h in (4, 2, 1)]
    + [("conv", dt, d, True) for dt in (F32, BF16) for d in (768, 384, 192)]
    + [("l2", dt, 64) for dt in (F32, BF16)]
)
MODULE_ITEMS = list(dict.fromkeys(
    MODULE_A_ITEMS + MODULE_B_ITEMS + MODULE_C_ITEMS + MODULE_D_ITEMS))
# old-vs-new dumps: CP=1 and headwise CP=2/4 of the gqa geometry (either FLA version)
OLDNEW_ITEMS = (
    [("gdn", F32, h, 32, 64, v) for h in (8, 4, 2) for v in (True, False)]
    + [("conv", F32, d, v) for d in (768, 384, 192) for v in (True, False)]
    + [("l2", F32, 32)]
)
# --warmup-set / --set names (tools/gpu-suite runs one module job per module-* set)
SETS = {"kernels": KERNEL_ITEMS, "module": MODULE_ITEMS, "module-a": MODULE_A_ITEMS,
        "module-b": MODULE_B_ITEMS, "module-c": MODULE_C_ITEMS, "module-d": MODULE_D_ITEMS,
        "module-e": MODULE_E_ITEMS, "module-f": MODULE_F_ITEMS, "empty": EMPTY_ITEMS,
        "oldnew": OLDNEW_ITEMS}
# every FLA 0.4.2 key of the suite, each once, slowest kinds first (gdn, then conv, then l2):
# the global warm-up of tools/gpu-suite (FLA 0.4.1 runs the "oldnew" set on its own)
SETS["all"] = sorted(dict.fromkeys(it for name in ("kernels", "module", "module-e", "module-f",
                                                   "empty", "oldnew") for it in SETS[name]),
                     key=lambda it: ("gdn", "conv", "l2").index(it[0]))


def _one(item, device):
    from fla.modules.convolution import causal_conv1d
    from fla.modules.l2norm import l2norm
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    T = 256
    cu = torch.tensor([0, 100, T], device=device, dtype=torch.long)
    kind, dtype = item[0], item[1]
    if kind == "gdn":
        _, _, h, dk, dv, varlen = item
        q = torch.randn(1, T, h, dk, device=device, dtype=dtype, requires_grad=True)
        k = F.normalize(torch.randn(1, T, h, dk, device=device), dim=-1).to(dtype).requires_grad_()
        v = torch.randn(1, T, h, dv, device=device, dtype=dtype, requires_grad=True)
        g = F.logsigmoid(torch.randn(1, T, h, device=device)).requires_grad_()
        b = torch.rand(1, T, h, device=device, dtype=dtype).requires_grad_()
        o, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=b, cu_seqlens=cu if varlen else None)
        o.backward(torch.randn_like(o))
    elif kind == "conv":
        _, _, d, varlen, *width = item
        x = torch.randn(1, T, d, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(d, width[0] if width else 4, device=device, dtype=dtype, requires_grad=True)
        y, _ = causal_conv1d(x=x, weight=w, bias=None, activation="silu",
                             cu_seqlens=cu if varlen else None)
        # A dense output gradient, never ``y.sum().backward()``: in float32 that hands FLA 0.4.2's
        # conv backward a 4-byte expanded dy, which its kernel reads as a full [B, T, D] tensor
        # (out-of-bounds: the "illegal memory access" of runs 3-5 on 2 GPUs; FLA PR #871).
        y.backward(torch.randn_like(y))
    else:
        _, _, d = item
        x = torch.randn(1, T, 4, d, device=device, dtype=dtype, requires_grad=True)
        y = l2norm(x)
        y.backward(torch.randn_like(y))


def run(items, rank, world, device, log):
    t = time.time()
    for i, item in enumerate(items):
        if i % world == rank:
            _one(item, device)
    torch.cuda.synchronize(device)
    log(f"[rank {rank}] warm-up of {len(items[rank::world])} items took {time.time() - t:.1f}s")


def _main(argv=None):
    """Run one warm-up list on one GPU, item by item, printing each item before and after.

        python tests/image/gpu/warmup.py --set module-a --set empty --shard 0/2

    With ``CUDA_LAUNCH_BLOCKING=1`` a faulting kernel is reported at the item that launched
    it, which is how a crash inside the warm-up is localised.
    """
    import argparse

    ap = argparse.ArgumentParser(description=_main.__doc__)
    ap.add_argument("--set", choices=sorted(SETS), required=True, action="append",
                    help="a warm-up list (repeat: the union, each item once)")
    ap.add_argument("--shard", default="0/1", help="r/world: run items r, r+world, ...")
    ap.add_argument("--device", type=int, default=0)
    a = ap.parse_args(argv)
    items = sorted(dict.fromkeys(it for name in a.set for it in SETS[name]),
                   key=lambda it: ("gdn", "conv", "l2").index(it[0]))
    r, w = (int(v) for v in a.shard.split("/"))
    device = torch.device("cuda", a.device)
    torch.cuda.set_device(device)
    failed = 0
    for item in items[r::w]:
        t = time.time()
        print(f"start {item}", flush=True)
        try:
            _one(item, device)
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - a warm-up item only fills caches
            failed += 1
            print(f"FAILED {item}: {exc!r}"[:400], flush=True)
            continue
        print(f"done  {item} {time.time() - t:.1f}s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    import sys
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from autotune_policy import install

    print("autotune policy:", install(), flush=True)
    sys.exit(_main())
