#!/usr/bin/env bash
# Run 56 (one H200; fourteenth session, call 1 of 2 back to back: carry [".wq/a"], stages quack's first half again).
#   the GPU tests run 54 did not reach (its 170-s limit), and the planned cuBLAS paths again (now handed 2-D tensors);
#   bench_kernels.py overhead:SmolLM2 (the forced cublas_act_mul row shows the 2-D change; run 54: 73.0 µs);
#   the 1b prefill pair, patch vs eager (issue 9's missed cell; run 54: 0.975x, run 55: 0.978x).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
bash benchmarks/quack_wheels.sh stage > $OUT/stage.log 2>&1
timeout 190 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "planned_calls and (cublas_act_mul or \
triton_gemm-) or trees or two_streams_waits or reduce_overhead or patched_module" > $OUT/tests.log 2>&1
echo "tests ended at $(( $(date +%s) - S )) s" >> $OUT/tests.log
timeout 60 python3 benchmarks/bench_kernels.py overhead:SmolLM2 > $OUT/overhead.log 2>&1
echo "overhead ended at $(( $(date +%s) - S )) s" >> $OUT/overhead.log
timeout 80 python3 benchmarks/bench_generate.py --out $OUT/prefill --model 1b --paths prefill \
  --prefill-paths eager,patch 2>&1 | grep -v "$F" > $OUT/prefill.log
echo "prefill ended at $(( $(date +%s) - S )) s" >> $OUT/prefill.log
date -u; echo "took $(( $(date +%s) - S )) s"
cat $OUT/stage.log; tail -6 $OUT/tests.log | cut -c1-250
grep "^|\|ended\|rror" $OUT/overhead.log | cut -c1-160 | head -30
grep -i "ms\|ended\|rror" $OUT/prefill.log | tail -8 | cut -c1-220
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
