#!/usr/bin/env bash
# Session 20, device call C (nvidia-h200-x2), final GDN code of the session (sort-free host route
# for packed THD chunkwise, non-blocking host->device index copies). The two GPUs run different
# jobs, never one job on two GPUs:
#   GPU 0: tools/gpu-suite module matrix (CP 2/4 against CP=1 in every mode, SBHD and THD,
#          dynamic CP, recompute), 4 ranks on the GPU over gloo, at the frozen gates.
#   GPU 1: CP=1 headwise, patched tree (FLA 0.4.2) against the old image's path (base tree,
#          FLA 0.4.1), separate processes alternated: new, old, new, old (issue 17 item 3).
set -u
inst() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$2" "$1"/*.whl; }
inst .whl/fla042 /tmp/fla042 && inst .whl/fla041 /tmp/fla041 || exit 3
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
O=$OUT
(
  export CUDA_VISIBLE_DEVICES=0
  GDN_SUITE_ONLY=module GDN_SUITE_WARMUP=0 GDN_SUITE_JOB_TIMEOUT=230 GDN_SUITE_BUDGET=250 \
    GDN_SUITE_SAVE_CACHE=0 GDN_BASE_TREE=build/tree/patched timeout 270 tools/gpu-suite "$O/suite" \
    >"$O/suite.out" 2>&1
  echo "gpu-suite rc=$?" >>"$O/suite.out"
) &
(
  export CUDA_VISIBLE_DEVICES=1 NPROC=1
  unset OUT  # bench-gdn would pack its Triton cache into $OUT: not wanted
  run_new() { PYTHONPATH=/tmp/fla042 TRITON_CACHE_DIR=/tmp/tc/b042 timeout "$1" tools/bench-gdn --cp 1 \
    --modes headwise --seq 65536,32768 --repeats 30 --out "$O/cp1_headwise_r$2.json"; echo "new r$2 rc=$?"; }
  run_old() { PYTHONPATH=/tmp/fla041 TRITON_CACHE_DIR=/tmp/tc/b041 timeout "$1" tools/bench-gdn --cp 1 \
    --modes headwise --seq 65536,32768 --repeats 30 --tree build/tree/base --label old_headwise \
    --out "$O/cp1_old_r$2.json"; echo "old r$2 rc=$?"; }
  run_new 240 1; run_old 200 1; run_new 60 2; run_old 60 2
) >"$O/bench_cp1.log" 2>&1 &
wait
tail -12 "$O/suite.out"
grep -E "P=1|rc=" "$O/bench_cp1.log"
