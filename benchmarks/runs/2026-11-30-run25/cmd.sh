#!/usr/bin/env bash
# Run 25 (one H200, the session's last device seconds): Inductor's code calling the op's Python entry directly
# (mlp_fuser.inductor). First the GPU tests that run the op inside Inductor's CUDA-graph trees (time-boxed), then the
# 1b compile group at B=1: torch.compile vs torch.compile(backend=mlp_fuser.backend), dynamic cache, in turns.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
F="INFO:torch\|\] W1\|\] I1\|^W1\|^I1\|warnings.warn\|UserWarning"
date -u
timeout -s INT 60 python3 -m pytest -v -p no:cacheprovider tests/test_backend.py::test_gpu_reduce_overhead_replays_cuda_graphs \
  tests/test_gpu.py::test_gpu_first_calls_inside_inductor_cuda_graph_trees > $OUT/tests.log 2>&1
date -u
timeout 175 python3 benchmarks/bench_generate.py --out $OUT/1b --model 1b --units d2:1 2>&1 | grep -v "$F" \
  > $OUT/gen.log
date -u
grep -E "PASSED|passed|failed|FAILED|ERROR" $OUT/tests.log | tail -6
grep "ms/token\|FAILED\|fused" $OUT/gen.log | cut -c1-200
cat $OUT/1b/generate.md
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
