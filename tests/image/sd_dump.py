"""Describe a GDN layer's state_dict and sharded_state_dict for one tree (run as a script).

    python tests/image/sd_dump.py --tree build/tree/base --out base.json [--mode M ...]

Runs a 4-rank gloo world on CPU (TP=2 x CP=2: TP groups [0,1],[2,3], CP groups [0,2],[1,3],
DP=1) and writes, per mode (``default`` = the tree's default) and rank: every state_dict key
with its shape and dtype, and every sharded tensor (factories expanded) with key, global
shape, global offset, axis fragmentations, local shape, prepend_axis_num and replica id.
Both trees are packages named ``megatron``, so each tree needs its own process.

    python tests/image/sd_dump.py --tree build/tree/base --gpt base --out base-gpt.json

instead describes the training tier's GPTModel checkpoint (``training.build_model`` at CP=1, one
rank, the model the upgrade runs of ``training_suite.upgrade_runs`` save and load): the model's
sharded state dict, the distributed optimizer's (flattened) and the model's state_dict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _describe_sharded(sd):
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    out = {}

    def tensor(t):
        return {
            "key": t.key,
            "global_shape": list(t.global_shape),
            "global_offset": list(t.global_offset),
            "axis_fragmentations": list(t.axis_fragmentations) if t.axis_fragmentations else None,
            "local_shape": list(t.local_shape),
            "prepend_axis_num": t.prepend_axis_num,
            "replica_id": list(t.replica_id) if isinstance(t.replica_id, tuple) else t.replica_id,
            "dtype": str(t.dtype),
        }

    for k in sorted(sd):
        v = sd[k]
        if isinstance(v, ShardedTensorFactory):
            parts = v.build_fn(v.key, v.data, v.replica_id, None)
            out[k] = {"type": "factory", "parts": [tensor(p) for p in parts]}
        elif isinstance(v, ShardedTensor):
            out[k] = {"type": "tensor", **tensor(v)}
        elif isinstance(v, ShardedObject):
            out[k] = {"type": "object", "key": v.key, "global_shape": list(v.global_shape),
                      "global_offset": list(v.global_offset)}
        else:
            out[k] = {"type": type(v).__name__}
    return out


def _worker(rank, world, modes):
    import torch.distributed as dist

    import gdn_harness as H

    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, cp = tp_groups[rank // 2], cp_groups[rank % 2]
    geom = H.GEOMETRIES["gqa_dk32_dv64"]
    out = {}
    for mode in modes:
        cfg = H.make_config(geom, tp=2, cp=2, mode=None if mode == "default" else mode,
                            cpu_init=True)
        m = H.build_gdn(cfg, H.make_pg(tp, cp))
        sd = {k: {"shape": list(v.shape), "dtype": str(v.dtype)} if hasattr(v, "shape")
              else {"type": type(v).__name__} for k, v in m.state_dict().items()}
        ssd = m.sharded_state_dict(prefix="decoder.layers.0.self_attention.",
                                   metadata={"dp_cp_group": cp})
        out[mode] = {"state_dict": sd, "sharded": _describe_sharded(ssd),
                     "linear_cp_mode": getattr(cfg, "linear_cp_mode", None)}
    return out


def _describe_nested(sd, prefix=""):
    """A nested (optimizer) sharded state dict flattened to ``{"a/b/c": description}``:
    sharded tensors and objects by key / global shape / offset, plain values by type."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    out = {}
    items = sd.items() if isinstance(sd, dict) else enumerate(sd) if isinstance(sd, (list, tuple)) else None
    if items is None:
        if isinstance(sd, (ShardedTensor, ShardedObject, ShardedTensorFactory)):
            out[prefix] = _describe_sharded({"x": sd})["x"]
        else:
            out[prefix] = {"type": type(sd).__name__}
        return out
    for k, v in items:
        out.update(_describe_nested(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def _gpt_worker(rank, world, tree):
    """The training tier's GPTModel + DDP + distributed optimizer (``training.build_model``, CP=1,
    the model the upgrade runs checkpoint) and its checkpoint's sharded state dict."""
    import torch

    import training as T
    from megatron.core import parallel_state as ps

    spec = T.RunSpec("sd", cp=1, mode="headwise", tree=tree)
    device = torch.device("cpu")
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    try:
        with T.cuda_literals_on_cpu(device):
            _, model, optimizer = T.build_model(spec, device)
            T.workaround_adam_state_before_load(optimizer)  # problem 2: state to describe
            sd = T._sharded(model, optimizer, 0, False, ps.get_data_parallel_group(
                with_context_parallel=True))
        return {"model": _describe_sharded(sd["model"]),
                "optimizer": _describe_nested(sd["optimizer"]),
                "state_dict": {k: {"shape": list(v.shape), "dtype": str(v.dtype)}
                               for k, v in model.module.state_dict().items() if hasattr(v, "shape")}}
    finally:
        ps.destroy_model_parallel()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", action="append", default=None)
    ap.add_argument("--gpt", choices=["base", "patched"],
                    help="instead of one layer: the training tier's GPTModel checkpoint (CP=1, "
                         "1 rank) as the tree named here builds it (must be --tree's)")
    args = ap.parse_args(argv)
    tree = str(Path(args.tree).resolve())
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, tree)
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import megatron.core.ssm.gated_delta_net as gdn

    assert gdn.__file__.startswith(tree + "/"), gdn.__file__
    from _world import run_world

    if args.gpt:
        results = run_world(_gpt_worker, 1, args.gpt, timeout=300)
        Path(args.out).write_text(json.dumps({"tree": tree, "gpt": results[0]}, indent=1,
                                             sort_keys=True))
        return
    results = run_world(_worker, 4, args.mode or ["default"], timeout=300)
    Path(args.out).write_text(json.dumps({"tree": tree, "ranks": results}, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
