#!/usr/bin/env bash
# Run 30 (one H200; ninth session): cublas_act_mul's launch plan (c11eafc). Its GPU checks (planned calls against
# float64 in bf16/fp16/fp32, no host synchronisation), then the 1b prefill pairs (patch vs eager, backend vs compile).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u
timeout -s INT 100 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py -k "planned_calls or no_host_synchronisation" \
  > $OUT/tests.log 2>&1
date -u
timeout 150 python3 benchmarks/bench_generate.py --out $OUT/prefill1b --model 1b --paths prefill 2>&1 | grep -v "$F" \
  > $OUT/prefill1b.log
date -u
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/tests.log | cut -c1-200 | tail -16
grep "M=2048\|prefill" $OUT/prefill1b.log | cut -c1-300
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
