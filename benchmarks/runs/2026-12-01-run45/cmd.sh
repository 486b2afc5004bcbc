#!/usr/bin/env bash
# Run 45 (nvidia-h200-x2, one call; twelfth session): issue 9 part 5's 1b table at this code (the tie rule and the
# M = 32 cap of triton_swapab since run 39), its eight units over the two GPUs, --quiet-timing; then, if the call has
# time left, the patched MLP's host time in situ at decode (eager and patch, B=1, host µs per call inside the MLP
# and attention modules during one generate: the measurement the 1b patch rows were missing).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
timeout 400 python3 benchmarks/bench_generate.py --out $OUT/1b --model 1b --gpus ${GPUS:-2} --quiet-timing \
  --budget-s 290 --deadline-s 370 2>&1 | grep -v "$F" > $OUT/gen1b.log
date -u; echo "table took $(( $(date +%s) - S )) s"
LEFT=$(( 500 - $(date +%s) + S ))
if [ $LEFT -gt 60 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout $LEFT python3 benchmarks/bench_generate.py --out $OUT/insitu --model 1b \
    --paths eager,patch --batches 1 --time-modules 2>&1 | grep -v "$F" > $OUT/insitu.log
  echo "in situ rc=$?"
fi
date -u; echo "took $(( $(date +%s) - S )) s"
grep "units\|ms/token\|prefill\|FAILED\|not started\|deadline\|ended\|rror" $OUT/gen1b.log | cut -c1-250
cat $OUT/1b/generate.md
grep -i "µs\|host\|module" $OUT/insitu.log | tail -n 20 | cut -c1-250
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
