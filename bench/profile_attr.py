"""Attribute one profiled GDN layer step to its parts (issue 17: "attribute every millisecond").

Owns the arithmetic from torch.profiler (Kineto) events to a table; ``bench/gdn_layer.py``
collects the events on the GPU and ``bench/report.py`` prints the table. Pure Python, so the
rules are unit-tested on synthetic events (``tests/unit/test_bench_tools.py``).

Per phase (``gdn::forward`` and ``gdn::backward``, host ranges the bench opens around the
layer call and around ``backward()``, with a device synchronisation between them):

* ``wall_ms``: from the phase's host start to the end of its last GPU activity;
* ``busy_ms``: the union of GPU activity (kernels, memcpy, memset) over all streams in that
  window, so work that overlaps on two streams (NCCL beside compute) counts once;
* ``idle_ms = wall_ms - busy_ms``: the GPU waiting for the host (Python and launch overhead,
  host syncs, waiting on the other rank before a collective is launched);
* ``host_syncs`` / ``host_sync_ms``: CUDA runtime calls made inside the phase's host range
  that block the host until the device drains (``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, synchronous ``cudaMemcpy``), and the
  host time spent inside them (the bench's own synchronisation after the range is not counted).

Kernel time (sum of durations, both phases) is grouped twice: by category of the kernel name
(``category``), and by scope, the innermost host range that launched it: a ``gdn::<part>``
range the bench wraps around a function in the forward, or the autograd node
(``autograd::engine::evaluate_function: <Node>``) in the backward. ``scope_coverage`` is the
share of kernel time whose launch was found; categories do not depend on it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

PHASES = ("gdn::forward", "gdn::backward")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
BACKWARD_NODE = "autograd::engine::evaluate_function: "
# Category order matters: the first rule that matches names the kernel.
CATEGORIES = (
    ("all-to-all (SendRecv)", ("sendrecv", "alltoall", "all_to_all")),
    ("all-gather (FLA CP exchange)", ("allgather", "all_gather")),
    ("other collectives", ("nccl",)),
    ("fused elementwise (torch.compile)", ("triton_poi", "triton_red", "triton_per")),
    ("gemm (in_proj, out_proj)", ("gemm", "cutlass", "nvjet", "xmma", "cublas")),
    ("causal_conv1d (incl. CP halo)", ("conv",)),
    ("norms (l2norm, RMSNorm)", ("l2norm", "rmsnorm", "norm")),
    ("gated delta rule scan (incl. CP state merge)", (
        "chunk", "fwd_h", "bwd_dh", "dqkwg", "dv_local", "wy", "recompute_w_u", "solve_tril",
        "cumsum", "kkt", "fwd_o", "bwd_o", "merge", "pre_process", "state", "gated_delta")),
    ("copies and elementwise (eager)", ("copy", "elementwise", "cat", "index", "fill", "reduce",
                                        "memcpy", "memset")),
)
OTHER = "other"


@dataclass(frozen=True)
class Event:
    """One Kineto event. ``kind``: Kineto's activity type (``kernel``, ``gpu_memcpy``,
    ``gpu_memset``, ``cuda_runtime``, ``cpu_op``, ``user_annotation``, ...); times in ns on the
    profiler's common clock; ``corr``: correlation id (a launch and its kernel share it, through
    ``linked``: the launching ATen op's id on a kernel); ``thread``: host thread id (kept for
    the record, not used: see ``_scopes``)."""

    name: str
    kind: str
    start: int
    end: int
    thread: int = 0
    corr: int = 0
    linked: int = 0

    @property
    def on_gpu(self) -> bool:
        return self.kind in ("kernel", "gpu_memcpy", "gpu_memset")


def events_from_chrome_trace(trace) -> list[Event]:
    """The complete (``"ph": "X"``) events of a torch.profiler Chrome trace as ``Event`` records.

    ``trace``: the dict of ``prof.export_chrome_trace(path)``'s JSON (times in us, floats).
    Kineto writes ``cat`` (the activity type), ``args["External id"]`` on host ops and on the
    kernels they launched, and ``args["correlation"]`` on a CUDA runtime call and its kernel.
    The documented, version-stable form of the profile (``prof.profiler.kineto_results`` lost the
    ``record_function`` ranges on torch 2.11 with CUDA activity, session 20 call A).

    Raises ValueError (naming the Chrome trace) for anything else: not an object with a
    ``traceEvents`` list, or an event whose fields have the wrong types (the bench treats a
    ValueError as "not attributable" on that rank and still joins the other ranks)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"not a Chrome trace: expected an object with a 'traceEvents' list, got "
                         f"{type(trace).__name__}" + (f" with {type(events).__name__} traceEvents"
                                                      if isinstance(trace, dict) else ""))
    out = []
    for i, e in enumerate(events):
        try:
            if e.get("ph") != "X" or "ts" not in e:
                continue
            args = e.get("args") or {}
            kind = e.get("cat", "")
            start = int(round(float(e["ts"]) * 1000))
            end = start + int(round(float(e.get("dur", 0)) * 1000))
            ext, cor = int(args.get("External id", 0) or 0), int(args.get("correlation", 0) or 0)
        except (AttributeError, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"Chrome trace event {i} is malformed ({type(exc).__name__}: {exc}): "
                             f"{str(e)[:200]}") from None
        on_gpu = kind in ("kernel", "gpu_memcpy", "gpu_memset")
        out.append(Event(name=str(e.get("name", "")), kind=str(kind), start=start, end=end,
                         thread=int(e["tid"]) if str(e.get("tid", "")).lstrip("-").isdigit() else 0,
                         corr=cor if (on_gpu or kind in ("cuda_runtime", "cuda_driver")) else ext,
                         linked=ext if on_gpu else 0))
    return out


