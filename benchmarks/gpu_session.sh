#!/usr/bin/env bash
# One device call: versions, the GPU test suite, then the benchmarks named in $BENCH (default: impls).
# Usage on the device machine: bash benchmarks/gpu_session.sh [tests|impls|bench|generate ...]
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# The package's patterns/ ships as mlp_fuser.patterns: without an install, link it in place.
[ -e mlp_fuser/patterns ] || ln -s ../patterns mlp_fuser/patterns
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case $step in
    tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_gpu.py tests/test_splitk.py 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    kernels) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -15 ;;
    impls) timeout ${IMPLS_TIMEOUT:-400} python3 benchmarks/bench_impls.py --shapes ${SHAPES:-0} 2>&1 | tee "$OUT/impls.log" | tail -20 ;;
    bench) timeout ${BENCH_TIMEOUT:-560} python3 -m mlp_fuser bench --out "$OUT" 2>&1 | tail -45 ;;
    generate) timeout ${GEN_TIMEOUT:-400} python3 benchmarks/bench_generate.py --out "$OUT" --models ${MODELS:-1,0} --phases ${PHASES:-prefill,decode} 2>&1 | tail -30 ;;
  esac
done
