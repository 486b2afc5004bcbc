#!/usr/bin/env bash
# Run 61 (one H200; fourteenth session, the device time left): issue 9's 8b prefill, backend vs torch.compile (run 44:
# 0.999x, paired median 1.007x), at this session's host path (the backend's graphs run without CUDA graphs there, so
# the op's plans run: C launch, cuBLAS handed 2-D tensors).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
timeout 185 python3 benchmarks/bench_generate.py --out $OUT/prefill --model 8b --paths prefill \
  --prefill-paths compile,backend 2>&1 | grep -v "$F" > $OUT/prefill.log
echo "prefill ended at $(( $(date +%s) - S )) s" >> $OUT/prefill.log
date -u; echo "took $(( $(date +%s) - S )) s"
grep -i "ms\|ended\|rror" $OUT/prefill.log | tail -8 | cut -c1-220
cat $OUT/prefill/generate.md 2>/dev/null
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
