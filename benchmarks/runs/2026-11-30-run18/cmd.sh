#!/usr/bin/env bash
# Run 18 (nvidia-h200-x2, one call): two jobs at once, each on its own GPU and CPU cores.
#   GPU 0, cores 0-15:  the issue-10 harness, every bf16 and fp16 section (a worker of `bench --gpus`: --units)
#   GPU 1, cores 16-31: the GPU tests, then the harness's max-autotune rows (M=2048 first) in the time left;
#   then both merged into one table by mlp_fuser.bench.merge_workers.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
S=$(date +%s); date -u
SECTIONS=0:bf16,1:bf16,2:bf16,3:bf16,4:bf16,0:fp16,1:fp16,2:fp16,3:fp16,4:fp16
(CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 timeout 565 python3 -m mlp_fuser bench --units $SECTIONS --budget-s 540 \
   --out $OUT/bench/gpu0 > $OUT/bench0.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=1
 timeout -s INT 250 taskset -c 16-31 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_splitk.py \
   tests/test_plans.py tests/test_kernels.py -k "gpu or splitk or plan" > $OUT/tests.log 2>&1
 L=$(( 545 - ($(date +%s) - S) ))
 taskset -c 16-31 timeout $(( L + 20 )) python3 -m mlp_fuser bench --units 0:mat,1:mat,2:mat,3:mat,4:mat --budget-s $L \
   --out $OUT/bench/gpu1 > $OUT/bench1.log 2>&1) &
wait
date -u
python3 -c "
from mlp_fuser.bench import merge_workers, write_results
m, rows = merge_workers(['$OUT/bench/gpu0', '$OUT/bench/gpu1'], 'python -m mlp_fuser bench (run 18: sections on GPU 0, max-autotune on GPU 1)', 540)
write_results('$OUT/bench', m, rows)"
grep -E "passed|failed|FAILED|ERROR" $OUT/tests.log | tail -15
grep "^| " $OUT/bench/results.md | cut -d'|' -f2-7,9-10,13-14 | head -80
grep -A8 "^Targets" $OUT/bench/results.md | cut -c1-160; grep "^Skipped\|^Time" $OUT/bench/results.md | cut -c1-400
cd $OUT && tar czf all.tgz --exclude=all.tgz . && find . -type f ! -name all.tgz -delete
