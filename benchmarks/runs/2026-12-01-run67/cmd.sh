#!/usr/bin/env bash
# Run 67 (typed, right after run 66): the 8b compiled prefill pair twice more (run 66 read 0.984x; Inductor's FX cache warm from run 66).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; ln -sfn ../patterns mlp_fuser/patterns; mkdir -p $OUT; F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"; S=$(date +%s); date -u
for r in a b; do timeout 100 python3 benchmarks/bench_generate.py --out $OUT/8b$r --model 8b --paths prefill --units p1 --prefill-paths compile,backend 2>&1 | grep -v "$F" > $OUT/gen8b$r.log; echo "8b $r ended at $(( $(date +%s) - S )) s" >> $OUT/gen8b$r.log; done
grep "ended\|rror\|^|" $OUT/gen8b*.log | cut -c1-240
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
