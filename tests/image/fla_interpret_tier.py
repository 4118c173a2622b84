"""The real-kernel CPU tier: the patched GatedDeltaNet on FLA 0.4.2's own Triton kernels.

Run as a program in a fresh interpreter with ``TRITON_INTERPRET=1`` (``test_image_fla_interpret``
does that)::

    TRITON_INTERPRET=1 FLA_CACHE_RESULTS=0 python tests/image/fla_interpret_tier.py OUT.json

It installs the interpreter shims (``fla_interpret``), starts a 2-rank gloo world (``_world``;
FLA's CP all-gather through ``fla_gloo``) and runs every item of :data:`ITEMS` on the real
``causal_conv1d``, ``chunk_gated_delta_rule`` and ``fla.ops.cp`` context. No stand-in is used
except in the ``oracle`` items, which compare the real kernels against the float64-based eager
oracle (``fla_emulation``) at CP=1. Each record is appended to ``OUT.json.rank<r>.jsonl`` as
soon as it exists, so a world that hangs or dies still leaves the records it made; the program
then writes every record to ``OUT.json`` (a list) and exits 0 (1 when the world failed).

Geometry: hidden 64, 2 key / 2 value heads, K = V = 32, conv width 4, float32; global length
128 (8 for the short SBHD case). Items (``kind``):

* ``oracle``: CP=1 real kernels vs the eager oracle, gate of the patched-vs-base level.
* ``cp1``: CP=1, any mode, input with empty segments (or int64 ``cu_seqlens``) vs the same
  tokens without them; must agree to the patched-vs-base gate.
* ``cp2``: CP=2 in each mode vs the CP=1 reference of the same tokens (frozen CP>1 gate), with
  the mode's path proven by spies.
* ``fail_fast``: an input the mode cannot handle raises ``LinearCPError`` before any
  collective (collective bomb armed), at CP=1 and CP=2, SBHD and THD.
* ``reuse`` (issue 43): one ``PackedSeqParams`` reused for the next micro-batch, its boundaries
  rewritten in place (``copy_``) from :data:`REUSE_A` to :data:`REUSE_B`, not finalized, at
  CP=1 headwise and CP=2 in each mode, and finalized after the write at CP=2 chunkwise (FLA's
  own ``build_cp_context`` then runs in finalize): the second micro-batch must match a fresh
  ``PackedSeqParams`` of ``REUSE_B`` (its CP=1 reference, ``reuse_b``), and FLA must never
  receive a tensor the caller owns. The two packings give FLA different chunk counts per
  sequence (64 + 64 vs 96 + 32 tokens, chunks of 64), so FLA's identity-keyed index caches
  (FLA #1274) would serve the first one's chunk offsets for the caller's rewritten tensor.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

WORLD = 2
T = 128


@dataclass(frozen=True)
class Geom:
    hidden: int = 64
    k_heads: int = 2
    v_heads: int = 2
    dk: int = 32
    dv: int = 32
    conv: int = 4


@dataclass(frozen=True)
class TierCase:
    """``cu`` / ``valid`` as in ``gdn_harness.Case``; ``ref``: the case whose CP=1 result is the
    expected one (same tokens); ``cu_dtype``: dtype name of the cu_seqlens tensors."""

    name: str
    length: int
    cu: Optional[Sequence[int]] = None
    valid: Optional[Sequence[int]] = None
    ref: Optional[str] = None
    cu_dtype: str = "int32"


CASES = {c.name: c for c in (
    TierCase("sbhd", T),
    TierCase("thd", T, (0, 48, 100, 128), (45, 52, 20)),
    # padded static batching: zero-length segments at the start, in the middle, at the end
    TierCase("thd_empty_start", T, (0, 0, 48, 100, 128), (0, 45, 52, 20), ref="thd"),
    TierCase("thd_empty_middle", T, (0, 48, 48, 100, 128), (45, 0, 52, 20), ref="thd"),
    TierCase("thd_empty_end", T, (0, 48, 100, 128, 128), (45, 52, 20, 0), ref="thd"),
    TierCase("thd_empty_all", T, (0, 0, 48, 48, 100, 128, 128), (0, 45, 0, 52, 20, 0), ref="thd"),
    TierCase("thd_int64", T, (0, 48, 100, 128), (45, 52, 20), ref="thd", cu_dtype="int64"),
    # shards shorter than the conv width: a 4-token sequence (2 tokens per rank and chunk) and
    # an 8-token sequence across the contiguous rank boundary at 64
    TierCase("thd_short", T, (0, 4, 60, 68, 128), (4, 56, 8, 60)),
    # SBHD of 8 tokens: zigzag chunks of 2 tokens, chunkwise rank share 4 (conv halo 3)
    TierCase("sbhd_short", 8),
    # the second micro-batch of the reuse items, fresh
    TierCase("reuse_b", T, (0, 96, 128), (96, 32)),
)}

REFS = ("sbhd", "thd", "thd_short", "sbhd_short", "reuse_b")
# reuse items: the first micro-batch's boundaries, then the second's written over them
REUSE_A = (0, 64, 128)
REUSE_B = (0, 96, 128)
MODES = ("headwise", "chunkwise", "all_gather")
EMPTY = ("thd_empty_start", "thd_empty_middle", "thd_empty_end")

# (id, kind, cp, mode, case). At CP=1 every mode runs the same code (the spies check that no
# CP path runs), so the three empty-segment kinds run once there and the other modes see
# them together (``thd_empty_all``); at CP=2 each mode sees them together, and int64
# cu_seqlens go through FLA's CP context (chunkwise).
ITEMS = (
    [(f"oracle/{c}", "oracle", 1, "headwise", c) for c in REFS]
    + [(f"cp1/headwise/{c}", "cp1", 1, "headwise", c) for c in EMPTY + ("thd_int64",)]
    + [(f"cp1/{m}/thd_empty_all", "cp1", 1, m, "thd_empty_all") for m in MODES[1:]]
    + [(f"cp2/{m}/{c}", "cp2", 2, m, c) for m in MODES
       for c in ("sbhd", "thd", "thd_empty_all", "thd_short", "sbhd_short")]
    + [("cp2/chunkwise/thd_int64", "cp2", 2, "chunkwise", "thd_int64")]
    + [("reuse/cp1/headwise/copy_", "reuse", 1, "headwise", "reuse_b")]
    + [(f"reuse/cp2/{m}/copy_", "reuse", 2, m, "reuse_b") for m in MODES]
    # finalized after the write (the contract): FLA's own build_cp_context runs at finalize
    + [("reuse/cp2/chunkwise/copy_finalized", "reuse", 2, "chunkwise", "reuse_b")]
)

# fail-fast inputs: name -> (local hidden length, cu_seqlens or None, cu dtype, CP sizes)
FAIL_FAST = {
    # SBHD 5 tokens per rank: 10 global tokens do not split into 2*CP = 4 zigzag chunks
    "sbhd_5_per_rank": (5, None, "int32", (2,)),
    # THD: a 50-token sequence does not split into 4 chunks
    "thd_len_not_div_2cp": (64, (0, 50, 128), "int32", (2,)),
    # fewer tokens than 2*CP zigzag chunks (1 per rank)
    "sbhd_tokens_fewer_than_2cp": (1, None, "int32", (2,)),
    "thd_tokens_fewer_than_2cp": (1, (0, 2), "int32", (2,)),
    # a micro-batch without tokens
    "sbhd_zero_tokens": (0, None, "int32", (1, 2)),
    "thd_zero_tokens": (0, (0, 0), "int32", (1, 2)),
    # cu_seqlens of a dtype that is not int32/int64
    "thd_cu_float": (64, (0, 48, 128), "float32", (1, 2)),
    # tensors for FLA with >= 2**31 elements (FLA 0.4.2 computes offsets in int32)
    "sbhd_2pow31_elements": (1 << 24, None, "int64", (1, 2)),
    "thd_2pow31_elements": (1 << 24, "whole", "int64", (1, 2)),
}
FAIL_FAST_ITEMS = [(f"fail_fast/cp{p}/{m}/{n}", "fail_fast", p, m, n)
                   for n, (_, _, _, sizes) in FAIL_FAST.items() for p in sizes for m in MODES]


def all_ids():
    return [i[0] for i in ITEMS] + [i[0] for i in FAIL_FAST_ITEMS]


# --------------------------------------------------------------------------------------
# the worker (one per rank)
# --------------------------------------------------------------------------------------


def _harness_case(c: TierCase):
    import gdn_harness as H

    return H.Case(c.name, c.length, list(c.cu) if c.cu else None, list(c.valid) if c.valid else None)


def _psp(c: TierCase):
    import torch

    import gdn_harness as H

    psp = H.packed_seq_params(_harness_case(c), "cpu")
    if psp is not None and c.cu_dtype != "int32":
        dt = getattr(torch, c.cu_dtype)
        for f in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            setattr(psp, f, getattr(psp, f).to(dt))
    return psp


def _reuse_case(cu):
    return TierCase("reuse", cu[-1], cu, tuple(b - a for a, b in zip(cu[:-1], cu[1:])))


def _psp_of(cu):
    """A PackedSeqParams whose four boundary fields are the one tensor ``cu``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    fields = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
    return PackedSeqParams(qkv_format="thd", max_seqlen_q=int(cu[-1]), max_seqlen_kv=int(cu[-1]),
                           **{f: cu for f in fields})


