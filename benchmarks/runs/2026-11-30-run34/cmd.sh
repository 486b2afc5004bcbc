#!/usr/bin/env bash
# Run 34 (nvidia-h200-x2, one call; tenth session): the 8b host-bound rows again (eager and patch decode at B = 1
# and 8, the eager/patch prefill that run 32's budget cut), with --quiet-timing: a worker's timed rounds wait until
# the other worker is neither warming up nor timing (run 32's eager rounds: 24.7, 43.4, 44.4 ms/token).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u
timeout ${T:-200} python3 benchmarks/bench_generate.py --out $OUT/8b --model 8b --gpus 2 --quiet-timing \
  --paths eager,patch,prefill --prefill-paths eager,patch --units d0:1,d0:8,p0 --deadline-s $(( ${T:-200} - 12 )) \
  2>&1 | grep -v "$F" > $OUT/gen8b.log
date -u
grep "units\|ms/token\|prefill\|FAILED\|not started\|deadline\|ended\|hold" $OUT/gen8b.log | cut -c1-200
cat $OUT/8b/generate.md
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
