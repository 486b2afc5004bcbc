#!/usr/bin/env bash
# Run 40 (one H200; eleventh session), one after the other:
#   1. the 8b table's unit that run 38 did not reach (its budget rule): static cache, B=8, inductor against
#      CompileConfig(backend=mlp_fuser.backend), one process;
#   2. triton_swapab's config rule against the other swap-AB configs and against triton_gemm_splitk / triton_gemm,
#      whole MLP, M = 1-128, bf16 and fp16 (swapab_configs.py; why: its docstring).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
timeout 170 python3 benchmarks/bench_generate.py --out $OUT/8b --model 8b --paths static,static_backend --batches 8 \
  2>&1 | grep -v "$F" > $OUT/gen8b.log
L=$(( 290 - ($(date +%s) - S) )); date -u; echo "8b static B=8 took $(( $(date +%s) - S )) s; $L s left"
timeout $L python3 benchmarks/runs/2026-11-30-run40/swapab_configs.py $(( L - 25 )) > $OUT/configs.log 2>&1
date -u
grep "ms/token\|not started\|rror" $OUT/gen8b.log | cut -c1-200
grep "static" $OUT/8b/generate.md
grep "^|\|budget\|rror\|bar" $OUT/configs.log | cut -c1-200 | tail -50
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
