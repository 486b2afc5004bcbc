#!/usr/bin/env bash
# Run 31 (nvidia-h200-x2, tenth session), two jobs side by side:
#   GPU 0, cores 0-15:  the 1b prefill gap (patch 0.897-0.920x eager in runs 29-30): controls (prefill_control.py:
#                       a deepcopy, plans off, the garbage collector off, one MLP alone), then the bench's own pair
#                       with --time-modules (host us inside MLP and attention during the forward, GC passes);
#   GPU 1, cores 16-31: the fine-tuning step at this code (bench_train.py: recompute forwards now run launch plans),
#                       then the GPU tests of planned calls, no synchronisation and the training step.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
R=benchmarks/runs/2026-11-30-run31
date -u
(export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 0-15 timeout 130 python3 $R/prefill_control.py > $OUT/control.log 2>&1
 taskset -c 0-15 timeout 150 python3 benchmarks/bench_generate.py --out $OUT/prefill1b --model 1b --paths prefill \
   --prefill-paths eager,patch --time-modules 2>&1 | grep -v "$F" > $OUT/prefill1b.log) &
(export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 16-31 timeout 170 python3 benchmarks/bench_train.py --out $OUT/train 2>&1 | grep -v "$F" > $OUT/train.log
 taskset -c 16-31 timeout -s INT 170 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py \
   -k "planned_calls or no_host_synchronisation or training_step" > $OUT/tests.log 2>&1) &
wait
date -u
grep -v "^\s*$" $OUT/control.log | grep -v "Warning\|warn" | cut -c1-200 | tail -30
grep "host time inside\|prefill eager\|prefill patch" $OUT/prefill1b.log | cut -c1-400
tail -14 $OUT/train.log | cut -c1-200
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/tests.log | cut -c1-160 | tail -30
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
