#!/usr/bin/env bash
# Run 75 (one H200; sixteenth session, call 7, right after run 74; carry [".wq/b"]). Issue 10: quack installed; the
# down GEMM probe (cuBLAS against quack's GEMM, heuristic and autotuned with split-K, M = 64-256); then the whole
# harness with gate and up stored as one (--merged: every shape, M, dtype and the max-autotune peer, in one call).
export PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
bash benchmarks/quack_wheels.sh install > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
Q=/tmp/q/site-packages
export PYTHONPATH=$Q:$Q/nvidia_cutlass_dsl/dsl_packages:$PWD
timeout 150 python3 benchmarks/probe_quack_down.py --budget-s 110 > $OUT/down.log 2>&1
echo "probe ended at $(( $(date +%s) - S )) s" >> $OUT/down.log
timeout $(( 590 - ($(date +%s) - S) )) python3 -m mlp_fuser bench --merged --budget-s $(( 570 - ($(date +%s) - S) )) \
  --out $OUT/bench_merged > $OUT/bench_merged.log 2>&1
echo "bench ended at $(( $(date +%s) - S )) s" >> $OUT/bench_merged.log
date -u; echo "took $(( $(date +%s) - S )) s"
grep "^|\|ended\|rror\|budget" $OUT/down.log | cut -c1-200
grep "^|" $OUT/bench_merged/results.md | cut -c1-250
grep "ended\|skipped\|rror" $OUT/bench_merged.log | cut -c1-200 | tail -8
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
