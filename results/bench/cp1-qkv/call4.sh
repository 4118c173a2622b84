#!/usr/bin/env bash
# Session 19, device call 4 (nvidia-h200, one GPU), final patch of this session
# (adapt-gdn-prepare-qkv-fused-copies + the conv reading qkv through its strides):
#   1. bench/prepare_qkv.py layer part at 64K: new tree vs the previous patch's eager helper vs
#      the base tree's code, same process (FLA 0.4.2).
#   2. tools/gpu-suite module matrix (CP 2/4 vs CP=1 in every mode, dynamic CP, recompute), 4 ranks
#      on the GPU over gloo, at the frozen gates.
set -u
O=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla042 .whl/fla042/*.whl || exit 3
PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 PYTHONPATH=/tmp/fla042 TRITON_CACHE_DIR=/tmp/tc/qkv \
  timeout 190 python3 bench/prepare_qkv.py --out "$O/prepare_qkv.json" --parts layer \
  --policies tree,eager --seq 65536 --rounds 3 >"$O/prepare_qkv.log" 2>&1
echo "prepare_qkv rc=$?"
grep -E "^layer" "$O/prepare_qkv.log"
GDN_SUITE_ONLY=module GDN_SUITE_WARMUP=0 GDN_SUITE_JOB_TIMEOUT=190 GDN_SUITE_BUDGET=205 \
  GDN_SUITE_SAVE_CACHE=0 GDN_BASE_TREE=build/tree/patched timeout 215 tools/gpu-suite "$O/suite" \
  >"$O/suite.out" 2>&1
echo "gpu-suite rc=$?"
tail -25 "$O/suite.out"
