#!/usr/bin/env bash
# Session 20, device call B (nvidia-h200-x2): CP=2 over NCCL, one rank per GPU, patched tree with
# the host-routed THD layout conversion (gdn_context_parallel.ThdLayoutRoutes).
#   1. Packed THD, 8 samples of 4K at 32K: chunkwise, host syncs per step, profile (call A, before
#      the change: 34.87 ms, 64 host syncs).
#   2. SBHD 128K/64K/32K chunkwise, profile at 32K.
#   3. SBHD headwise at 32K (profile), then 128K/64K while time is left.
# Every process finds the Triton kernels the first one compiled (same machine, same cache folder).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla042 \
  .whl/fla042/*.whl || exit 3
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 PYTHONPATH=/tmp/fla042 TRITON_CACHE_DIR=/tmp/tc/b042 NPROC=2
O=$OUT
unset OUT  # bench-gdn would pack its Triton cache into $OUT: not wanted
END=585
step() {  # step NAME MIN_SECONDS ARGS...: run bench-gdn if MIN_SECONDS are left, under a timeout
  local name=$1 need=$2; shift 2
  local rem=$((END - SECONDS))
  if [ "$rem" -lt "$need" ]; then echo "$name: skipped, ${rem}s left"; return; fi
  timeout "$rem" tools/bench-gdn --cp 2 --out "$O/$name.json" "$@" >"$O/$name.log" 2>&1
  echo "$name rc=$? at ${SECONDS}s"
}
step thd8_chunkwise 300 --modes chunkwise --samples 8 --seq 32768 --profile 32768
step sbhd_chunkwise 60 --modes chunkwise --seq 131072,65536,32768 --profile 32768
step sbhd_headwise32k 120 --modes headwise --seq 32768 --profile 32768
step sbhd_headwise 40 --modes headwise --seq 131072,65536
grep -hE "^P=2|ERROR" "$O"/*.log | head -40
ls -la "$O"
