"""The walkthrough's examples (docs/examples/), checked without a GPU or the image: the Megatron-Bridge
override sets exactly the two fields the page says, on the recipe's ``cfg.model``, and the patched
tree's ``TransformerConfig`` has both (when build/tree/patched is there); the MCore example names
only functions the patched tree defines (its path counters would otherwise count nothing)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "docs" / "examples"
TREE = REPO / "build" / "tree" / "patched"


def _assigned_attributes(path: Path) -> dict:
    """``{"cfg.model.x": source of the value}`` for every attribute assignment in ``path``."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute):
                    out[ast.unparse(target)] = ast.unparse(node.value)
    return out


def test_bridge_example_overrides_cp_size_and_mode_on_the_recipe_model():
    assigned = _assigned_attributes(EXAMPLES / "bridge_qwen3_next_cp.py")
    assert assigned == {"cfg.model.context_parallel_size": "cp", "cfg.model.linear_cp_mode": "mode"}
    text = (EXAMPLES / "bridge_qwen3_next_cp.py").read_text()
    assert "from megatron.bridge.recipes.qwen.qwen3_next import qwen3_next_80b_a3b_pretrain_config" in text
    assert "pretrain(make_config(args.cp, args.mode), forward_step)" in text


def test_the_bridge_names_exist_in_the_pinned_tree():
    if not (TREE / "megatron" / "bridge").is_dir():
        pytest.skip("build/tree/patched is absent (make patch)")
    recipe = (TREE / "megatron/bridge/recipes/qwen/qwen3_next.py").read_text()
    assert "def qwen3_next_80b_a3b_pretrain_config(" in recipe and "cfg.model.context_parallel_size" in recipe
    assert "def forward_step(" in (TREE / "megatron/bridge/training/gpt_step.py").read_text()
    assert "def pretrain(" in (TREE / "megatron/bridge/training/pretrain.py").read_text()


def test_the_patched_config_has_the_fields_and_the_example_names_exist():
    if not (TREE / "megatron" / "core").is_dir():
        pytest.skip("build/tree/patched is absent (make patch)")
    config = (TREE / "megatron/core/transformer/transformer_config.py").read_text()
    parallel = (TREE / "megatron/core/model_parallel_config.py").read_text()
    assert re.search(r"^    linear_cp_mode: ", config, re.M) and re.search(r"^    context_parallel_size: ", parallel, re.M)
    gdn = (TREE / "megatron/core/ssm/gated_delta_net.py").read_text()
    gcp = (TREE / "megatron/core/ssm/gdn_context_parallel.py").read_text()
    assert "build_cp_context" in gdn and "def tensor_a2a_cp2hp(" in gdn
    assert "def plan_linear_cp(" in gcp and "def gather_zigzag_sequence(" in gcp
    assert "gdn_context_parallel.plan_linear_cp(" in gdn  # looked up at call time: the counter sees it


def test_the_gpu_entry_refuses_a_host_without_a_gpu_with_exit_2():
    """Issue 45: ``walkthrough_gpu_entry.py`` divided by the GPU count (ZeroDivisionError) where torch
    sees none; it now refuses before any process group, naming the CPU entry."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(REPO / "tests/image/gpu/walkthrough_gpu_entry.py")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stderr[-800:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-2].startswith("error: ") and "needs a CUDA GPU" in lines[-2]
    assert lines[-1].startswith("hint: ") and "walkthrough_cpu_entry.py" in lines[-1]
