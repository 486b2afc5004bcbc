#!/usr/bin/env bash
# Run 19 (nvidia-h200-x2, one call): two jobs at once, each on its own GPU and CPU cores.
#   GPU 0, cores 0-15:  8b static cache, Inductor vs CompileConfig(backend=mlp_fuser.backend), B=1 and 8, in turns,
#                       each profiled (GPU timeline per token: busy, short gaps by the kernel after them, host waits);
#                       then the GPU tests not run yet at this code (time-boxed)
#   GPU 1, cores 16-31: 8b compile group at B=1 (torch.compile vs backend, dynamic cache, in turns)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u
F="INFO:torch\|^W1\|^I1\|warnings.warn\|UserWarning"
(export CUDA_VISIBLE_DEVICES=0
 taskset -c 0-15 timeout ${T0:-270} python3 benchmarks/bench_generate.py --out $OUT/static \
   --model 8b --paths static,static_backend --batches 1,8 \
   --profile-at 1:static,1:static_backend,8:static,8:static_backend 2>&1 | grep -v "$F" > $OUT/static.log
 timeout -s INT ${TT:-230} taskset -c 0-15 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py \
   -k "training_step or graph_trees or patched or splitk_gate_up or bench_times or synchronisation" > $OUT/tests.log 2>&1) &
(CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 timeout ${T1:-500} python3 benchmarks/bench_generate.py --out $OUT/compile \
   --model 8b --units d2:1 2>&1 | grep -v "$F" > $OUT/compile.log) &
wait
date -u
grep "ms/token\|FAILED\|not started\|GPU timeline\|profile 8b" $OUT/static.log $OUT/compile.log | cut -c1-230
grep -A11 "GPU timeline" $OUT/static.log | cut -c1-150
grep "chose" $OUT/static.log | cut -c1-300
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/tests.log | cut -c1-160 | tail -20
cat $OUT/static/generate.md $OUT/compile/generate.md 2>/dev/null
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
