#!/usr/bin/env bash
# Run 73 (one H200; sixteenth session, call 5, right after run 72 on the same warm machine, quack still installed in
# /tmp/q). End to end with gate and up stored as one: the 8b prefill (2048 tokens), eager / patch / patch_merged and
# compile / backend / backend_merged, in turns; then the harness's max-autotune peer at M = 2048 with --merged.
export PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
Q=/tmp/q/site-packages
[ -d $Q/quack ] || { echo "quack is gone (a fresh machine)"; }
export PYTHONPATH=$Q:$Q/nvidia_cutlass_dsl/dsl_packages:$PWD
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
timeout 250 python3 benchmarks/bench_generate.py --out $OUT/8b --model 8b --paths prefill \
  --prefill-paths eager,patch,patch_merged,compile,backend,backend_merged 2>&1 | grep -v "$F" > $OUT/gen8b.log
echo "prefill ended at $(( $(date +%s) - S )) s" >> $OUT/gen8b.log
timeout $(( 585 - ($(date +%s) - S) )) python3 -m mlp_fuser bench --merged --shapes 0,1,3,4 --dtypes bf16 \
  --ms 2048 --max-autotune-ms 2048 --budget-s $(( 560 - ($(date +%s) - S) )) --out $OUT/bench_mat > $OUT/bench_mat.log 2>&1
echo "bench ended at $(( $(date +%s) - S )) s" >> $OUT/bench_mat.log
date -u; echo "took $(( $(date +%s) - S )) s"
grep "ms\b\|ended\|rror\|^|" $OUT/gen8b.log | cut -c1-220 | tail -20
grep "^|" $OUT/bench_mat/results.md | cut -c1-250
grep "max-autotune\|ended\|skipped\|rror" $OUT/bench_mat.log | cut -c1-200 | tail -12
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
