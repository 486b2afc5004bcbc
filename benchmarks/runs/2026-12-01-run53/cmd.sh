#!/usr/bin/env bash
# Run 53 (one H200; thirteenth session, the device time left): issue 9's two 8b decode cells missed in run 44, again at
# this session's code (nothing on their paths changed: cublas_two_streams is a candidate at M = 17-256 only, the plain
# swap-AB config is for ungated MLPs): the static-cache pair at B = 1 and 8, then the dynamic-cache pair at B = 8.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
timeout 190 python3 benchmarks/bench_generate.py --out $OUT/static --model 8b --paths static,static_backend \
  --batches 1,8 --budget-s 120 2>&1 | grep -v "$F" > $OUT/static.log
echo "static ended at $(( $(date +%s) - S )) s" >> $OUT/static.log
timeout $(( 350 - ($(date +%s) - S) )) python3 benchmarks/bench_generate.py --out $OUT/dynamic --model 8b \
  --paths compile,backend --batches 8 2>&1 | grep -v "$F" > $OUT/dynamic.log
echo "dynamic ended at $(( $(date +%s) - S )) s" >> $OUT/dynamic.log
date -u; echo "took $(( $(date +%s) - S )) s"
grep "ms/token\|ended\|FAILED\|rror\|not started" $OUT/static.log $OUT/dynamic.log | cut -c1-250
cat $OUT/static/generate.md $OUT/dynamic/generate.md 2>/dev/null
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
