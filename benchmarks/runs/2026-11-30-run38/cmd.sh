#!/usr/bin/env bash
# Run 38 (nvidia-h200-x4, one call; eleventh session): issue 9 part 5's 8b table at this code (the swap-AB down
# kernel and the triton_swapab candidate change what the dispatcher takes at decode sizes; every earlier 8b table
# predates both), its eight units spread over four GPUs, each worker's timed rounds waiting until no other worker
# compiles or times (--quiet-timing).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
timeout 575 python3 benchmarks/bench_generate.py --out $OUT/8b --model 8b --gpus ${GPUS:-4} --quiet-timing \
  --budget-s 470 --deadline-s 550 2>&1 | grep -v "$F" > $OUT/gen8b.log
date -u; echo "took $(( $(date +%s) - S )) s"
grep "units\|ms/token\|prefill\|FAILED\|not started\|deadline\|ended\|rror" $OUT/gen8b.log | cut -c1-250
cat $OUT/8b/generate.md
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
