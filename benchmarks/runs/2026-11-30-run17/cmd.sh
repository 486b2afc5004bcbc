#!/usr/bin/env bash
# Run 17 (nvidia-h200-x4, one call): three jobs at once, each on its own GPUs and CPU cores.
#   GPU 0, cores 0-15:  8b decode, the compile group at B=1 (compile and backend, dynamic cache, in turns)
#   GPU 1, cores 16-31: the GPU tests, then bench_impls on the 70B shard and 4096x11008 at M = 16-128
#   GPU 2-3, cores 32-63: the issue-10 harness over two GPUs (bf16, fp16, max-autotune as the budget allows)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u
F="INFO:torch\|^W1\|^I1\|warnings.warn\|UserWarning"
(CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=16 taskset -c 0-15 timeout 555 python3 benchmarks/bench_generate.py \
   --out $OUT/g8 --model 8b --units d2:1 2>&1 | grep -v "$F" > $OUT/g8.log) &
(export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_COMPILE_THREADS=16
 timeout -s INT 320 taskset -c 16-31 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_splitk.py \
   tests/test_plans.py tests/test_kernels.py -k "gpu or splitk or plan" > $OUT/tests.log 2>&1
 timeout 200 taskset -c 16-31 python3 benchmarks/bench_impls.py --shapes 4,0 --ms 16,32,64,128 --budget-s 180 \
   > $OUT/impls.log 2>&1) &
(CUDA_VISIBLE_DEVICES=2,3 taskset -c 32-63 timeout 565 python3 -m mlp_fuser bench --gpus 2 --out $OUT/bench \
   --budget-s 480 --deadline-s 545 > $OUT/bench.log 2>&1) &
wait
date -u
grep -E "passed|failed|FAILED|ERROR" $OUT/tests.log | tail -15
grep -v "^ " $OUT/impls.log | tail -22
grep "ms/token\|not started\|FAILED" $OUT/g8.log
grep "^| " $OUT/bench/results.md | cut -d'|' -f2-7,9-10,13-14 | head -80
grep -A3 "^Targets" $OUT/bench/results.md | cut -c1-300; grep "^Skipped\|^Time" $OUT/bench/results.md | cut -c1-600
cd $OUT && tar czf all.tgz --exclude=all.tgz . && find . -type f ! -name all.tgz -delete