def _fla_tensor_args(module):
    """Record ``(entry point, argument, tensor)`` for every boundary tensor Megatron hands FLA's
    conv, scan and ``build_cp_context`` (wrapping, never replacing, the real ones)."""
    import contextlib
    from unittest import mock

    import torch

    import fla.ops.cp
    import megatron.core.ssm.gated_delta_net as gdn

    received = []

    def wrap(entry, fn):
        def spy(*a, **k):
            received.extend((entry, n, t) for n, t in k.items()
                            if n in ("cu_seqlens", "cu_seqlens_cpu") and torch.is_tensor(t))
            return fn(*a, **k)
        return spy

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(gdn, "causal_conv1d", wrap("causal_conv1d", gdn.causal_conv1d)))
    stack.enter_context(mock.patch.object(
        module, "gated_delta_rule", wrap("chunk_gated_delta_rule", module.gated_delta_rule)))
    for owner in (gdn, fla.ops.cp):
        if hasattr(owner, "build_cp_context"):
            stack.enter_context(mock.patch.object(
                owner, "build_cp_context", wrap("build_cp_context", owner.build_cp_context)))

    @contextlib.contextmanager
    def ctx():
        with stack:
            yield received

    return ctx()


def _worker(rank, world, out_prefix, select):
    import torch
    import torch.distributed as dist

    import fla_gloo
    import fla_interpret
    import gdn_harness as H

    fla_interpret.install()
    fla_gloo.install()
    singles = [dist.new_group([r]) for r in range(world)]
    single, pair = singles[rank], dist.group.WORLD
    geom = Geom()
    log = open(f"{out_prefix}.rank{rank}.jsonl", "a")
    t0 = time.monotonic()

    def emit(rec):
        rec.setdefault("rank", rank)
        rec["t"] = round(time.monotonic() - t0, 1)
        log.write(json.dumps(rec) + "\n")
        log.flush()

    def build(cp, mode, cp_group, **extra):
        cfg = H.make_config(geom, cp=cp, mode=mode, cpu_init=True, **extra)
        m = H.build_gdn(cfg, H.make_pg(single, cp_group))
        H.set_weights(m)
        return m

    def guarded(rid, kind, fn):
        start = time.monotonic()
        try:
            rec = fn()
        except Exception as exc:  # noqa: BLE001 - recorded, asserted by the test
            rec = {"passed": False, "error": repr(exc)[:600], "traceback": traceback.format_exc()[-3000:]}
        rec.update(id=rid, kind=kind, seconds=round(time.monotonic() - start, 1))
        emit(rec)
        return rec

    def inputs(c: TierCase):
        return H.global_inputs(_harness_case(c), geom.hidden, seed=11)

    # 1. CP=1 references, split over the ranks, then shared; each checked against the oracle.
    # (--only: also the references the selected items compare with)
    refs = {}
    needed = {CASES[it[4]].ref or it[4] for it in ITEMS
              if it[1] in ("cp1", "cp2", "reuse") and select(it[0])}
    for i, name in enumerate(REFS):
        if i % world != rank:
            continue
        c = CASES[name]
        x, G = inputs(c)

        def ref_and_oracle(c=c, x=x, G=G, name=name):
            from fla_emulation import emulated_fla_in_megatron

            res = H.run_layer(build(1, "headwise", single), x, G, _psp(c))
            refs[name] = res
            with emulated_fla_in_megatron():
                oracle = H.run_layer(build(1, "headwise", single), x, G, _psp(c))
            checks = H.compare_to_reference(res, oracle, torch.arange(c.length), single,
                                            H.GATE_OLD_NEW)
            return {"passed": H.all_passed(checks), "checks": checks}

        if select(f"oracle/{name}") or name in needed:
            guarded(f"oracle/{name}", "oracle", ref_and_oracle)
        else:  # --only left the oracle item out: the CP items still need the reference
            refs[name] = H.run_layer(build(1, "headwise", single), x, G, _psp(c))
    gathered = [None] * world
    dist.all_gather_object(gathered, refs)
    refs = {k: v for part in gathered for k, v in part.items()}

    def expect(c: TierCase, mode, cp):
        return H.expected_path(mode, cp, geom, _harness_case(c))

    # 2. CP=1 items, split over the ranks.
    cp1 = [it for it in ITEMS if it[1] == "cp1"]
    for i, (rid, kind, _, mode, name) in enumerate(cp1):
        if i % world != rank or not select(rid):
            continue
        c = CASES[name]

        def run_cp1(c=c, mode=mode):
            x, G = inputs(c)
            m = build(1, mode, single)
            with H.spy_paths(m) as spy:
                res = H.run_layer(m, x, G, _psp(c))
            checks = H.compare_to_reference(res, refs[c.ref], torch.arange(c.length), single,
                                            H.GATE_OLD_NEW)
            path = H.check_path(spy, expect(c, mode, 1))
            return {"passed": path["passed"] and H.all_passed(checks), "checks": checks,
                    "path": path}

        guarded(rid, kind, run_cp1)

    # 3. CP=2 items, both ranks together.
    for rid, kind, P, mode, name in (it for it in ITEMS if it[1] == "cp2"):
        if not select(rid):
            continue
        c = CASES[name]

        def run_cp2(c=c, mode=mode, P=P):
            x, G = inputs(c)
            idx = H.shard_index(_harness_case(c), P, dist.get_rank(pair))
            m = build(P, mode, pair)
            with H.spy_paths(m) as spy:
                res = H.run_layer(m, x[idx], G[idx], _psp(c))
            checks = H.compare_to_reference(res, refs[c.ref or c.name], idx, pair, H.GATE_CP)
            path = H.check_path(spy, expect(c, mode, P))
            return {"passed": path["passed"] and H.all_passed(checks), "checks": checks,
                    "path": path}

        guarded(rid, kind, run_cp2)
        dist.barrier()

    # 4. reuse items (CP=1 on rank 0, CP=2 on both ranks).
    for rid, kind, P, mode, name in (it for it in ITEMS if it[1] == "reuse"):
        if not select(rid) or (P == 1 and rank != 0):
            continue
        group = pair if P > 1 else single

        def run_reuse(P=P, mode=mode, group=group, name=name, finalized=rid.endswith("_finalized")):
            x, G = inputs(CASES[name])
            m = build(P, mode, group)
            cu = torch.tensor(REUSE_A, dtype=torch.int32)
            psp = _psp_of(cu)
            with _fla_tensor_args(m) as received:
                idx = H.shard_index(_harness_case(_reuse_case(REUSE_A)), P, dist.get_rank(group))
                with torch.no_grad():  # the first micro-batch: its forward fills FLA's caches
                    m(x[idx], None, packed_seq_params=psp)
                cu.copy_(torch.tensor(REUSE_B, dtype=torch.int32))  # the loader's next batch
                if finalized:
                    from megatron.core.context_parallel_layout import finalize_packed_seq_params

                    finalize_packed_seq_params(psp, cp_group=group)
                idx = H.shard_index(_harness_case(CASES[name]), P, dist.get_rank(group))
                res = H.run_layer(m, x[idx], G[idx], psp)
            gate = H.GATE_CP if P > 1 else H.GATE_OLD_NEW
            checks = H.compare_to_reference(res, refs[name], idx, group, gate)
            owned = sorted({f"{entry}:{arg}" for entry, arg, t in received
                            if t.untyped_storage().data_ptr() == cu.untyped_storage().data_ptr()})
            checks["fla_never_gets_the_callers_tensor"] = {"passed": not owned, "received": owned}
            return {"passed": H.all_passed(checks), "checks": checks}

        guarded(rid, kind, run_reuse)
        if P > 1:
            dist.barrier()

    # 5. fail-fast items.
    for rid, kind, P, mode, name in FAIL_FAST_ITEMS:
        if not select(rid):
            continue
        local, cu, cu_dtype, _ = FAIL_FAST[name]

        def run_fail_fast(P=P, mode=mode, local=local, cu=cu, cu_dtype=cu_dtype):
            from megatron.core.packed_seq_params import PackedSeqParams

            m = build(P, mode, pair if P > 1 else single)
            x = torch.zeros(1, 1, geom.hidden).expand(local, 1, geom.hidden)
            psp = None
            if cu is not None:
                bounds = (0, local * P) if cu == "whole" else cu
                t = torch.tensor(bounds, dtype=getattr(torch, cu_dtype))
                psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=t, cu_seqlens_kv=t,
                                      cu_seqlens_q_padded=t, cu_seqlens_kv_padded=t,
                                      max_seqlen_q=local * P, max_seqlen_kv=local * P)
            # a missing check must not reach the (huge) projection either
            r = H.attempt(lambda: m(x, None, packed_seq_params=psp), module=m)
            ok = r["raised"] == "LinearCPError" and not r["collectives"] and bool(r["message"])
            return {"passed": ok, **r}

        guarded(rid, kind, run_fail_fast)
    log.close()
    return None


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON file to write (a list of records)")
    ap.add_argument("--only", default="", help="run only ids starting with this prefix")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds for the whole world")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("error: TRITON_INTERPRET=1 must be set before Python starts\n"
              "hint: run TRITON_INTERPRET=1 python tests/image/fla_interpret_tier.py OUT.json",
              file=sys.stderr)
        return 2
    import _image_env  # noqa: F401  (puts $GDN_TREE first on sys.path)
    import fla_interpret

    versions = fla_interpret.install()  # fails loudly on version drift, before any worker
    from _world import run_world

    out = Path(args.out)
    prefix = str(out)
    for r in range(WORLD):
        Path(f"{prefix}.rank{r}.jsonl").unlink(missing_ok=True)
    t0 = time.monotonic()
    only = args.only
    world_error = None
    try:
        run_world(_worker, WORLD, prefix, (lambda rid: rid.startswith(only)) if only else _all,
                  timeout=args.timeout)
    except Exception as exc:  # noqa: BLE001 - reported in the output
        world_error = repr(exc)[-3000:]
    records = []
    for r in range(WORLD):
        p = Path(f"{prefix}.rank{r}.jsonl")
        if p.exists():
            records += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    wall = round(time.monotonic() - t0, 1)
    out.write_text(json.dumps({"records": records, "world_error": world_error, "wall_s": wall,
                               "versions": versions, "tree": os.environ.get("GDN_TREE")},
                              indent=1, sort_keys=True) + "\n")
    print(f"fla_interpret_tier: {len(records)} records, "
          f"{sum(not r['passed'] for r in records)} failed, {wall} s"
          + (f", world failed: {world_error}" if world_error else ""), file=sys.stderr)
    return 1 if world_error else 0


def _all(rid):
    return True


if __name__ == "__main__":
    sys.exit(main())
