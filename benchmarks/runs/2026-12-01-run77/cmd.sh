#!/usr/bin/env bash
# Run 77 (one H200; sixteenth session, call 9, right after run 76; carry [".wq/b"]). Issue 10's M >= 512 target with
# gate and up stored as one: the harness's M = 512 rows of every shape, bf16, with the max-autotune peer (run 75's
# budget reached none of them; run 73 timed M = 2048).
export PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
bash benchmarks/quack_wheels.sh install > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
Q=/tmp/q/site-packages
export PYTHONPATH=$Q:$Q/nvidia_cutlass_dsl/dsl_packages:$PWD
timeout 230 python3 -m mlp_fuser bench --merged --dtypes bf16 --ms 512 --max-autotune-ms 512 --budget-s 215 \
  --out $OUT/bench_mat > $OUT/bench_mat.log 2>&1
echo "bench ended at $(( $(date +%s) - S )) s" >> $OUT/bench_mat.log
date -u; echo "took $(( $(date +%s) - S )) s"
grep "^|" $OUT/bench_mat/results.md | cut -c1-250
grep "ended\|skipped\|rror" $OUT/bench_mat.log | cut -c1-200 | tail -8
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
