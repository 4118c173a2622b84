"""pytest entry for the GPU part: runs ``tools/gpu-suite`` on a host with at least one CUDA GPU.

Ranks share GPUs when there are fewer than 4 (gloo; ``tests/image/gpu/placement.py``). Skips (with
the reason) on hosts without a CUDA GPU, without the trees or without the carried
FLA wheels; ``tools/gpu-suite`` is the primary way to run it (it needs no pytest).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from _image_env import BASE_TREE, GDN_TREE, REPO, need_base_tree, need_torch


@pytest.mark.gpu
def test_gpu_suite_passes(tmp_path):
    need_torch()
    import torch

    if torch.cuda.device_count() < 1:
        pytest.skip("GPU part needs a CUDA GPU (4 ranks share however many there are); "
                    "run tools/gpu-suite on a GPU host")
    need_base_tree()
    wheels = os.environ.get("GDN_WHEELS", str(REPO / ".whl"))
    for sub in ("fla042", "fla041"):
        d = os.path.join(wheels, sub)
        if not (os.path.isdir(d) and any(p.endswith(".whl") for p in os.listdir(d))):
            pytest.skip(f"no FLA wheels in {d}; run: make wheels")
    env = dict(os.environ, GDN_TREE=str(GDN_TREE), GDN_BASE_TREE=str(BASE_TREE),
               GDN_WHEELS=wheels, GDN_SUITE_WORK=str(tmp_path / "work"))
    proc = subprocess.run([str(REPO / "tools" / "gpu-suite"), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=900)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert proc.returncode == 0 and summary["passed"], proc.stderr[-4000:]
