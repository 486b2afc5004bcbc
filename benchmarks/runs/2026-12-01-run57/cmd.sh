#!/usr/bin/env bash
# Run 57 (one H200; fourteenth session, call 2 of 2, right after run 56 on the same machine: carry [".wq/b"]).
# Run 55 again with quack installed under a site-packages path (run 55: every quack call refused by quack's own
# compile-cache keyer): quack's sm90 gated GEMM against cuBLAS's gate and up + our act·mul, in CUDA graphs, float64-
# checked (benchmarks/probe_quack_gated.py; prediction in NOTES: quack's gate/up at 4096x11008 M = 128 <= 50 µs
# against cuBLAS's ~56).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - S) )); }
bash benchmarks/quack_wheels.sh install > $OUT/install.log 2>&1; echo "install rc=$? at $(( $(date +%s) - S )) s" >> $OUT/install.log
(Q=/tmp/q/site-packages; export PYTHONPATH=$Q:$Q/nvidia_cutlass_dsl/dsl_packages:$PWD
 timeout $(left 400) python3 benchmarks/probe_quack_gated.py --budget-s $(left 330) > $OUT/quack.log 2>&1)
echo "quack ended at $(( $(date +%s) - S )) s" >> $OUT/quack.log
date -u; echo "took $(( $(date +%s) - S )) s"
tail -3 $OUT/install.log | cut -c1-300
grep -v "^\s*$" $OUT/quack.log | tail -40 | cut -c1-400
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
