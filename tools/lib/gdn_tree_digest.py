#!/usr/bin/env python3
"""Print what a GPU result covers: the patch's sha256 and the tree's GDN-files digest.

    python3 tools/lib/gdn_tree_digest.py [TREE [PATCH]]

(default ``build/tree/patched`` and ``patches/latest/megatron.patch``). ``gdn_files_sha256`` is
the sha256 over the GDN-relevant files of the tree (``megatron/core/ssm/*.py``,
``context_parallel_layout.py``, ``packed_seq_params.py``, ``transformer/transformer_config.py``,
each as its path, a NUL and its bytes, in sorted order): the figure ``tools/gpu-suite`` records
as ``host.patched_tree.gdn_files_sha256``. Compare it with a result's to know whether that result
covers the tree you built; the date does not tell. Exit 2 when the tree is missing.
"""

import hashlib
import json
import pathlib
import sys


def digest(tree) -> str:
    """sha256 hex of the GDN-relevant files of ``tree`` (see the module docstring)."""
    h = hashlib.sha256()
    core = pathlib.Path(tree) / "megatron" / "core"
    files = sorted((core / "ssm").glob("*.py")) + [core / n for n in (
        "context_parallel_layout.py", "packed_seq_params.py", "transformer/transformer_config.py")]
    for f in files:
        if f.exists():
            h.update(str(f.relative_to(core)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def main(argv) -> int:
    repo = pathlib.Path(__file__).resolve().parents[2]
    tree = pathlib.Path(argv[0]) if argv else repo / "build" / "tree" / "patched"
    patch = pathlib.Path(argv[1]) if len(argv) > 1 else repo / "patches" / "latest" / "megatron.patch"
    if not (tree / "megatron" / "core").is_dir():
        print(f"error: no Megatron tree at {tree}\nhint: run `make patch` (it writes build/tree/patched), "
              "or name the tree", file=sys.stderr)
        return 2
    print(json.dumps({"tree": str(tree), "gdn_files_sha256": digest(tree),
                      "patch_sha256": hashlib.sha256(patch.read_bytes()).hexdigest() if patch.is_file() else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
