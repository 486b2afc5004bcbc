#!/usr/bin/env bash
# Run 66 (typed, right after run 65): the 8b prefill pairs (units p0, p1).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; ln -sfn ../patterns mlp_fuser/patterns; mkdir -p $OUT; F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"; S=$(date +%s); date -u
timeout 200 python3 benchmarks/bench_generate.py --out $OUT/8b --model 8b --paths prefill --units p0,p1 2>&1 | grep -v "$F" > $OUT/gen8b.log; echo "8b ended at $(( $(date +%s) - S )) s" >> $OUT/gen8b.log
grep "ended\|rror\|^|" $OUT/gen8b.log | cut -c1-240
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
