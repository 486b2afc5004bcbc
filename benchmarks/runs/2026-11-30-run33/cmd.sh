#!/usr/bin/env bash
# Run 33 (nvidia-h200-x2, one call; tenth session):
#   1. issue 9 part 5's 1b table in one command at this code (both GPUs, --gpus 2);
#   2. then side by side in what is left of the call:
#      GPU 0, cores 0-15:  issue 10's probe of a TMA swap-AB split-K down GEMM against cuBLAS (probe_down_tma.py);
#      GPU 1, cores 16-31: the 4x1024 fine-tuning step again, eager and patch in two rounds, profiled (run 31 had
#                          patch-save 0.91x eager there, 1.08x in run 23, with the 1x4096 rows unchanged).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
timeout 420 python3 benchmarks/bench_generate.py --out $OUT/1b --model 1b --gpus 2 --budget-s 320 --deadline-s 400 \
  2>&1 | grep -v "$F" > $OUT/gen1b.log
date -u; E=$(( $(date +%s) - S )); L=$(( 560 - E )); echo "1b table took $E s; $L s left"
(export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 0-15 timeout $L python3 benchmarks/probe_down_tma.py --budget-s $(( L - 25 )) > $OUT/probe.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_COMPILE_THREADS=16
 taskset -c 16-31 timeout $L python3 benchmarks/bench_train.py --out $OUT/train --shapes 4x1024 --profile \
   --variants eager,patch-save,patch-recompute,eager,patch-save 2>&1 | grep -v "$F" > $OUT/train.log) &
wait
date -u
grep "units\|ms/token\|prefill\|FAILED\|not started\|deadline\|ended" $OUT/gen1b.log | cut -c1-200
cat $OUT/1b/generate.md
grep "^|\|budget\|Error" $OUT/probe.log | cut -c1-250 | tail -45
grep "profile\|^4" $OUT/train.log | cut -c1-160
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
