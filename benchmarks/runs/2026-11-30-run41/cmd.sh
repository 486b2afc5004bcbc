#!/usr/bin/env bash
# Run 41 (one H200; eleventh session): swapab_config as the in-flight-bytes model fitted on run 40. Its GPU tests
# (fp32 included: the model's deepest fp32 pipeline must compile), then issue 10's harness on the shapes whose
# configs changed most (3584x18944, the 70B shard 8192x3584), bf16 and fp16.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
timeout -s INT 80 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py tests/test_splitk.py -k "swapab or counters" \
  > $OUT/tests.log 2>&1
L=$(( 235 - ($(date +%s) - S) )); echo "tests took $(( $(date +%s) - S )) s; $L s left"
timeout $(( L + 10 )) python3 -m mlp_fuser bench --units 3:bf16,4:bf16,3:fp16,4:fp16 --budget-s $L --out $OUT/bench \
  > $OUT/bench.log 2>&1
date -u
grep -E "FAILED|ERROR|passed|failed|rror" $OUT/tests.log | cut -c1-150 | tail -8
grep "^| " $OUT/bench/results.md | cut -d'|' -f2-7,9-10,13-14 | grep -v "  512 \|  2048 \|  8192 " | head -30
grep "^Skipped\|^Time" $OUT/bench/results.md | cut -c1-300
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
