#!/usr/bin/env bash
# Run 83 (one H200; seventeenth session, call 6, the last): issue 10's table at the final code, as its acceptance
# asks: `python -m mlp_fuser bench` in one call, separate weights (quack not installed: its candidates need gate and
# up stored as one; run 75 is the merged table, whose op code is unchanged since), every shape, M = 1-8192, bf16 and
# fp16, the max-autotune peer on as many M >= 512 rows as the budget reaches.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
timeout 585 python3 -m mlp_fuser bench --budget-s 560 --out $OUT/bench > $OUT/bench.log 2>&1
echo "bench ended at $(( $(date +%s) - S )) s" >> $OUT/bench.log
date -u; echo "took $(( $(date +%s) - S )) s"
grep "^|" $OUT/bench/results.md | cut -c1-250
grep "ended\|skipped\|rror" $OUT/bench.log | cut -c1-200 | tail -8
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
