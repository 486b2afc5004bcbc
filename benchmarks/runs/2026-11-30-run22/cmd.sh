#!/usr/bin/env bash
# Run 22 (nvidia-h200-x2, one call):
#   1. issue 9 part 5 — the whole 1b table in one command, units spread over both GPUs (16 pinned cores each);
#   2. then, side by side:
#      GPU 0, cores 0-15:  the GPU tests (training step with three seeds pooled; the eager entry, graph trees, no
#                          synchronisation), then mutant.py (the training test must fail on a perturbed backward);
#      GPU 1, cores 16-31: 1b prefill eager vs patch with --profile-cpu (why patch's prefill trailed: runs 14, 16),
#                          then bench_impls on the 70B shard and 4096/11008 at M = 16-128 (gu:* split).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
timeout 370 python3 benchmarks/bench_generate.py --out $OUT/1b --model 1b --gpus 2 --budget-s 280 --deadline-s 350 \
  2>&1 | grep -v "$F" > $OUT/gen1b.log
date -u; E=$(( $(date +%s) - S )); L=$(( 555 - E )); echo "1b table took $E s; $L s left"
(export CUDA_VISIBLE_DEVICES=0
 timeout -s INT $(( L * 2 / 3 )) taskset -c 0-15 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py \
   -k "training_step and patch or synchronisation or patched or graph_trees" > $OUT/tests.log 2>&1
 R=$(( L - ($(date +%s) - S - E) )); echo "mutants get $R s" >> $OUT/tests.log
 timeout $R taskset -c 0-15 python3 benchmarks/runs/2026-11-30-run22/mutant.py 2>&1 | grep -v "$F" > $OUT/mutant.log) &
(export CUDA_VISIBLE_DEVICES=1
 taskset -c 16-31 timeout 120 python3 benchmarks/bench_generate.py --out $OUT/prefill --model 1b --paths prefill \
   --prefill-paths eager,patch --profile-cpu 2>&1 | grep -v "$F" > $OUT/prefill.log
 R=$(( L - ($(date +%s) - S - E) ))
 taskset -c 16-31 timeout $R python3 benchmarks/bench_impls.py --shapes 4,0 --ms 16,32,64,128 --budget-s $(( R - 25 )) \
   > $OUT/impls.log 2>&1) &
wait
date -u
grep "units\|ms/token\|prefill\|FAILED\|not started\|deadline\|ended" $OUT/gen1b.log | cut -c1-260
cat $OUT/1b/generate.md
grep -E "PASSED|FAILED|ERROR|passed|failed|mutants" $OUT/tests.log | cut -c1-200 | tail -16
cat $OUT/mutant.log | tail -4
grep -A16 "CPU side\|GPU side" $OUT/prefill.log | cut -c1-150 | head -80
tail -30 $OUT/impls.log | cut -c1-200
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
