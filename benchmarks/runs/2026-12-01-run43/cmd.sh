#!/usr/bin/env bash
# Run 43 (one H200; twelfth session): PDL's launch modes. Run 42 found mode "start" (each kernel lets the next launch
# as it starts) 0.72-1.01x against no PDL. First the GPU tests of the launch paths (the chain test in every mode,
# the planned swap-AB calls with the test's row count fixed, the counters), then benchmarks/probe_pdl.py with modes
# exit (no explicit signal), loop (signal after the main loop) and start, against off, in turns.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
timeout 150 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider \
  -k "pdl or (planned and swapab) or counters or cuda_graph_capture" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|Error" $OUT/tests.log | tail -8
echo "tests took $(( $(date +%s) - S )) s"
timeout 300 python3 benchmarks/probe_pdl.py --shapes 0,1,2,3,4 --ms 1,16 --modes exit,loop,start \
  --impls triton_gemm_splitk,triton_swapab --budget-s $(( 250 - $(date +%s) + S )) > $OUT/probe_pdl.log 2>&1
echo "probe rc=$?"
date -u; echo "took $(( $(date +%s) - S )) s"
sed -n '/PDL modes against off/,$p' $OUT/probe_pdl.log
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
