#!/usr/bin/env bash
# Run 23 (nvidia-h200-x2, one call), two jobs side by side:
#   GPU 0, cores 0-15:  the fine-tuning step at this code (bench_train.py, every variant, 4x1024 and 1x4096), then
#                       bench_impls on the 70B shard and 4096/11008 at M = 16-128 (the gu:* half, fixed after run 22);
#   GPU 1, cores 16-31: 8b static cache, Inductor vs CompileConfig(backend=mlp_fuser.backend), B = 1 and 8, in turns,
#                       with the decode step also timed alone (--step: GPU time, host per call, back to back).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u
(export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 0-15 timeout ${T0:-300} python3 benchmarks/bench_train.py --out $OUT/train 2>&1 | grep -v "$F" > $OUT/train.log
 taskset -c 0-15 timeout 115 python3 benchmarks/bench_impls.py --shapes 4,0 --ms 16,32,64,128 --budget-s 90 \
   > $OUT/impls.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 16-31 timeout ${T1:-420} python3 benchmarks/bench_generate.py --out $OUT/static --model 8b \
   --paths static,static_backend --batches 1,8 --step 2>&1 | grep -v "$F" > $OUT/static.log) &
wait
date -u
grep "ms/token\|step alone\|FAILED\|chose" $OUT/static.log | cut -c1-300
cat $OUT/static/generate.md
tail -16 $OUT/train.log | cut -c1-200
grep -v "^  gu" $OUT/impls.log | tail -24 | cut -c1-260
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
