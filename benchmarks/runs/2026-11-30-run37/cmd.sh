#!/usr/bin/env bash
# Run 37 (nvidia-h200-x2, one call; eleventh session): the new dispatch candidate triton_swapab (gate/up swap-AB,
# whole K, then the swap-AB split-K down; run 36's probe: gate/up 1.02-1.12x the best other at M = 1-64 on three of
# four shapes). Two jobs side by side, then one merged harness table:
#   GPU 0, cores 0-15:  its GPU tests (float64 in three dtypes, planned calls, real sizes poisoned, counters), then
#                       issue 10's harness, fp16 sections;
#   GPU 1, cores 16-31: the harness, bf16 sections (run 36 had them at the code before, 175 s).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
(export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 0-15 timeout -s INT 120 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py tests/test_splitk.py \
   -k "swapab or counters" > $OUT/tests.log 2>&1
 echo "tests ended at $(( $(date +%s) - S )) s" >> $OUT/tests.log
 L=$(( 330 - ($(date +%s) - S) ))
 taskset -c 0-15 timeout $(( L + 15 )) python3 -m mlp_fuser bench --units 0:fp16,1:fp16,3:fp16,4:fp16,2:fp16 \
   --budget-s $L --out $OUT/bench/gpu0 > $OUT/bench0.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 16-31 timeout 345 python3 -m mlp_fuser bench --units 0:bf16,1:bf16,3:bf16,4:bf16,2:bf16 \
   --budget-s 330 --out $OUT/bench/gpu1 > $OUT/bench1.log 2>&1) &
wait
date -u; echo "took $(( $(date +%s) - S )) s"
python3 -c "
from mlp_fuser.bench import merge_workers, write_results
m, rows = merge_workers(['$OUT/bench/gpu0', '$OUT/bench/gpu1'], 'python -m mlp_fuser bench (run 37: fp16 sections on GPU 0 after the tests, bf16 on GPU 1)', 330)
write_results('$OUT/bench', m, rows)"
grep -E "PASSED|FAILED|ERROR|passed|failed|ended" $OUT/tests.log | cut -c1-150 | tail -30
grep "^| " $OUT/bench/results.md | cut -d'|' -f2-7,9-10,13-14 | grep -v "  512 \|  2048 \|  8192 " | head -70
grep -A7 "^| target" $OUT/bench/results.md | cut -c1-300; grep "^Skipped\|^Time" $OUT/bench/results.md | cut -c1-400
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
