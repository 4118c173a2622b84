#!/usr/bin/env python3
"""Host time of routing the packed-THD zigzag <-> contiguous conversion (CPU; no GPU needed).

    .venv/bin/python bench/thd_route.py [--tree build/tree/patched] [--repeats 20]

Prints, per (tokens, samples, CP), the milliseconds one ``ThdLayoutRoutes`` takes to build (both
directions, one rank) against upstream's host-side share of the same route: its
``get_thd_context_parallel_rank_indices`` for every rank in both layouts, which upstream's
``_zigzag_contiguous_thd_swap`` computes twice per conversion (on the device, with host syncs,
when given device ``cu_seqlens``). One thread, as under torchrun.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = ((32768, 8, 2), (131072, 8, 2), (131072, 64, 4), (131072, 8, 8))


class _Group:
    """The two methods ThdLayoutRoutes reads from a process group."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _ms(fn, repeats):
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=str(REPO / "build" / "tree" / "patched"))
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if not Path(args.tree, "megatron", "core", "ssm", "gdn_context_parallel.py").is_file():
        ap.error(f"--tree {args.tree} holds no megatron/core/ssm/gdn_context_parallel.py; build the "
                 "patched tree with tools/backport --upstream 5139086e or pass its path")
    sys.path.insert(0, args.tree)
    import torch

    torch.set_num_threads(1)
    from megatron.core.context_parallel_layout import get_thd_context_parallel_rank_indices
    from megatron.core.ssm.gdn_context_parallel import ThdLayoutRoutes

    print("| tokens | samples | CP | ThdLayoutRoutes ms | upstream's rank indices, one conversion, ms |")
    print("| --- | --- | --- | --- | --- |")
    for tokens, samples, cp in CASES:
        cu = torch.arange(samples + 1, dtype=torch.long) * (tokens // samples)
        ours = _ms(lambda: ThdLayoutRoutes(cu, _Group(cp, 0), "cpu"), args.repeats)
        theirs = _ms(lambda: [get_thd_context_parallel_rank_indices(cu, cp, r, lay)
                              for r in range(cp) for lay in ("zigzag", "contiguous")], args.repeats)
        print(f"| {tokens} | {samples} | {cp} | {ours:.3f} | {theirs:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
