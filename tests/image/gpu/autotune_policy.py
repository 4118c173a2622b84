"""Triton autotuning policy for the GPU suite: keep the first config that runs.

FLA autotunes every kernel over 9 to 36 configs per (heads, head dims, dtype, varlen) key,
and compiling them all for the suite's dozen keys takes far longer than its time budget.
With ``GDN_SUITE_AUTOTUNE=first`` (the default of ``tools/gpu-suite``) the autotuner still
walks FLA's config list in FLA's order, but stops compiling at the first config that
compiles and runs; that config is then used. Every config of a kernel computes the same
function, and the reference and the CP runs use the same policy, so the comparisons keep
their meaning; only kernel speed is left unmeasured. ``GDN_SUITE_AUTOTUNE=full`` leaves
Triton alone.
"""

from __future__ import annotations

import os

INF = float("inf")


def install(policy: str | None = None) -> str:
    policy = policy or os.environ.get("GDN_SUITE_AUTOTUNE", "first")
    if policy != "first":
        return "full"
    from triton.runtime import autotuner as at

    if getattr(at.Autotuner, "_gdn_first_viable", False):
        return policy
    orig_prune = at.Autotuner.prune_configs
    orig_bench = at.Autotuner._bench

    def prune_configs(self, kwargs, *a, **k):
        self._gdn_found = False  # a new tuning key starts here
        return orig_prune(self, kwargs, *a, **k)

    def _bench(self, *args, config, **meta):
        if getattr(self, "_gdn_found", False):
            return [INF, INF, INF]
        timing = orig_bench(self, *args, config=config, **meta)
        if timing and timing[0] != INF:
            self._gdn_found = True
        return timing

    at.Autotuner.prune_configs = prune_configs
    at.Autotuner._bench = _bench
    at.Autotuner._gdn_first_viable = True
    return policy
