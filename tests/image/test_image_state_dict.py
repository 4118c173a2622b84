"""GDN checkpoint layout is unchanged by the backport and stays TP-only.

``sd_dump.py`` runs once per tree in its own process (both trees are named ``megatron``):
a 4-rank gloo world, TP=2 x CP=2, one GatedDeltaNet with explicit submodules (tensor-
parallel linears, torch norm: transformer_engine is absent). The base tree's layer and the
patched tree's layer in each of its modes must give, rank by rank, identical state_dict
keys/shapes/dtypes and identical sharded tensors (keys, global shapes, offsets, axis
fragmentations, local shapes, replica ids). On CPU ``torch.cuda.current_device()`` answers
``"cpu"`` inside the workers (see ``_world``), because the layer asks it for its conv and
decay parameters' device.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from _image_env import BASE_TREE, GDN_TREE, HERE, need_base_tree, need_fla

MODES = ["default", "headwise", "chunkwise", "all_gather"]
_cache = {}


def _dump(tree, modes, tmp_path_factory):
    key = (str(tree), tuple(modes))
    if key not in _cache:
        out = tmp_path_factory.mktemp("sd") / "dump.json"
        env = dict(os.environ, PYTHONPATH=str(HERE))
        cmd = [sys.executable, "-W", "ignore", str(HERE / "sd_dump.py"), "--tree", str(tree),
               "--out", str(out)] + [a for m in modes for a in ("--mode", m)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        _cache[key] = json.loads(out.read_text())
    return _cache[key]


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_and_sharded_state_dict_identical_to_base(tmp_path_factory, mode):
    need_base_tree()
    need_fla()
    base = _dump(BASE_TREE, ["default"], tmp_path_factory)
    patched = _dump(GDN_TREE, MODES, tmp_path_factory)
    assert base["tree"] != patched["tree"]
    for rank in range(4):
        b = base["ranks"][rank]["default"]
        p = patched["ranks"][rank][mode]
        assert p["state_dict"] == b["state_dict"], rank
        assert sorted(p["sharded"]) == sorted(b["sharded"]), rank
        for k in b["sharded"]:
            assert p["sharded"][k] == b["sharded"][k], (rank, k)


def test_patched_default_mode_is_headwise(tmp_path_factory):
    need_base_tree()
    need_fla()
    patched = _dump(GDN_TREE, MODES, tmp_path_factory)
    assert patched["ranks"][0]["default"]["linear_cp_mode"] == "headwise"


@pytest.mark.parametrize("mode", MODES)
def test_gdn_parameters_are_sharded_over_tp_only(tmp_path_factory, mode):
    """Every sharded tensor is split at most TP=2 ways, on one axis; CP never shards it."""
    need_base_tree()
    need_fla()
    patched = _dump(GDN_TREE, MODES, tmp_path_factory)
    for rank in range(4):
        for k, v in patched["ranks"][rank][mode]["sharded"].items():
            parts = v["parts"] if v["type"] == "factory" else [v] if v["type"] == "tensor" else []
            for t in parts:
                frags = t["axis_fragmentations"] or [1]
                assert math.prod(frags) in (1, 2), (rank, k, frags)
                assert t["prepend_axis_num"] == 0, (rank, k)
                # ranks of one TP group hold different offsets; CP peers the same ones
                peer = patched["ranks"][rank ^ 2][mode]["sharded"][k]
                peer_parts = peer["parts"] if peer["type"] == "factory" else [peer]
                assert [p["global_offset"] for p in peer_parts] == [
                    q["global_offset"] for q in parts], (rank, k)


def _dump_gpt(tree, name, tmp_path_factory):
    key = ("gpt", str(tree))
    if key not in _cache:
        out = tmp_path_factory.mktemp("sd-gpt") / "dump.json"
        env = dict(os.environ, PYTHONPATH=str(HERE))
        cmd = [sys.executable, "-W", "ignore", str(HERE / "sd_dump.py"), "--tree", str(tree),
               "--gpt", name, "--out", str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        _cache[key] = json.loads(out.read_text())
    return _cache[key]


def test_training_gptmodel_checkpoint_identical_on_base_and_patched(tmp_path_factory):
    """The upgrade path's precondition (issue 25): the GPTModel the training tier's upgrade runs
    save and load (``training.build_model``, CP=1, each tree's own GDN construction) has, on the
    base tree and on the patched tree, the same model sharded state dict (keys, global shapes,
    offsets, fragmentations, local shapes, replica ids, dtypes), the same distributed-optimizer
    sharded state dict and the same state_dict: nothing for a loader to map."""
    need_base_tree()
    need_fla()
    base = _dump_gpt(BASE_TREE, "base", tmp_path_factory)
    patched = _dump_gpt(GDN_TREE, "patched", tmp_path_factory)
    assert base["tree"] != patched["tree"]
    b, p = base["gpt"], patched["gpt"]
    gdn = [k for k in b["model"] if ".self_attention." in k]
    assert any(k.endswith("self_attention.in_proj.weight") for k in gdn), sorted(b["model"])
    assert any(k.endswith("self_attention.A_log") for k in gdn), sorted(b["model"])
    for part in ("model", "optimizer", "state_dict"):
        assert sorted(p[part]) == sorted(b[part]), (part, sorted(set(p[part]) ^ set(b[part])))
        diff = [k for k in b[part] if p[part][k] != b[part][k]]
        assert not diff, (part, diff[:5], [(b[part][k], p[part][k]) for k in diff[:2]])
