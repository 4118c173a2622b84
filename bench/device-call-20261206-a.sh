#!/usr/bin/env bash
# Device call A (issues 43/44): FLA 0.4.2 + the device's triton 3.6.0, today's patched tree:
# host syncs per micro-batch (bench/gdn_model.py, small geometry, counts only), the GPU suite's
# module + empty-segment jobs, and the #640 oracle sweep on the default set, side by side.
# Also stashes part 1 of triton 3.7.1 and the trees in /tmp for call B. One tarball back.
set -u
res=/tmp/res; mkdir -p $res /tmp/keep
[ -d .dev/tri-a ] && python3 .dev/split_wheel.py stash .dev/tri-a /tmp/wheel-parts > $res/stash.log 2>&1
cp .dev/trees.tgz .dev/split_wheel.py /tmp/keep/
tar xzf .dev/trees.tgz
export PYTHONUNBUFFERED=1 PYTHON=python3
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__)"; } > $res/gpu.txt 2>&1
sha256sum patches/latest/megatron.patch > $res/patch.sha256
( GDN_SUITE_ONLY="module empty" GDN_SUITE_BUDGET=420 GDN_SUITE_JOB_TIMEOUT=400 GDN_SUITE_MAX_RANKS=4 \
  GDN_SUITE_SAVE_CACHE=0 timeout 500 tools/gpu-suite $res/suite > $res/suite-driver.log 2>&1
  echo "suite rc=$?" >> $res/rc.txt ) &
( timeout 480 tools/bench-gdn --model --out $res/model --modes chunkwise,headwise,all_gather --layers 2,8 \
  --cp 1,2,4 --layouts thd,sbhd --recompute off,on --tokens 4096 --samples 8 --hidden 512 --key-heads 4 \
  --value-heads 8 --head-dim 64 --ffn-hidden 1024 --warmup 1 --repeats 1 --no-profile --deadline-s 440 \
  --timeout-s 400 > $res/model-driver.log 2>&1; echo "model rc=$?" >> $res/rc.txt ) &
( GDN_FLA_SET=0.4.2 GDN_FLA_SWEEP_LAYOUTS=single GDN_FLA_SWEEP_PROCS=6 GDN_FLA_SWEEP_TIMEOUT=220 \
  GDN_SUITE_SAVE_CACHE=0 timeout 480 tools/gpu-fla-sweep $res/sweep > $res/sweep-driver.log 2>&1
  echo "sweep rc=$?" >> $res/rc.txt ) &
wait
cat $res/rc.txt
tar czf $OUT/call-a.tgz -C $res .
tail -3 $res/model-driver.log $res/suite-driver.log $res/sweep-driver.log
