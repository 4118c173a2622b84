#!/usr/bin/env bash
# Session 19, device call 3 (nvidia-h200-x2), after adapt-gdn-prepare-qkv-fused-copies:
#   GPU 0: bench/prepare_qkv.py: whole CP=1 layer, the new tree against the previous patch's eager
#          helper and the base tree's code (same process), lengths 64K, 32K, 64K without a Dynamo
#          reset in between; then the scenarios (Dynamo on) for the new tree.
#   GPU 1: tools/bench-gdn CP=1: patched tree and the old image's path (base tree, FLA 0.4.1),
#          alternated twice.
set -u
inst() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$2" "$1"/*.whl; }
inst .whl/fla042 /tmp/fla042 && inst .whl/fla041 /tmp/fla041 || exit 3
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
O=$OUT
(
  export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/fla042 TRITON_CACHE_DIR=/tmp/tc/qkv
  timeout 560 python3 bench/prepare_qkv.py --out "$O/prepare_qkv.json" --budget-s 380 \
    --parts layer,scenarios,helper --policies tree,eager,l2norm_eager --seq 65536,32768,65536 \
    >"$O/prepare_qkv.log" 2>&1
  echo "prepare_qkv rc=$?" >>"$O/prepare_qkv.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1 NPROC=1
  unset OUT  # bench-gdn packs its Triton cache into $OUT when set: not wanted here
  for i in 1 2; do
    PYTHONPATH=/tmp/fla042 TRITON_CACHE_DIR=/tmp/tc/b042 timeout 240 tools/bench-gdn --cp 1 --modes headwise \
      --seq 65536,32768 --repeats 30 --out "$O/cp1_headwise_r$i.json"; echo "rc=$?"
    PYTHONPATH=/tmp/fla041 TRITON_CACHE_DIR=/tmp/tc/b041 timeout 240 tools/bench-gdn --cp 1 --modes headwise \
      --seq 65536,32768 --repeats 30 --tree build/tree/base --label old_headwise --out "$O/cp1_old_r$i.json"; echo "rc=$?"
  done
) >"$O/bench_cp1.log" 2>&1 &
wait
grep -v "Warning\|warnings.warn" "$O/prepare_qkv.log" | grep -E "^(layer|scen|helper)|rc=|Error" | tail -40
grep -E "P=1|rc=|ERROR" "$O/bench_cp1.log"
