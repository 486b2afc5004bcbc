#!/usr/bin/env bash
# Run 36 (nvidia-h200-x2, one call; eleventh session), two jobs side by side:
#   GPU 0, cores 0-15:  the GPU tests not yet run on the swap-AB down kernel (real down shapes against float64,
#                       race-free and deterministic; planned calls; no host synchronisation), then the fine-tuning
#                       step at this code (bench_train.py; the training rows predate the swap-AB kernel);
#   GPU 1, cores 16-31: the gate/up swap-AB probe (prediction in NOTES: 1.05-1.10x on gate/up at M = 16), then
#                       issue 10's harness, bf16 sections of all five shapes, in the time left (CUDA-graph medians).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
(export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 0-15 timeout -s INT 190 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py tests/test_splitk.py \
   -k "linear_splitk or planned_calls or no_host_synchronisation" > $OUT/tests.log 2>&1
 echo "tests ended at $(( $(date +%s) - S )) s" >> $OUT/tests.log
 taskset -c 0-15 timeout $(( 345 - ($(date +%s) - S) )) python3 benchmarks/bench_train.py --out $OUT/train \
   2>&1 | grep -v "$F" > $OUT/train.log) &
(export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 16-31 timeout 175 python3 benchmarks/probe_gate_up_swapab.py --budget-s 150 > $OUT/probe.log 2>&1
 L=$(( 340 - ($(date +%s) - S) ))
 taskset -c 16-31 timeout $(( L + 15 )) python3 -m mlp_fuser bench --units 0:bf16,1:bf16,3:bf16,4:bf16,2:bf16 \
   --budget-s $L --out $OUT/bench > $OUT/bench.log 2>&1) &
wait
date -u; echo "took $(( $(date +%s) - S )) s"
grep -E "PASSED|FAILED|ERROR|passed|failed|ended" $OUT/tests.log | cut -c1-150 | tail -30
tail -14 $OUT/train.log | cut -c1-200
grep "^|\|budget\|Error\|rror:" $OUT/probe.log | cut -c1-250 | tail -40
grep "^| " $OUT/bench/results.md | cut -d'|' -f2-7,9-10,13-14 | head -60
grep "^Skipped\|^Time" $OUT/bench/results.md | cut -c1-400
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
