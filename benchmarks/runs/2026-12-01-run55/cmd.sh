#!/usr/bin/env bash
# Run 55 (one H200; fourteenth session, call 2 of 2, right after run 54 on the same machine: carry [".wq/b"]).
# Issue 10 at M = 64-256: quack's sm90 gated GEMM (CuTe DSL, warp-specialised, act·mul in its epilogue) against cuBLAS's
# gate and up + our act·mul, in CUDA graphs, float64-checked (benchmarks/probe_quack_gated.py; NOTES "Next" has the
# prediction: quack's gate/up at 4096x11008 M = 128 <= 50 µs against cuBLAS's ~56). Then, in the time left, the 1b
# prefill pair once more (patch vs eager, at this session's host path).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - S) )); }
bash benchmarks/quack_wheels.sh install > $OUT/install.log 2>&1; echo "install rc=$? at $(( $(date +%s) - S )) s" >> $OUT/install.log
(export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
 timeout $(left 430) python3 benchmarks/probe_quack_gated.py --budget-s $(left 360) > $OUT/quack.log 2>&1)
echo "quack ended at $(( $(date +%s) - S )) s" >> $OUT/quack.log
timeout $(left 560) python3 benchmarks/bench_generate.py --out $OUT/prefill --model 1b --paths prefill \
  --prefill-paths eager,patch 2>&1 | grep -v "$F" > $OUT/prefill.log
echo "prefill ended at $(( $(date +%s) - S )) s" >> $OUT/prefill.log
date -u; echo "took $(( $(date +%s) - S )) s"
tail -5 $OUT/install.log | cut -c1-300
grep -v "^\s*$" $OUT/quack.log | tail -40 | cut -c1-300
grep -i "ms\|ended\|rror" $OUT/prefill.log | tail -12 | cut -c1-220
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
