#!/usr/bin/env bash
# One device call: versions, then the steps named on the command line, in order.
# Usage on the device machine: bash benchmarks/gpu_session.sh [tests|overhead|impls|bench|generate|train|probes ...]
#   tests: TESTS_K=<pytest -k expression> TEST_TIMEOUT=<s> (time-boxed with SIGINT, so the summary still prints)
#   generate: MODEL=1b|8b PATHS=eager,patch,... BATCHES=1,8 GEN_BUDGET=<s> GPUS=<n> (defaults: 1b, every path, 1,8,
#             330: no path group starts after 330 s, so a 600-s call ends with its table; 1 GPU. The 8b table takes
#             ~900 s on one GPU: GPUS=4 spreads its units over 4 GPUs; its longest unit, the compile group at one
#             batch size, took ~280 s on its own 16 cores in run 19)
#   probes: the three probes the twelfth session wrote (benchmarks/NOTES.md, "Next"): the swap-AB configs on the
#           plain MLP, cuBLAS's gate and up on two streams, the persistent TMA gate/up; PROBE_BUDGET=<s> each (100)
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
    tests) timeout -s INT ${TEST_TIMEOUT:-300} python3 -m pytest -v -p no:cacheprovider --durations=10 tests/test_plans.py \
             tests/test_gpu.py tests/test_splitk.py tests/test_backend.py tests/test_ops.py \
             -k "${TESTS_K:-plan or gpu or cuda or splitk}" 2>&1 | tee "$OUT/tests.log" \
             | grep -E "FAILED|ERROR|passed|failed|Interrupt" | tail -25 ;;  # SIGINT: pytest still prints its summary
    overhead) timeout ${OVERHEAD_TIMEOUT:-120} python3 benchmarks/bench_kernels.py overhead 2>&1 | tee "$OUT/overhead.log" | tail -60 ;;
    impls) timeout ${IMPLS_TIMEOUT:-300} python3 benchmarks/bench_impls.py --shapes ${SHAPES:-0,1,2,3,4} \
             --ms ${MS:-16,32,64,128,256} --budget-s ${IMPLS_BUDGET:-270} 2>&1 | tee "$OUT/impls.log" | tail -45 ;;
    bench) timeout ${BENCH_TIMEOUT:-560} python3 -m mlp_fuser bench --out "$OUT" --budget-s ${BENCH_BUDGET:-480} 2>&1 \
             | tee "$OUT/bench.log" | tail -20 ;;
    generate) timeout ${GEN_TIMEOUT:-570} python3 benchmarks/bench_generate.py --out "$OUT" --model ${MODEL:-1b} \
                --paths ${PATHS:-eager,patch,compile,backend,static,static_backend,prefill} --batches ${BATCHES:-1,8} \
                --budget-s ${GEN_BUDGET:-330} --gpus ${GPUS:-1} --deadline-s $(( ${GEN_TIMEOUT:-570} - 20 )) ${GEN_ARGS:-} 2>&1 | tee "$OUT/gen.log" | grep -v "^INFO:torch\|^W1\|^I1" | tail -40 ;;
    train) timeout ${TRAIN_TIMEOUT:-300} python3 benchmarks/bench_train.py --out "$OUT" ${TRAIN_ARGS:-} 2>&1 \
             | grep -v "^INFO:torch\|^W1\|^I1\|UserWarn\|warnings.warn" | tee "$OUT/train.log" | tail -20 ;;
    probes) B=${PROBE_BUDGET:-100}
            timeout $(( B + 60 )) python3 benchmarks/probe_swapab_configs.py --shapes 2 --ms 1,16,32 --budget-s $B 2>&1 \
              | tee "$OUT/probe_swapab_configs.log" | tail -8
            timeout $(( B + 60 )) python3 benchmarks/probe_two_streams.py --budget-s $B 2>&1 \
              | tee "$OUT/probe_two_streams.log" | tail -24
            (cd benchmarks && timeout $(( B + 60 )) python3 probe_gate_up_tma.py --budget-s $B 2>&1) \
              | tee "$OUT/probe_gate_up_tma.log" | tail -34 ;;
  esac
done
