#!/usr/bin/env bash
# Run 60 (one H200; fourteenth session): run 59 again with nine rounds (--rounds 9; its three rounds spread 11.5-18.9
# ms/token and gave paired ratios 0.992, 1.383, 1.162). Issue 9's last decode cell missed (run 44: 8b B=8 dynamic cache, backend vs
# torch.compile 0.996x), at this session's host path (plans call Triton's C launch function; cuBLAS handed 2-D
# tensors; _plain_call's cheaper checks). Alone in the call: its two compiles took 95 + 124 s in run 44, and run 53's
# attempt after the static pair ran out of time.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
timeout 470 python3 benchmarks/bench_generate.py --out $OUT/dynamic --model 8b --paths compile,backend --batches 8 --rounds 9 \
  2>&1 | grep -v "$F" > $OUT/dynamic.log
echo "dynamic ended at $(( $(date +%s) - S )) s" >> $OUT/dynamic.log
date -u; echo "took $(( $(date +%s) - S )) s"
grep "ms/token\|ended\|FAILED\|rror\|not started" $OUT/dynamic.log | cut -c1-250
cat $OUT/dynamic/generate.md 2>/dev/null
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
