"""One Megatron-Bridge check in its own process, for ``test_image_bridge.py``; prints one JSON line.

    python bridge_probe.py import MODULE...     import each module; {"modules": {name: file}}
    python bridge_probe.py qwen3_next_provider  AutoBridge on a tiny HF Qwen3-Next config
    python bridge_probe.py qwen35_provider      a tiny Qwen3.5 (VL) provider

When the real Transformer Engine is absent (the cpu image) the CPU stand-in in ``te_standin/``
goes first on ``sys.path`` of this process only (Bridge imports TE on ``import megatron.bridge``);
the JSON says which TE was used (``"te": "real" | "standin"``). ``$GDN_TREE`` goes first, so
``megatron`` is the patched tree.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
TE = "real" if importlib.util.find_spec("transformer_engine") else "standin"
if TE == "standin":
    sys.path.insert(0, str(HERE / "te_standin"))
sys.path.insert(0, os.environ.get("GDN_TREE", str(HERE.parents[1] / "build" / "tree" / "patched")))
warnings.simplefilter("ignore")

#: Tiny GDN hybrid: 4 layers (3 gated_delta_net + 1 attention), 2 key / 4 value heads of 16.
TINY = dict(hidden_size=64, num_attention_heads=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
FIELDS = ("experimental_attention_variant", "num_layers", "hidden_size", "num_attention_heads",
          "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
          "linear_conv_kernel_dim", "linear_attention_freq", "num_moe_experts", "linear_cp_mode")


def tiny_qwen3_next_config():
    """A tiny HF ``Qwen3NextConfig`` (transformers at the lock's pin)."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        architectures=["Qwen3NextForCausalLM"], vocab_size=256, intermediate_size=128, num_hidden_layers=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, full_attention_interval=4, max_position_embeddings=128, **TINY)


def qwen3_next_provider():
    """``AutoBridge.from_hf_config(tiny).to_megatron_provider(load_weights=False)``, finalized."""
    from megatron.bridge import AutoBridge

    provider = AutoBridge.from_hf_config(tiny_qwen3_next_config()).to_megatron_provider(load_weights=False)
    provider.finalize()
    return provider


def qwen35_provider():
    """A tiny ``Qwen35VLModelProvider`` (Qwen3.5 dense: GDN every layer but each 4th), finalized."""
    from megatron.bridge.models.qwen_vl.qwen35_vl_provider import Qwen35VLModelProvider

    provider = Qwen35VLModelProvider(
        num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        kv_channels=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, linear_attention_freq=4, vocab_size=256,
        seq_length=128)
    provider.finalize()
    return provider


def _fields(provider) -> dict:
    return {"class": f"{type(provider).__module__}.{type(provider).__name__}",
            **{k: getattr(provider, k, None) for k in FIELDS}}


def main(argv) -> dict:
    what = argv[0]
    out = {"te": TE, "python": sys.version.split()[0]}
    if what == "import":
        mods = {}
        for name in argv[1:]:
            mods[name] = importlib.import_module(name).__file__
        out["modules"] = mods
    elif what == "qwen3_next_provider":
        out["provider"] = _fields(qwen3_next_provider())
    elif what == "qwen35_provider":
        out["provider"] = _fields(qwen35_provider())
    else:
        raise SystemExit(f"unknown check {what!r}")
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), default=str))
