#!/usr/bin/env bash
# Run 72 (one H200; sixteenth session, call 4, right after run 71; carry [".wq/b"]). The quack_gated_* dispatch
# candidates and merge_gate_up (issue 10), first on the GPU: quack installed; the GPU tests (quack's four configs
# against float64 plainly and in a CUDA graph, bf16/fp16; the layouts stored as one; the patched module; CUDA-graph
# trees); then the harness with gate and up stored as one (--merged) on the four SwiGLU shapes, M = 64-2048, bf16 and
# fp16 at 128/2048, no max-autotune (run 73 adds it).
export PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
bash benchmarks/quack_wheels.sh install > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
Q=/tmp/q/site-packages
export PYTHONPATH=$Q:$Q/nvidia_cutlass_dsl/dsl_packages:$PWD
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "quack or stored_as_one or patched_module \
or reduce_overhead or layouts" > $OUT/tests.log 2>&1
echo "tests ended at $(( $(date +%s) - S )) s" >> $OUT/tests.log
timeout $(( 585 - ($(date +%s) - S) )) python3 -m mlp_fuser bench --merged --shapes 0,1,3,4 --dtypes bf16,fp16 \
  --ms 64,128,256,512,2048 --fp16-ms 128,2048 --max-autotune-ms '' --budget-s $(( 560 - ($(date +%s) - S) )) \
  --out $OUT/bench_merged > $OUT/bench_merged.log 2>&1
echo "bench ended at $(( $(date +%s) - S )) s" >> $OUT/bench_merged.log
date -u; echo "took $(( $(date +%s) - S )) s"
tail -6 $OUT/tests.log | cut -c1-250
grep "^|" $OUT/bench_merged/results.md | cut -c1-250
grep "chose\|ended\|skipped\|rror" $OUT/bench_merged.log | cut -c1-300 | tail -30
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
