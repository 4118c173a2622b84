"""The transforms that make the default pipeline finalize its packed micro-batches (issue 43):
Megatron-Bridge's get_packed_seq_params, MCore's sequence-packing batch, Qwen3-VL's repack and
step, and GatedDeltaNet registering its linear_cp_mode. Small synthetic modules anchored on the
same symbol names; no tree, no network."""

from __future__ import annotations

import ast

import pytest

from backport.errors import ApplyError
from backport.transforms import REGISTRY

IMPORTS = (
    "import torch\n"
    "from megatron.core import parallel_state\n"
    "from megatron.core.datasets.utils import helper\n"
    "from megatron.core.packed_seq_params import PackedSeqParams\n"
    "from megatron.core.utils import other\n"
)

BRIDGE = '''from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams


def get_packed_seq_params(batch):
    """Doc."""
    cu = batch["cu_seqlens"]
    if batch.get("unpadded") is not None:
        return PackedSeqParams(
            cu_seqlens_q=batch["unpadded"],
            cu_seqlens_q_padded=cu,
            qkv_format="thd",
        )
    else:
        return PackedSeqParams(
            cu_seqlens_q=cu,
            qkv_format="thd",
        )
'''

ASSIGNING = IMPORTS + '''

def {fn}(batch, batch_size, target_len, cu_seqlens_padded, cu_seqlens_padded_cpu):
    """Doc."""
    packed_seq_params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens_padded,
    )

    return batch, packed_seq_params
'''

#: transform -> (a module it applies to, the finalize call it must write)
FINALIZE_SITES = {
    "bridge_packed_seq_utils_finalize": (BRIDGE, "finalize_packed_seq_params(packed_seq_params)"),
    "mcore_data_schedule_finalize": (ASSIGNING.format(fn="get_batch_on_this_rank_for_sequence_packing"),
                                     "finalize_packed_seq_params(packed_seq_params)"),
    "qwen3_vl_finalize_packed": (ASSIGNING.format(fn="preprocess_packed_seqs"),
                                 "cu_seqlens_cpu=torch.tensor(cu_seqlens_padded_cpu, dtype=cu_seqlens_padded.dtype)"),
    "qwen3_vl_step_finalize_packed": (ASSIGNING.format(fn="pack_or_pad_batch_sequences"),
                                      "cu_seqlens_cpu=torch.arange(batch_size + 1, dtype=cu_seqlens_padded.dtype) * target_len"),
}
IMPORT = "from megatron.core.context_parallel_layout import finalize_packed_seq_params"


@pytest.mark.parametrize("name", sorted(FINALIZE_SITES))
def test_finalize_is_called_on_the_final_object_and_imported_once(name):
    text, call = FINALIZE_SITES[name]
    result = REGISTRY[name](text, "x.py")
    assert result.status == "applied"
    out = result.text
    ast.parse(out)
    assert out.count(IMPORT) == 1 and call in out
    lines = out.splitlines()
    # isort (profile black): the import sits between the megatron.core from-imports that sort around it
    mods = [ln.split()[1] for ln in lines if ln.startswith("from megatron")]
    assert mods == sorted(mods) and "megatron.core.context_parallel_layout" in mods, mods
    assert all(len(ln) <= 100 for ln in lines if ln not in text.splitlines())
    # finalized before it is returned, and only there
    assert out.index("finalize_packed_seq_params(") > out.index("PackedSeqParams(")
    assert REGISTRY[name](out, "x.py").status == "already-present"


def test_bridge_returns_the_finalized_object_from_both_branches():
    out = REGISTRY["bridge_packed_seq_utils_finalize"](BRIDGE, "x.py").text
    assert "return PackedSeqParams(" not in out
    assert out.count("packed_seq_params = PackedSeqParams(") == 2
    assert out.rstrip().endswith("finalize_packed_seq_params(packed_seq_params)\n    return packed_seq_params")
    namespace = {}
    exec(compile(out.replace("from megatron.core.context_parallel_layout import finalize_packed_seq_params\n", "")
                 .replace("from megatron.core.packed_seq_params import PackedSeqParams\n", "")
                 .replace("import torch\n", ""), "x.py", "exec"), namespace)
    seen = []
    namespace["PackedSeqParams"] = lambda **kw: kw
    namespace["finalize_packed_seq_params"] = lambda p: seen.append(p) or p
    assert namespace["get_packed_seq_params"]({"cu_seqlens": 1}) == {"cu_seqlens_q": 1, "qkv_format": "thd"}
    assert namespace["get_packed_seq_params"]({"cu_seqlens": 1, "unpadded": 2})["cu_seqlens_q"] == 2
    assert len(seen) == 2


@pytest.mark.parametrize("name, broken", [
    ("bridge_packed_seq_utils_finalize", BRIDGE.replace("def get_packed_seq_params", "def other")),
    ("bridge_packed_seq_utils_finalize", BRIDGE.replace("    else:\n        return PackedSeqParams(", "    else:\n        x = PackedSeqParams(")),
    ("mcore_data_schedule_finalize", ASSIGNING.format(fn="get_batch_on_this_rank_for_sequence_packing")
     .replace("packed_seq_params = PackedSeqParams(", "params = PackedSeqParams(")),
    ("qwen3_vl_finalize_packed", ASSIGNING.format(fn="preprocess_packed_seqs")
     .replace("from megatron.core.packed_seq_params import PackedSeqParams\n", "")),
])
def test_a_missing_anchor_is_refused(name, broken):
    with pytest.raises(ApplyError, match="anchor"):
        REGISTRY[name](broken, "x.py")
