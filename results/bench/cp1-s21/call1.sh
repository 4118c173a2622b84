#!/usr/bin/env bash
# Session 21, device call 1 (nvidia-h200-x2). The two GPUs run different jobs, never one job on
# two GPUs; every step is cut to end by a common deadline so the outputs are packed in time.
#   GPU 0: tools/gpu-suite module matrix on this session's GDN code (all_gather's token order
#          from the host route), 4 ranks over gloo, frozen gates; then FLA's kernels alone
#          (bench/fla_kernels.py) for FLA 0.4.2 and 0.4.1, alternated, kernel tables included.
#   GPU 1: CP=1 headwise layer, patched tree (FLA 0.4.2) vs the old image's path (base tree,
#          FLA 0.4.1), separate processes alternated new, old, new, old; the first of each
#          profiled at 32K (kernel tables from the Chrome traces).
set -u
END=$(( $(date +%s) + ${CALL_SECONDS:-555} ))
left() { local l=$(( END - $(date +%s) )); (( l < $1 )) && echo "$l" || echo "$1"; }
inst() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$2" "$1"/*.whl; }
inst .whl/fla042 /tmp/fla042 && inst .whl/fla041 /tmp/fla041 || exit 3
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
O=$OUT; W=/tmp/call1; mkdir -p $W/suite
kern() { # kern VERSION RUN
  local t; t=$(left 150); (( t > 20 )) || { echo "fla$1 r$2 skipped (deadline)"; return; }
  PYTHONPATH=/tmp/fla$1 TRITON_CACHE_DIR=/tmp/tc/b$1 timeout "$t" python3 bench/fla_kernels.py \
    --kernels --out "$W/fla$1_r$2.json"; echo "fla$1 r$2 rc=$?"; }
(
  export CUDA_VISIBLE_DEVICES=0
  GDN_SUITE_ONLY=module GDN_SUITE_WARMUP=0 GDN_SUITE_JOB_TIMEOUT=230 GDN_SUITE_BUDGET=250 \
    GDN_SUITE_SAVE_CACHE=0 GDN_BASE_TREE=build/tree/patched timeout 270 tools/gpu-suite "$W/suite" \
    >"$W/suite.out" 2>&1
  echo "gpu-suite rc=$?" >>"$W/suite.out"
  kern 042 1; kern 041 1; kern 042 2; kern 041 2
) >"$W/gpu0.log" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1 NPROC=1
  unset OUT  # bench-gdn would pack its Triton cache into $OUT: not wanted
  run() { # run VERSION TREE LABEL RUN PROFILE
    local t; t=$(left 240); (( t > 30 )) || { echo "$3 r$4 skipped (deadline)"; return; }
    PYTHONPATH=/tmp/fla$1 TRITON_CACHE_DIR=/tmp/tc/b$1 timeout "$t" tools/bench-gdn --cp 1 \
      --modes headwise --seq 65536,32768 --repeats 30 --tree "$2" ${3:+--label $3} $5 \
      --out "$W/cp1_${3:-new}_r$4.json"; echo "${3:-new} r$4 rc=$?"; }
  run 042 build/tree/patched "" 1 "--profile 32768"
  run 041 build/tree/base old_headwise 1 "--profile 32768"
  run 042 build/tree/patched "" 2 ""
  run 041 build/tree/base old_headwise 2 ""
) >"$W/gpu1.log" 2>&1 &
wait
grep -E "P=1|rc=|skipped" "$W/gpu1.log"; grep -E "median|rc=|skipped" "$W/gpu0.log"; tail -5 "$W/suite.out"
tar -C $W -czf $O/call1.tgz . && ls -la $O
