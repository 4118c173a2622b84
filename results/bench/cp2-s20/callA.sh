#!/usr/bin/env bash
# Session 20, device call A (nvidia-h200-x2): CP=2 over NCCL, one rank per GPU, patched tree.
#   1. SBHD batch 1, 128K/64K/32K: chunkwise (narrow layout conversion, as patched) and
#      chunkwise_upstream_layout (upstream 5139086e's placement), same process; one step of each
#      profiled at 32K right after its timing runs (bench/profile_attr.py attribution).
#   2. Packed THD, 8 samples of 4K at 32K: chunkwise, with the host-sync count and a profile.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla042 \
  .whl/fla042/*.whl || exit 3
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 PYTHONPATH=/tmp/fla042 TRITON_CACHE_DIR=/tmp/tc/b042 NPROC=2
O=$OUT
unset OUT  # bench-gdn would pack its Triton cache into $OUT: not wanted
timeout 440 tools/bench-gdn --cp 2 --modes chunkwise,chunkwise_upstream_layout --seq 131072,65536,32768 \
  --profile 32768 --budget-s 360 --out "$O/sbhd_chunkwise.json" >"$O/sbhd.log" 2>&1
echo "sbhd rc=$? at ${SECONDS}s"
rem=$((580 - SECONDS))
if [ "$rem" -gt 60 ]; then
  timeout "$rem" tools/bench-gdn --cp 2 --modes chunkwise --samples 8 --seq 32768 --profile 32768 \
    --out "$O/thd8_chunkwise.json" >"$O/thd8.log" 2>&1
  echo "thd8 rc=$? at ${SECONDS}s"
fi
grep -hE "^P=2|ERROR|Error" "$O"/*.log | grep -v Warning | head -40
