#!/usr/bin/env bash
# Run 50 (one H200: two-GPU machines were not lent for run 49; thirteenth session):
#   1. batched decode end to end, 8b dims, static cache + CompileConfig, Inductor against mlp_fuser.backend at B = 64
#      and 128 (decode M = 64 / 128, where cublas_two_streams is a candidate: issue 10's serving sizes through generate);
#   2. issue 10's harness, the fp16 rows run 48 did not time (4096x14336, 3584x18944, the 70B shard), in the time left.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - S) )); }
timeout 300 python3 benchmarks/bench_generate.py --out $OUT/batched --model 8b --paths static,static_backend \
  --batches 64,128 --budget-s 170 2>&1 | grep -v "$F" > $OUT/batched.log
echo "batched ended at $(( $(date +%s) - S )) s" >> $OUT/batched.log
timeout $(left 420) python3 -m mlp_fuser bench --units 1:fp16,3:fp16,4:fp16 --max-autotune-ms '' \
  --budget-s $(left 405) --out $OUT/bench > $OUT/bench.log 2>&1
date -u; echo "took $(( $(date +%s) - S )) s"
grep -v "^INFO:torch" $OUT/batched.log | grep "ms/token\|chose\|ended\|FAILED\|rror" | cut -c1-330 | tail -20
cat $OUT/batched/generate.md
grep "^| " $OUT/bench/results.md | cut -d'|' -f2-7,9-10,13-14 | head -30
grep "^Skipped" $OUT/bench/results.md | cut -c1-300
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
