#!/usr/bin/env bash
# Session 19, device call 1 (kind nvidia-h200-x2; the two GPUs work in parallel, never on one job):
#   GPU 0: bench/prepare_qkv.py (decision 7a: what Dynamo does with the helper; its cost at CP=1)
#   GPU 1: tools/bench-gdn at CP=1, one process after the other: the old image's path (base tree,
#          FLA 0.4.1), the patched tree as is, the patched tree with the helper compiled.
# Outputs under $OUT (JSON + logs); run from the repository root.
set -u
inst() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$2" "$1"/*.whl; }
inst .whl/fla042 /tmp/fla042 && inst .whl/fla041 /tmp/fla041 || exit 3
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
O=$OUT
(
  export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/fla042 TRITON_CACHE_DIR=/tmp/tc/qkv
  timeout 575 python3 bench/prepare_qkv.py --out "$O/prepare_qkv.json" --budget-s 470 \
    --parts helper,layer,scenarios \
    --policies tree,jit_fuser,dynamic,l2norm_eager,l2norm_eager_dynamic >"$OUT/prepare_qkv.log" 2>&1
  echo "prepare_qkv rc=$?" >>"$OUT/prepare_qkv.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1 NPROC=1 GDN_TRITON_CACHE=/nonexistent
  unset OUT  # bench-gdn packs its Triton cache into $OUT when set: not wanted here
  b() { timeout "$1" tools/bench-gdn --cp 1 --modes headwise --seq 65536,32768 --repeats 30 "${@:2}"; echo "rc=$?"; }
  PYTHONPATH=/tmp/fla041 TRITON_CACHE_DIR=/tmp/tc/b041 b 250 --tree build/tree/base --label old_headwise \
    --out "$O/cp1_old_headwise.json" --budget-s 200
  PYTHONPATH=/tmp/fla042 TRITON_CACHE_DIR=/tmp/tc/b042 b 200 --out "$O/cp1_headwise.json" --budget-s 160
  PYTHONPATH=/tmp/fla042 TRITON_CACHE_DIR=/tmp/tc/b042 b 100 --prepare-qkv jit_fuser \
    --label headwise_qkv_compiled --out "$O/cp1_qkv_compiled.json" --budget-s 60
) >"$OUT/bench_cp1.log" 2>&1 &
wait
grep -v "Warning\|warnings.warn" "$OUT/prepare_qkv.log" | tail -40
grep -E "P=1|rc=|ERROR" "$OUT/bench_cp1.log"
