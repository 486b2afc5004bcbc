#!/usr/bin/env bash
# Run 42 (nvidia-h200-x2, one call; twelfth session): programmatic dependent launch (PDL) for the two-kernel
# implementations. GPU 0: the GPU tests of the launch paths with PDL on (the new chain test among them), the chain
# test again with the wait removed from pdl_prologue on this copy (it must fail: the mutation check), then
# benchmarks/probe_pdl.py (each pair with PDL on and off, in turns). GPU 1: the issue-10 harness at this code, bf16
# and fp16, no max-autotune (python -m mlp_fuser bench).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
( CUDA_VISIBLE_DEVICES=1 timeout 420 python3 -m mlp_fuser bench --out $OUT/bench --budget-s 380 --max-autotune-ms '' \
    > $OUT/bench.log 2>&1 ) &
BENCH=$!
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q -x tests/test_gpu.py -p no:cacheprovider \
  -k "pdl or swapab or counters or cuda_graph or no_host" > $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/tests.log
cp mlp_fuser/kernels/common.py /tmp/common.py.bak
sed -i 's/        tl.extra.cuda.gdc_wait()/        pass/' mlp_fuser/kernels/common.py
grep -c "gdc_wait()" mlp_fuser/kernels/common.py
CUDA_VISIBLE_DEVICES=0 TRITON_CACHE_DIR=/tmp/tcache_mut timeout 120 python3 -m pytest -q tests/test_gpu.py \
  -p no:cacheprovider -k "pdl_chains" > $OUT/mutant.log 2>&1
echo "mutant rc=$? (must be nonzero)"; tail -3 $OUT/mutant.log
cp /tmp/common.py.bak mlp_fuser/kernels/common.py
echo "tests+mutant took $(( $(date +%s) - S )) s"
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 benchmarks/probe_pdl.py --budget-s $(( 500 - $(date +%s) + S )) \
  > $OUT/probe_pdl.log 2>&1
echo "probe rc=$?"
wait $BENCH; echo "bench rc=$?"
date -u; echo "took $(( $(date +%s) - S )) s"
grep -v "^|" $OUT/probe_pdl.log | tail -n 40 | cut -c1-400
sed -n '/PDL on against off/,$p' $OUT/probe_pdl.log
tail -n 30 $OUT/bench.log | cut -c1-300
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
