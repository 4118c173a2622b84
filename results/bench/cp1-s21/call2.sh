#!/usr/bin/env bash
# Session 21, device call 2 (nvidia-h200-x2).
#   Both GPUs: CP=2 over NCCL, SBHD, the patched layer's headwise and chunkwise in ONE process
#              (same call, same machine: the ratio issue 17 / 16 ask for), 32K-128K, one
#              chunkwise and one headwise step profiled at 32K.
#   Beside it, while the bench compiles: tools/gpu-suite GDN_SUITE_ONLY=oracle (FLA's scan at
#              K=V=128 against the float64 oracle, forward and backward; FLA 0.4.2 gated, the
#              old image's FLA 0.4.1 as a probe), 4 ranks over gloo on GPU 0. Its kernels are
#              tiny (H=4, T=512) and it ends before the bench's first timed step (compile
#              takes 170 s or more), so it does not share the GPUs with a timed step; the log
#              gives both end times to check that.
set -u
END=$(( $(date +%s) + ${CALL_SECONDS:-560} ))
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
O=$OUT; W=/tmp/call2; mkdir -p $W/suite
(
  export CUDA_VISIBLE_DEVICES=0
  GDN_SUITE_ONLY=oracle GDN_SUITE_WARMUP=0 GDN_SUITE_JOB_TIMEOUT=300 GDN_SUITE_BUDGET=340 \
    GDN_SUITE_SAVE_CACHE=0 timeout 360 tools/gpu-suite "$W/suite" >"$W/suite.out" 2>&1
  echo "gpu-suite rc=$? at $(date +%T)" >>"$W/suite.out"
) &
(
  unset OUT  # bench-gdn would pack its Triton cache into $OUT: not wanted
  t=$(( END - $(date +%s) - 15 ))
  NPROC=2 TRITON_CACHE_DIR=/tmp/tc/b042 timeout "$t" tools/bench-gdn --cp 2 --modes headwise,chunkwise \
    --seq 32768,65536,131072 --repeats 20 --profile 32768 --budget-s $(( t - 60 )) \
    --out "$W/cp2_sbhd_same_call.json"
  echo "bench rc=$? at $(date +%T)"
) >"$W/bench.log" 2>&1 &
wait
grep -E "P=2|rc=" "$W/bench.log"; tail -12 "$W/suite.out"
tar -C $W -czf $O/call2.tgz . && ls -la $O
