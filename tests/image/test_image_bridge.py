"""Megatron-Bridge in the image: it imports from the patched tree, its GDN-family model modules
(Qwen3-Next, Qwen3.5) import, and a tiny GDN model provider is built through Bridge on CPU.

CPU part (every gate): ``import megatron.bridge`` (Bridge at the pin, from ``$GDN_TREE``, with
its runtime dependencies from the image's lock); the Qwen3-Next and Qwen3.5 bridge, provider
and recipe modules import; ``AutoBridge.from_hf_config`` turns a tiny HF Qwen3-Next config into
a ``GPTModelProvider`` whose finalized ``TransformerConfig`` is a GDN hybrid (gated_delta_net
every layer but each ``full_attention_interval``-th, the patched ``linear_cp_mode`` default
``headwise``); a tiny Qwen3.5 provider finalizes the same way.

What needs Transformer Engine (the GDN layer spec supports only the TE backend; the NGC base
brings TE, the cpu image has none) or a GPU: building the model from the provider and running
it. A module that fails to import only for want of Transformer Engine skips with that reason;
``test_tiny_qwen3_next_model_on_gpu`` (marker ``gpu``) builds and runs the model where TE and a
GPU are present (the GPU part of the suite, ``tools/gpu-suite`` or the gate with ``--gpus on``).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from _image_env import GDN_TREE, need_torch, need_tree

GDN_FAMILY_MODULES = [
    "megatron.bridge.models.qwen.qwen3_next_bridge",
    "megatron.bridge.models.qwen_vl.qwen35_vl_provider",
    "megatron.bridge.models.qwen_vl.qwen35_vl_bridge",
    "megatron.bridge.recipes.qwen.qwen3_next",
    "megatron.bridge.recipes.qwen_vl.qwen35_vl",
]
TE_REASON = ("needs Transformer Engine, which the cpu image does not have (the NGC base of the cuda image "
             "brings it); covered by test_tiny_qwen3_next_model_on_gpu in the GPU part of the suite")


def _import(name: str):
    """Import ``name``; skip when only Transformer Engine is missing, fail on anything else."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "transformer_engine":
            pytest.skip(f"{name}: {TE_REASON}")
        raise


def _bridge():
    need_tree()
    need_torch()
    return _import("megatron.bridge")


def test_megatron_bridge_imports_from_the_patched_tree():
    bridge = _bridge()
    assert Path(bridge.__file__).resolve().is_relative_to(GDN_TREE), bridge.__file__
    from megatron.bridge import AutoBridge  # noqa: F401  (the public entry point)


@pytest.mark.parametrize("module", GDN_FAMILY_MODULES)
def test_gdn_family_module_imports(module):
    _bridge()
    mod = _import(module)
    assert Path(mod.__file__).resolve().is_relative_to(GDN_TREE)


def _tiny_qwen3_next_config():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        architectures=["Qwen3NextForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, full_attention_interval=4, max_position_embeddings=128,
        torch_dtype="float32")


def _qwen3_next_provider():
    _bridge()
    _import("megatron.bridge.models.qwen.qwen3_next_bridge")
    from megatron.bridge import AutoBridge

    provider = AutoBridge.from_hf_config(_tiny_qwen3_next_config()).to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = provider.pipeline_model_parallel_size = 1
    provider.context_parallel_size = provider.expert_model_parallel_size = 1
    provider.finalize()
    return provider


def test_tiny_qwen3_next_provider_through_autobridge_on_cpu():
    provider = _qwen3_next_provider()
    assert type(provider).__name__.endswith("Provider")
    assert provider.experimental_attention_variant == "gated_delta_net"
    assert (provider.num_layers, provider.hidden_size, provider.num_attention_heads) == (4, 64, 4)
    assert (provider.linear_num_key_heads, provider.linear_num_value_heads) == (2, 4)
    assert (provider.linear_key_head_dim, provider.linear_value_head_dim) == (16, 16)
    assert provider.linear_conv_kernel_dim == 4
    assert provider.num_moe_experts == 4
    assert provider.linear_cp_mode == "headwise"  # the backport's default (decision 3)


def test_tiny_qwen35_provider_on_cpu():
    _bridge()
    mod = _import("megatron.bridge.models.qwen_vl.qwen35_vl_provider")
    provider = mod.Qwen35VLModelProvider(
        num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        kv_channels=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, linear_attention_freq=4, vocab_size=256,
        seq_length=128)
    provider.finalize()
    assert provider.experimental_attention_variant == "gated_delta_net"
    assert provider.linear_cp_mode == "headwise"
    assert provider.num_layers == 4


@pytest.mark.gpu
def test_tiny_qwen3_next_model_on_gpu():
    """Build the tiny Qwen3-Next model from the provider (TE layer spec) and run it on one GPU."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no GPU visible to torch")
    _import("transformer_engine")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_PORT", "29517")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        model_parallel_cuda_manual_seed(1234)
        provider = _qwen3_next_provider()
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
