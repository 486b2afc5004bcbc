#!/usr/bin/env bash
# Run 24 (one H200, one call): the GPU tests that touch this session's change to mlp_fuser/bench.py (ShapeSetup.time's
# reference) and the op's outputs, then the down projection's sweep (bench_kernels.py down): cuBLAS against
# linear_splitk configs at M = 16-128 on 4096/11008 and the 70B shard, where run 23's gu split put the limit.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u
timeout -s INT 130 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "bench_times or matches_float64" \
  > $OUT/tests.log 2>&1
date -u
timeout 330 python3 benchmarks/bench_kernels.py down > $OUT/down.log 2> $OUT/down.err
date -u
grep -E "passed|failed|FAILED|ERROR" $OUT/tests.log | tail -8
cat $OUT/down.log
grep -v "^  " $OUT/down.err | tail -5; grep -c "^  " $OUT/down.err
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
