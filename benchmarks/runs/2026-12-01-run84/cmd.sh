#!/usr/bin/env bash
# Run 84 (one H200; eighteenth session, call 1): the one-launch probe (issue 10, M <= 16): the whole MLP in one
# persistent launch with a grid barrier, beside the same kernel as two launches, the op's implementations, cuBLAS and a
# one-kernel read of all weight bytes. Prediction (NOTES): GELU + biases and the 70B shard at M = 1 from 47.5-48.4 µs
# to 45-46 µs.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 420 python3 benchmarks/probe_one_launch.py --budget-s 300 > $OUT/probe.log 2>&1
echo "probe rc $? at $(( $(date +%s) - S )) s" >> $OUT/probe.log
date -u; echo "took $(( $(date +%s) - S )) s"
grep -v "^|" $OUT/probe.log | cut -c1-400 | tail -14
grep "^|" $OUT/probe.log | cut -c1-400
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
