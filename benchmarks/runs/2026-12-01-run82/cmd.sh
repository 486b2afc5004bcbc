#!/usr/bin/env bash
# Run 82 (one H200; seventeenth session, call 5). No quack (separate weights everywhere here).
# 1. the op's host time per call (bench_kernels.py overhead:SmolLM2; run 81's crashed forcing quack at M = 1, mended);
# 2. probe_read_ceiling.py --down-sweep: the split-K down GEMM under ~22 configs (BLOCK_K, stages, programs per SM)
#    against cuBLAS and a read of its bytes, M = 1 and 16, three shapes (run 81: 74-88% of its floor against a read's
#    87-93%);
# 3. the fine-tuning step (bench_train.py) after the sixteenth session's dispatch change (last: run 54);
# 4. 8b decode, static cache + CompileConfig (issue 9's d1 at B = 1), in what time is left.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - S) )); }
timeout 60 python3 benchmarks/bench_kernels.py overhead:SmolLM2 > $OUT/overhead.log 2>&1
echo "overhead ended at $(( $(date +%s) - S )) s" >> $OUT/overhead.log
timeout 200 python3 benchmarks/probe_read_ceiling.py --down-sweep --shapes 4096x11008,8192x3584,3584x18944 \
  --budget-s 170 > $OUT/sweep.log 2>&1
echo "sweep ended at $(( $(date +%s) - S )) s" >> $OUT/sweep.log
timeout 200 python3 benchmarks/bench_train.py --out $OUT/train 2>&1 | grep -v "$F" > $OUT/train.log
echo "train ended at $(( $(date +%s) - S )) s" >> $OUT/train.log
timeout $(left 585) python3 benchmarks/bench_generate.py --out $OUT/8b --model 8b --units d1:1 \
  --budget-s $(left 560) 2>&1 | grep -v "$F" > $OUT/gen8b.log
echo "8b ended at $(( $(date +%s) - S )) s" >> $OUT/gen8b.log
date -u; echo "took $(( $(date +%s) - S )) s"
grep "^|\|ended\|rror" $OUT/overhead.log | cut -c1-160 | head -24
grep "^|\|budget\|WRONG\|rror" $OUT/sweep.log | cut -c1-300
grep "^|\|ended\|rror" $OUT/train.log | cut -c1-200 | tail -16
grep "^|\|ended\|skip\|rror" $OUT/gen8b.log | cut -c1-250 | tail -8
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
