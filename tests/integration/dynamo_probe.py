"""Whether Dynamo traces ``GatedDeltaNet._prepare_qkv_for_gated_delta_rule`` in a patched tree.

Run as a script: ``python dynamo_probe.py TREE``; prints one JSON object on stdout. It builds
a one-layer GatedDeltaNet from ``TREE`` on CPU (CP=1, headwise, one-rank gloo world, FLA
replaced by the CPU stand-ins of ``tests/image/fla_emulation``), compiles ``forward`` with a
counting backend (``torch._dynamo.testing.CompileCounter``, no Inductor) and reports:

* ``forward_frames`` / ``forward_ops``: frames Dynamo compiled from ``forward`` and the ops
  in their graphs (non-zero: Dynamo really traced forward);
* ``helper_in_graph``: whether any graph node was traced inside the helper (its frame name
  in the node's stack trace);
* ``helper_frames``: Dynamo cache entries of the helper's own code (compiled as a frame);
* ``direct_*``: the same for the helper called alone from a compiled function (no call
  site of forward around it), which tells a decorator (protected there too) from a guard at
  forward's call site (traced there: the guard is what keeps Dynamo off); ``direct_error``:
  a Dynamo error raised while tracing it that way (torch 2.13 fails to guard a method
  wrapped by ``torch.compile``, i.e. ``@jit_fuser``, when it traces into it);
* ``decorators``: the helper's decorators as written in the tree.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import warnings
from pathlib import Path

HELPER = "_prepare_qkv_for_gated_delta_rule"


def _counting_backend():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    traces: list = []

    def backend(gm, example_inputs):
        traces.extend(str(n.meta.get("stack_trace") or "") for n in gm.graph.nodes)
        return counter(gm, example_inputs)

    return counter, traces, backend


def _helper_frames(fn) -> int:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    seen, n = set(), 0
    while fn is not None and id(fn) not in seen:  # through torch.compile / disable wrappers
        seen.add(id(fn))
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_name == HELPER:
            n += len(_debug_get_cache_entry_list(code))
        fn = getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", None)
    return n


def main(tree: str) -> dict:
    os.environ.pop("TORCHDYNAMO_DISABLE", None)
    here = Path(__file__).resolve().parents[1] / "image"
    sys.path[:0] = [tree, str(here)]
    warnings.simplefilter("ignore")

    import torch
    import torch.distributed as dist

    from _world import free_port, install_cpu_device_shim

    install_cpu_device_shim()
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        import gdn_harness as H
        from fla_emulation import emulated_fla_in_megatron
        from megatron.core.ssm import gated_delta_net as gdn

        assert Path(gdn.__file__).resolve().is_relative_to(Path(tree).resolve()), gdn.__file__
        src = Path(gdn.__file__).read_text()
        cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "GatedDeltaNet")
        fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == HELPER)
        out = {"decorators": [ast.unparse(d) for d in fn.decorator_list]}
        geom = H.GEOMETRIES["gqa_dk32_dv64"]
        with emulated_fla_in_megatron():
            cfg = H.make_config(geom, cp=1, mode="headwise", cpu_init=True)
            layer = H.build_gdn(cfg, H.make_pg(dist.group.WORLD, dist.group.WORLD))
            H.set_weights(layer)
            x = torch.randn(16, 1, geom.hidden)
            eager, _ = layer(x, None)

            torch._dynamo.reset()
            counter, traces, backend = _counting_backend()
            compiled, _ = torch.compile(layer.forward, backend=backend)(x, None)
            out.update(forward_frames=counter.frame_count, forward_ops=counter.op_count,
                       helper_in_graph=any(f"in {HELPER}" in t for t in traces),
                       helper_frames=_helper_frames(type(layer).__dict__[HELPER]),
                       max_abs_diff=float((eager - compiled).abs().max()))

            torch._dynamo.reset()
            counter, traces, backend = _counting_backend()
            qkv = torch.randn(1, 16, 2 * layer.qk_dim_local_tp + layer.v_dim_local_tp)
            heads = layer.num_value_heads
            gate, beta, alpha = torch.randn(1, 16, heads, geom.dv), torch.randn(1, 16, heads), torch.randn(1, 16, heads)
            error = None
            try:
                torch.compile(lambda *a: layer._prepare_qkv_for_gated_delta_rule(*a), backend=backend)(
                    qkv, gate, beta, alpha, 1, 16)
            except torch._dynamo.exc.TorchDynamoException as exc:  # Dynamo went in and failed there
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                error += " (in the helper)" if HELPER in "".join(__import__("traceback").format_exception(exc)) else ""
            out.update(direct_frames=counter.frame_count, direct_ops=counter.op_count,
                       direct_helper_in_graph=any(f"in {HELPER}" in t for t in traces), direct_error=error)
        return out
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), sort_keys=True))
