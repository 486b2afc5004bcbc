#!/usr/bin/env bash
# Run 46 (nvidia-h200-x2, one call; twelfth session): issue 10's harness at this code (the tie rule, triton_swapab's
# cap at M = 32, no PDL), bf16 and fp16 spread over the two GPUs, no max-autotune (the device time left).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
timeout 240 python3 -m mlp_fuser bench --out $OUT/bench --gpus 2 --max-autotune-ms '' --budget-s 190 \
  --deadline-s 225 > $OUT/bench.log 2>&1
echo "bench rc=$?"
date -u; echo "took $(( $(date +%s) - S )) s"
tail -n 40 $OUT/bench.log | cut -c1-330
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
