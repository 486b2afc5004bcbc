#!/usr/bin/env bash
# Run 29 (one H200; ninth session): why the 1b prefill of patch and backend trailed in runs 26 and 28 (0.911x eager,
# 0.845x compile in run 28, with cublas_act_mul chosen for both), profiled: CPU side (synchronisations, the op's
# host time) and GPU kernels per forward, every path. Then the persistent kernel's GPU test (bf16, race-free).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u
timeout 230 python3 benchmarks/bench_generate.py --out $OUT/prefill1b --model 1b --paths prefill --profile-cpu 2>&1 \
  | grep -v "$F" > $OUT/prefill1b.log
date -u
timeout -s INT 80 python3 -m pytest -v -p no:cacheprovider tests/test_persistent.py -k gpu > $OUT/tests.log 2>&1
date -u
grep -v "^\s*$" $OUT/prefill1b.log | grep -v "chose\|INFO" | cut -c1-160 | head -150
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/tests.log | cut -c1-200 | tail -8
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
