#!/usr/bin/env bash
# Run 28 (nvidia-h200-x2, one call; ninth session), side by side:
#   GPU 0, cores 0-15:  the persistent whole-MLP kernel: its GPU tests (bf16 against float64, 50 calls bitwise
#                       equal; time-boxed, a wrong wait would hang), then `bench_kernels.py persistent` (against
#                       cublas_act_mul and triton_gemm, a few configs around the default).
#   GPU 1, cores 16-31: the 1b prefill pairs after f5f8d0a (eager choice at M >= 512), then the 8b static pair at
#                       B=1 with the step timed alone.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
(export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=16
 timeout -s INT 100 taskset -c 0-15 python3 -m pytest -v -p no:cacheprovider tests/test_persistent.py -k gpu \
   > $OUT/tests.log 2>&1
 R=$(( 470 - ($(date +%s) - S) )); echo "sweep gets $R s" >> $OUT/tests.log
 timeout $R taskset -c 0-15 python3 benchmarks/bench_kernels.py persistent > $OUT/persistent.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_COMPILE_THREADS=16
 timeout 160 taskset -c 16-31 python3 benchmarks/bench_generate.py --out $OUT/prefill1b --model 1b --paths prefill \
   2>&1 | grep -v "$F" > $OUT/prefill1b.log
 R=$(( 470 - ($(date +%s) - S) ))
 timeout $R taskset -c 16-31 python3 benchmarks/bench_generate.py --out $OUT/static8b --model 8b \
   --paths static,static_backend --batches 1 --step 2>&1 | grep -v "$F" > $OUT/static8b.log) &
wait
date -u
grep -E "PASSED|FAILED|ERROR|passed|failed|sweep gets" $OUT/tests.log | cut -c1-200 | tail -10
grep "^|\|Error\|WRONG" $OUT/persistent.log | cut -c1-400
grep "ms/token\|prefill\|M=2048\|step" $OUT/prefill1b.log $OUT/static8b.log | cut -c1-300
cat $OUT/prefill1b/generate.md $OUT/static8b/generate.md 2>/dev/null
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
