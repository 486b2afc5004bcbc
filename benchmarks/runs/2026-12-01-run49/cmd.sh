#!/usr/bin/env bash
# Run 49 (nvidia-h200-x2, one call; thirteenth session), two jobs side by side:
#   GPU 0, cores 0-15:  the GPU tests run 48's time box cut off: Inductor's CUDA-graph trees at M = 32-256 (dispatch
#                       and cublas_two_streams forced), the backend's reduce-overhead replay, the static-cache tokens
#                       against Inductor's, Inductor's code calling the op's entry, the patched module's eager entry;
#   GPU 1, cores 16-31: batched decode end to end, 8b dims, static cache + CompileConfig, Inductor against
#                       mlp_fuser.backend at B = 64 and 128 (decode M = 64 / 128: where cublas_two_streams is a
#                       candidate; issue 10's serving sizes through generate).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
(export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 0-15 timeout -s INT 300 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py tests/test_backend.py \
   -k "batched_sizes or test_gpu_reduce_overhead_replays or static_cache or calls_the_ops_entry or eager_entry" \
   > $OUT/tests.log 2>&1
 echo "tests ended at $(( $(date +%s) - S )) s" >> $OUT/tests.log) &
(export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 16-31 timeout 330 python3 benchmarks/bench_generate.py --out $OUT/batched --model 8b \
   --paths static,static_backend --batches 64,128 --budget-s 200 2>&1 | grep -v "$F" > $OUT/batched.log
 echo "batched ended at $(( $(date +%s) - S )) s" >> $OUT/batched.log) &
wait
date -u; echo "took $(( $(date +%s) - S )) s"
grep -E "PASSED|FAILED|ERROR|passed|failed|ended|Interrupt" $OUT/tests.log | sed 's/tests\/test_//' | cut -c1-140 | tail -30
grep -E "FAILED|rror" $OUT/tests.log | head -10 | cut -c1-300
grep -v "^INFO:torch" $OUT/batched.log | grep "ms/token\|chose\|ended\|FAILED\|rror" | cut -c1-330 | tail -20
cat $OUT/batched/generate.md
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
