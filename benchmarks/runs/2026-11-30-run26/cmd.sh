#!/usr/bin/env bash
# Run 26 (nvidia-h200-x2, one call; ninth session): the direct call (mlp_fuser.inductor) measured on the H200.
#   1. The 1b table of issue 9 part 5 in one command, with the opt-in path backend_nodirect (the dynamic-cache
#      backend with Inductor's code going through the dispatcher) in the compile group, in turns with compile and
#      backend: the direct call's effect end to end, in one run.
#   2. Side by side: GPU 0 the GPU tests of tests/test_backend.py (torch 2.11: the direct call in generated code,
#      reduce-overhead replays, static cache tokens); GPU 1 `bench_kernels.py overhead` (host µs per call, now with
#      a compiled graph holding the op, direct and through the dispatcher, beside torch.compile's unfused MLP).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u; S=$(date +%s)
timeout 420 python3 benchmarks/bench_generate.py --out $OUT/1b --model 1b --gpus 2 --budget-s 320 --deadline-s 400 \
  --paths eager,patch,static,static_backend,compile,backend,backend_nodirect,prefill 2>&1 | grep -v "$F" > $OUT/gen1b.log
date -u; E=$(( $(date +%s) - S )); L=$(( 545 - E )); echo "1b table took $E s; $L s left"
(export CUDA_VISIBLE_DEVICES=0
 timeout -s INT $(( L < 120 ? L : 120 )) taskset -c 0-15 python3 -m pytest -v -p no:cacheprovider tests/test_backend.py \
   -k gpu > $OUT/tests.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=1
 taskset -c 16-31 timeout $L python3 benchmarks/bench_kernels.py overhead 2>&1 | grep -v "$F" > $OUT/overhead.log) &
wait
date -u
grep "units\|ms/token\|prefill\|FAILED\|not started\|deadline\|ended" $OUT/gen1b.log | cut -c1-200
cat $OUT/1b/generate.md
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/tests.log | cut -c1-200 | tail -12
grep "^|" $OUT/overhead.log | cut -c1-250
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
