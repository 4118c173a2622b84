"""Megatron-Bridge in the image: it imports from the patched tree with the image's locked
dependencies, its GDN-family model modules (Qwen3-Next, Qwen3.5) import, and a tiny GDN model
provider is built through Bridge on CPU.

Each check runs in its own process (``bridge_probe.py``), so nothing it imports reaches the
other tests. What needs Transformer Engine or a GPU, and what the cpu image cannot do:

* Bridge at the pin imports Transformer Engine on ``import megatron.bridge``
  (``megatron/bridge/peft/lora_layers.py``), and TE needs CUDA. Where TE is absent (the cpu
  image) the probe uses the CPU stand-in in ``te_standin/`` (names only; building a TE module
  raises), and the test names it; every other dependency is the image's own.
* Building and running the model: Megatron's GDN layer spec has only the TE backend, so
  ``test_tiny_qwen3_next_model_on_gpu`` (marker ``gpu``: the GPU part of the suite, or the gate
  with ``--gpus on``) does it where TE and a GPU are present.
* Bridge's recipes use ``typing.override`` (Bridge declares Python >= 3.12); on the cpu image's
  Python 3.11 they skip with that reason and the cuda image (3.12) imports them.

Outside the image (``make test`` on the host, whose venv does not hold Bridge's dependencies)
everything here skips and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _image_env import GDN_TREE, need_torch, need_tree

HERE = Path(__file__).resolve().parent
IN_IMAGE = Path(os.environ.get("VIRTUAL_ENV", "")) == Path("/opt/gdn/venv")
GDN_MODELS = [
    "megatron.bridge.models.qwen.qwen3_next_bridge",
    "megatron.bridge.models.qwen_vl.qwen35_vl_provider",
    "megatron.bridge.models.qwen_vl.qwen35_vl_bridge",
]
GDN_RECIPES = ["megatron.bridge.recipes.qwen.qwen3_next", "megatron.bridge.recipes.qwen_vl.qwen35_vl"]

pytestmark = pytest.mark.skipif(
    not IN_IMAGE, reason="Megatron-Bridge's dependencies are installed only in the image (`make gate` runs these)")


def probe(*args: str) -> dict:
    """Run ``bridge_probe.py ARGS`` and return its JSON; fail with its stderr tail."""
    need_tree()
    need_torch()
    out = subprocess.run([sys.executable, str(HERE / "bridge_probe.py"), *args], capture_output=True, text=True,
                         timeout=900, env=dict(os.environ, GDN_TREE=str(GDN_TREE)))
    assert out.returncode == 0, f"bridge_probe {' '.join(args)} failed:\n{out.stderr[-3000:]}"
    data = json.loads(out.stdout.strip().splitlines()[-1])
    if data["te"] == "standin":
        print(f"bridge_probe {args[0]}: Transformer Engine is the CPU stand-in (tests/image/te_standin)")
    return data


def test_megatron_bridge_imports_from_the_patched_tree():
    data = probe("import", "megatron.bridge", "megatron.bridge.models.conversion.auto_bridge")
    for name, file in data["modules"].items():
        assert Path(file).resolve().is_relative_to(GDN_TREE), (name, file)


@pytest.mark.parametrize("module", GDN_MODELS)
def test_gdn_family_model_module_imports(module):
    data = probe("import", module)
    assert Path(data["modules"][module]).resolve().is_relative_to(GDN_TREE)


@pytest.mark.parametrize("module", GDN_RECIPES)
def test_gdn_family_recipe_imports(module):
    if sys.version_info < (3, 12):
        pytest.skip(f"{module} uses typing.override: Bridge declares Python >= 3.12, this image has "
                    f"{sys.version.split()[0]} (the cuda image, 3.12, imports it)")
    data = probe("import", module)
    assert Path(data["modules"][module]).resolve().is_relative_to(GDN_TREE)


def test_tiny_qwen3_next_provider_through_autobridge_on_cpu():
    p = probe("qwen3_next_provider")["provider"]
    assert p["class"].endswith("GPTModelProvider"), p
    assert p["experimental_attention_variant"] == "gated_delta_net"
    assert (p["num_layers"], p["hidden_size"], p["num_attention_heads"]) == (4, 64, 4)
    assert (p["linear_num_key_heads"], p["linear_num_value_heads"]) == (2, 4)
    assert (p["linear_key_head_dim"], p["linear_value_head_dim"], p["linear_conv_kernel_dim"]) == (16, 16, 4)
    assert p["linear_attention_freq"] == 4 and p["num_moe_experts"] == 4
    assert p["linear_cp_mode"] == "headwise"  # the backport's default (decision 3)


def test_tiny_qwen35_provider_on_cpu():
    p = probe("qwen35_provider")["provider"]
    assert p["class"].endswith("Qwen35VLModelProvider"), p
    assert p["experimental_attention_variant"] == "gated_delta_net"
    assert (p["num_layers"], p["linear_num_key_heads"], p["linear_num_value_heads"]) == (4, 2, 4)
    assert p["linear_cp_mode"] == "headwise"


@pytest.mark.gpu
def test_tiny_qwen3_next_model_on_gpu():
    """Build the tiny Qwen3-Next model from the provider (TE layer spec) and run it on one GPU.

    Not run on the cpu image (no GPU, no TE); written for the cuda image on a GPU host.
    """
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        pytest.skip("no GPU visible to torch")
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("Transformer Engine is not installed (the cuda image's NGC base brings it)")
    sys.path.insert(0, str(HERE))
    import torch.distributed as dist
    from bridge_probe import qwen3_next_provider
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        model_parallel_cuda_manual_seed(1234)
        provider = qwen3_next_provider()
        provider.moe_grouped_gemm = False
        provider.moe_permute_fusion = False
        model = provider.provide().cuda().to(torch.bfloat16)
        tokens = torch.randint(0, 256, (1, 32), device="cuda")
        position_ids = torch.arange(32, device="cuda").unsqueeze(0)
        logits = model(tokens, position_ids, attention_mask=None)
        assert logits.shape[:2] == (1, 32) and torch.isfinite(logits.float()).all()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
