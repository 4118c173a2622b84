#!/usr/bin/env bash
# Session 21, device call 3 (nvidia-h200-x2): CP=2 over NCCL, the patched layer's headwise and
# chunkwise in one process again, now with Dynamo reset between modes (bench/gdn_layer.py:
# call 2's chunkwise ran the prepare_qkv copies as shape-generic kernels compiled for
# headwise's head counts). Then packed THD (8 samples) at 32K, both modes, in a second
# process on the warm Triton cache: the sort-free host route's first GPU timing.
set -u
END=$(( $(date +%s) + ${CALL_SECONDS:-555} ))
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 NPROC=2 TRITON_CACHE_DIR=/tmp/tc/b042
O=$OUT; W=/tmp/call3; mkdir -p $W
unset OUT  # bench-gdn would pack its Triton cache into $OUT: not wanted
t=$(( END - $(date +%s) - 100 ))
timeout "$t" tools/bench-gdn --cp 2 --modes chunkwise,headwise --seq 32768,65536,131072 --repeats 20 \
  --profile 32768 --budget-s $(( t - 50 )) --out "$W/cp2_sbhd_same_call.json" >"$W/sbhd.log" 2>&1
echo "sbhd rc=$? at $(date +%T)" >>"$W/sbhd.log"
t=$(( END - $(date +%s) - 10 ))
(( t > 40 )) && timeout "$t" tools/bench-gdn --cp 2 --modes chunkwise,headwise --seq 32768 --samples 8 \
  --repeats 20 --profile 32768 --out "$W/cp2_thd8_same_call.json" >"$W/thd8.log" 2>&1
echo "thd8 rc=$? at $(date +%T)" >>"$W/thd8.log"
grep -hE "P=2|rc=" "$W/sbhd.log" "$W/thd8.log"
tar -C $W -czf $O/call3.tgz . && ls -la $O
