#!/usr/bin/env bash
# Run 32 (nvidia-h200-x2, one call; tenth session): issue 9 part 5's 8b table in one command, at this code
# (launch plans for cublas_act_mul; prefill timed in 20 paired calls, order alternating).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u
timeout 580 python3 benchmarks/bench_generate.py --out $OUT/8b --model 8b --gpus 2 --budget-s 470 --deadline-s 560 \
  2>&1 | grep -v "$F" > $OUT/gen8b.log
date -u
grep "units\|ms/token\|prefill\|FAILED\|not started\|deadline\|ended\|M=2048" $OUT/gen8b.log | cut -c1-300
cat $OUT/8b/generate.md
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
