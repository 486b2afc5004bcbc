#!/usr/bin/env bash
# Run 65 (typed, right after run 64 on the same warm machine): the 8b dynamic-cache pair (unit d2).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; ln -sfn ../patterns mlp_fuser/patterns; mkdir -p $OUT; F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"; S=$(date +%s); date -u
timeout 565 python3 benchmarks/bench_generate.py --out $OUT/8b --model 8b --units d2:1,d2:8 2>&1 | grep -v "$F" > $OUT/gen8b.log; echo "8b ended at $(( $(date +%s) - S )) s" >> $OUT/gen8b.log
grep "ended\|rror\|ms/token\|^|" $OUT/gen8b.log | cut -c1-240
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
