#!/usr/bin/env bash
# Run 35 (one H200; tenth session): linear_splitk rewritten as swap-AB (the down half of triton_gemm_splitk; run 33's
# probe: 26.8 against cuBLAS 29.1 us at 4096x11008 M = 16). Its GPU checks (real down shapes in bf16/fp16 against
# float64 and 50 calls bitwise equal; the planned and dispatched triton_gemm_splitk calls; tests/test_splitk.py on the
# GPU), then the dispatcher's implementations alone beside the unfused module at M = 1-64 (impls_small_m.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u
timeout -s INT ${TT:-75} python3 -m pytest -q -p no:cacheprovider tests/test_splitk.py tests/test_gpu.py \
  -k "linear_splitk or interleaved or counters or (planned_calls and splitk) or (matches_float64 and splitk)" \
  > $OUT/tests.log 2>&1
date -u
timeout ${TB:-95} python3 benchmarks/runs/2026-11-30-run35/impls_small_m.py $(( ${TB:-95} - 25 )) \
  > $OUT/impls.log 2>&1
date -u
grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | cut -c1-200 | tail -12
grep "|\|budget\|Error" $OUT/impls.log | cut -c1-240 | tail -16
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