def category(name: str) -> str:
    """The category of a GPU activity's name (first matching rule of ``CATEGORIES``)."""
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return OTHER


def _union_ns(intervals):
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _ms(ns):
    return round(ns / 1e6, 4)


def _launch_index(events):
    """Two maps to the host time a GPU activity was launched at: the launching op's own id
    (Kineto's ``linked`` id on the kernel: torch links kernels to their ATen op this way) and the
    CUDA runtime call's correlation id (the kernel's ``corr``)."""
    by_op, by_runtime = {}, {}
    for e in events:
        if e.kind in ("cpu_op", "user_annotation") and e.corr:
            by_op[e.corr] = e.start
        elif e.kind in ("cuda_runtime", "cuda_driver") and e.corr:
            by_runtime[e.corr] = e.start
    return by_op, by_runtime


def _scopes(events):
    """Host ranges that name a scope, sorted by start. Threads are not compared: Kineto numbers
    CUDA runtime threads and ATen threads differently, and the forward and backward phases are
    separated in time by a device synchronisation."""
    ranges = [e for e in events if e.kind in ("user_annotation", "cpu_op") and (
        (e.name.startswith("gdn::") and e.name not in PHASES) or e.name.startswith(BACKWARD_NODE))]
    ranges.sort(key=lambda e: (e.start, -e.end))
    return ranges, [r.start for r in ranges]


def _scope_of(t, scopes):
    ranges, starts = scopes
    inner = None
    for r in ranges[:bisect.bisect_right(starts, t)]:  # innermost: the latest start that holds t
        if r.end >= t:
            inner = r
    if inner is None:
        return None
    if inner.name.startswith(BACKWARD_NODE):
        return inner.name[len(BACKWARD_NODE):] + " (backward)"
    return inner.name[len("gdn::"):]


