#!/usr/bin/env bash
# Run 70 (one H200; sixteenth session, call 2, right after run 69 on the same warm machine; carry [".wq/b"]). Issue 10:
# quack installed from the two halves, then benchmarks/probe_quack_gated.py: first its default rows (M = 64-256, the
# four harness SwiGLU shapes, runs 57-58's six winning configs; the first table again and the second table, which has
# never run: the whole MLP measured with quack + cuBLAS or split-K down, and the down GEMM alone), then M = 512, 2048.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
bash benchmarks/quack_wheels.sh install > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
Q=/tmp/q/site-packages
export PYTHONPATH=$Q:$Q/nvidia_cutlass_dsl/dsl_packages:$PWD
timeout 300 python3 benchmarks/probe_quack_gated.py --budget-s 240 > $OUT/quack.log 2>&1
echo "probe ended at $(( $(date +%s) - S )) s" >> $OUT/quack.log
timeout $(( 570 - ($(date +%s) - S) )) python3 benchmarks/probe_quack_gated.py --ms 512,2048 \
  --shapes 4096x11008,4096x14336 --budget-s 200 > $OUT/quack_large.log 2>&1
echo "probe ended at $(( $(date +%s) - S )) s" >> $OUT/quack_large.log
date -u; echo "took $(( $(date +%s) - S )) s"
grep -v "^ *$" $OUT/quack.log | tail -60 | cut -c1-200
grep -v "^ *$" $OUT/quack_large.log | tail -30 | cut -c1-200
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
