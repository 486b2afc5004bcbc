#!/usr/bin/env bash
# Run 52 (one H200; thirteenth session):
#   1. can test_gpu_two_streams_waits_for_the_side_stream fail? A mutant of cublas_two_streams without the join (the
#      caller's stream no longer waits for the side stream before act·mul reads u), edited in the device's copy only:
#      the test must fail there;
#   2. the toolchain a CUDA C++ GEMM would need (nvcc, CUTLASS/CuTe headers, the cutlass Python DSL), for planning.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ln -sfn ../patterns mlp_fuser/patterns
mkdir -p $OUT
date -u; S=$(date +%s)
sed -i 's/^    here.wait_stream(side)  # u is written$/    pass  # mutant: no join/' mlp_fuser/dispatch.py
grep -n "mutant" mlp_fuser/dispatch.py
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "two_streams_waits" > $OUT/mutant.log 2>&1
echo "mutant tests ended at $(( $(date +%s) - S )) s (rc $?)"
grep -E "passed|failed|^E .*assert|Interrupt" $OUT/mutant.log | cut -c1-200 | head -8
git checkout mlp_fuser/dispatch.py 2>/dev/null || true
{ which nvcc; nvcc --version 2>&1 | tail -2; ls -d /usr/local/cuda* 2>&1; ls /usr/local/cuda/include/cute 2>&1 | head -3;
  python3 -c "import cutlass; print('cutlass', cutlass.__version__)" 2>&1 | tail -1;
  python3 -m pip list 2>/dev/null | grep -i -E "cutlass|cuda|nvidia-cu|quack|liger|flash" ; } > $OUT/toolchain.log 2>&1
cat $OUT/toolchain.log | cut -c1-200 | head -40
cd $OUT && tar czf /tmp/all.tgz . ; mv /tmp/all.tgz . && find . -type f ! -name all.tgz -delete
