#!/usr/bin/env bash
# Run 40 (one H200; eleventh session): triton_swapab's config rule against the other swap-AB configs and against
# triton_gemm_splitk / triton_gemm, whole MLP, M = 1-128, bf16 and fp16 (swapab_configs.py; why: its docstring).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u
timeout ${TB:-150} python3 benchmarks/runs/2026-11-30-run40/swapab_configs.py $(( ${TB:-150} - 25 )) > $OUT/configs.log 2>&1
date -u
grep "^|\|budget\|rror\|bar" $OUT/configs.log | cut -c1-200 | tail -50
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
