#!/usr/bin/env bash
# Run 85 (one H200; eighteenth session, call 2): the one-launch probe again, with more programs per SM (run 84:
# one program per SM ran 60-70% of the floor; the barrier saved 0.2-1.0 µs over two launches). Each config as one
# launch and as two, beside the op's implementations and a one-kernel read of all weight bytes. Prediction: with
# 2-3 programs per SM the phases reach the op's speed, and one launch saves <= 1 µs over two (run 84's gap).
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
