#!/usr/bin/env bash
# Run 64 (one H200, typed into the call right after run 63 on its warm machine): the 8b eager/patch pair again with 7 rounds (run 63's three rounds spread 0.82-1.45), then the 1b dynamic-cache pair (unit d2).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; ln -sfn ../patterns mlp_fuser/patterns; mkdir -p $OUT; F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"; S=$(date +%s); date -u
timeout 150 python3 benchmarks/bench_generate.py --out $OUT/8b --model 8b --units d0:1,d0:8 --rounds 7 2>&1 | grep -v "$F" > $OUT/gen8b.log; echo "8b ended at $(( $(date +%s) - S )) s" >> $OUT/gen8b.log
timeout $(( 560 - ($(date +%s) - S) )) python3 benchmarks/bench_generate.py --out $OUT/1b --model 1b --units d2:1,d2:8 2>&1 | grep -v "$F" > $OUT/gen1b.log; echo "1b ended at $(( $(date +%s) - S )) s" >> $OUT/gen1b.log
grep "ended\|rror\|^|" $OUT/gen8b.log $OUT/gen1b.log | cut -c1-240
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
