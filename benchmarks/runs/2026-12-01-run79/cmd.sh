#!/usr/bin/env bash
# Run 79 (one H200; seventeenth session, call 2, right after run 78; carry [".wq/b"]). quack installed, then:
# 1. the GPU tests of gate and up stored as one and of quack, among them the CUDA-graph-trees test written after the
#    sixteenth session's last device call (never run), and examples/merge_gate_up.py on the GPU;
# 2. benchmarks/probe_chunk_pipeline.py (new): the MLP in chunks of I, the down GEMM of chunk j on a side stream beside
#    the gate/up of chunk j + 1, cuBLAS and quack, five shapes, M = 1-512, bf16;
# 3. benchmarks/probe_quack_gated.py --interleaved (written in the sixteenth session, never run): the row-interleaved
#    layout under the four configs, with plain-call µs (quack's host cost).
export PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
bash benchmarks/quack_wheels.sh install > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
Q=/tmp/q/site-packages
export PYTHONPATH=$Q:$Q/nvidia_cutlass_dsl/dsl_packages:$PWD
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "stored_as_one or quack" > $OUT/tests.log 2>&1
echo "tests ended at $(( $(date +%s) - S )) s" >> $OUT/tests.log
timeout 60 python3 examples/merge_gate_up.py > $OUT/example.log 2>&1; echo "example rc $? at $(( $(date +%s) - S )) s" >> $OUT/example.log
timeout 200 python3 benchmarks/probe_chunk_pipeline.py --quack 128x128 --budget-s 170 \
  --shapes 4096x11008,gelu4096x11008,8192x3584,4096x14336,3584x18944 > $OUT/chunks.log 2>&1
echo "chunks ended at $(( $(date +%s) - S )) s" >> $OUT/chunks.log
timeout $(( 580 - ($(date +%s) - S) )) python3 benchmarks/probe_quack_gated.py --interleaved --ms 128,512,2048 \
  --shapes 4096x11008,4096x14336 --configs 128x128-1x2-pingpong,128x96-1x2-pingpong,128x192-1x1-pingpong,128x224-1x2-coop \
  --budget-s $(( 540 - ($(date +%s) - S) )) > $OUT/interleaved.log 2>&1
echo "interleaved ended at $(( $(date +%s) - S )) s" >> $OUT/interleaved.log
date -u; echo "took $(( $(date +%s) - S )) s"
tail -4 $OUT/tests.log | cut -c1-250
tail -3 $OUT/example.log | cut -c1-250
grep "^|" $OUT/chunks.log | cut -c1-400
grep -i "wrong\|error\|budget\|fp32" $OUT/chunks.log | head
grep "^|\|budget\|rror" $OUT/interleaved.log | cut -c1-300 | tail -30
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
