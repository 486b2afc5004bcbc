#!/usr/bin/env bash
# Run 68 (typed, right after run 67): bench_kernels.py overhead:SmolLM2 on a host doing nothing else (runs 62-63 ran it right after GPU tests).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; ln -sfn ../patterns mlp_fuser/patterns; mkdir -p $OUT; F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"; S=$(date +%s); date -u
nproc; lscpu | grep "Model name"
timeout 70 python3 benchmarks/bench_kernels.py overhead:SmolLM2 > $OUT/overhead.log 2>&1; echo "overhead ended at $(( $(date +%s) - S )) s" >> $OUT/overhead.log
grep "^|\|ended\|rror" $OUT/overhead.log | cut -c1-160
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
