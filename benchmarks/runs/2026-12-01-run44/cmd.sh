#!/usr/bin/env bash
# Run 44 (nvidia-h200-x2, one call; twelfth session): issue 9 part 5's 8b table at this code (the dispatcher's
# GPU+host tie rule and triton_swapab capped at M = 32 since the last table, run 38; no PDL: runs 42-43 refuted it),
# its eight units over the two GPUs of the host, each worker's timed rounds waiting until the other neither
# compiles nor times (4 GPUs are not lent today).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
timeout 560 python3 benchmarks/bench_generate.py --out $OUT/8b --model 8b --gpus ${GPUS:-2} --quiet-timing \
  --budget-s 460 --deadline-s 530 2>&1 | grep -v "$F" > $OUT/gen8b.log
date -u; echo "took $(( $(date +%s) - S )) s"
grep "units\|ms/token\|prefill\|FAILED\|not started\|deadline\|ended\|rror" $OUT/gen8b.log | cut -c1-250
cat $OUT/8b/generate.md
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