def attribute(events: list[Event]) -> dict:
    """Attribution of one profiled step (one rank): see the module docstring.

    Returns ``{"phases": {phase: {wall_ms, busy_ms, idle_ms, host_syncs, host_sync_ms,
    kernel_ms}}, "total": {same keys summed}, "category_ms": {...}, "overlap_ms",
    "scope_ms": {...}, "scope_coverage", "host_syncs_by_scope": {scope: count},
    "host_ranges_ms": {gdn part: host ms}}``; all times in
    ms, rounded to 0.1 us. Raises ValueError when a phase range is missing (the bench did not
    open it, so the events are not a profiled layer step)."""
    phase_ev = {}
    for e in sorted(events, key=lambda e: e.start):  # the host range first, its GPU projection later
        if e.name in PHASES and e.kind in ("user_annotation", "cpu_op", "gpu_user_annotation"):
            phase_ev.setdefault(e.name, e)
    missing = [p for p in PHASES if p not in phase_ev]
    if missing:
        kinds = {}
        for e in events:
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
        named = sorted({f"{e.name} ({e.kind})" for e in events if e.name.startswith("gdn::")})[:12]
        raise ValueError(f"no {', '.join(missing)} range among {len(events)} profiler events "
                         f"(kinds {dict(sorted(kinds.items()))}; gdn ranges {named}); profile the step "
                         "inside record_function ranges of those names")
    order = sorted(phase_ev.values(), key=lambda e: e.start)
    gpu = sorted((e for e in events if e.on_gpu), key=lambda e: e.start)
    (by_op, by_runtime), scopes = _launch_index(events), _scopes(events)
    phases, cats, scope_ms, sync_scopes = {}, {}, {}, {}
    found_ns = total_kernel_ns = 0
    for i, ph in enumerate(order):
        hi = order[i + 1].start if i + 1 < len(order) else float("inf")
        acts = [e for e in gpu if ph.start <= e.start < hi]
        end = max([ph.end] + [e.end for e in acts])
        busy = _union_ns([(e.start, e.end) for e in acts])
        syncs = [e for e in events if e.kind in ("cuda_runtime", "cuda_driver")
                 and e.name in SYNC_CALLS and ph.start <= e.start < ph.end]
        for e in syncs:
            where = _scope_of(e.start, scopes) or "unattributed"
            sync_scopes[where] = sync_scopes.get(where, 0) + 1
        kernel_ns = sum(e.end - e.start for e in acts)
        phases[ph.name[len("gdn::"):]] = {
            "wall_ms": _ms(end - ph.start), "busy_ms": _ms(busy), "idle_ms": _ms(end - ph.start - busy),
            "host_syncs": len(syncs), "host_sync_ms": _ms(sum(e.end - e.start for e in syncs)),
            "kernel_ms": _ms(kernel_ns)}
        for e in acts:
            d = e.end - e.start
            total_kernel_ns += d
            c = category(e.name) if e.kind == "kernel" else "copies and elementwise (eager)"
            cats[c] = cats.get(c, 0) + d
            launch = by_op.get(e.linked, by_runtime.get(e.corr))
            scope = _scope_of(launch, scopes) if launch is not None else None
            if scope is not None:
                found_ns += d
            key = scope or "unattributed"
            scope_ms[key] = scope_ms.get(key, 0) + d
    total = {k: round(sum(p[k] for p in phases.values()), 4) for k in next(iter(phases.values()))}
    host_ranges = {}
    for e in events:
        if e.kind == "user_annotation" and e.name.startswith("gdn::") and e.name not in PHASES:
            key = e.name[len("gdn::"):]
            host_ranges[key] = host_ranges.get(key, 0) + (e.end - e.start)
    return {
        "phases": phases, "total": total,
        "category_ms": {k: _ms(v) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "overlap_ms": round(_ms(total_kernel_ns) - total["busy_ms"], 4),
        "scope_ms": {k: _ms(v) for k, v in sorted(scope_ms.items(), key=lambda kv: -kv[1])},
        "scope_coverage": round(found_ns / total_kernel_ns, 4) if total_kernel_ns else None,
        "host_syncs_by_scope": dict(sorted(sync_scopes.items())),
        "host_ranges_ms": {k: _ms(v) for k, v in sorted(host_ranges.items())},
    }
